"""Jobs split into shards of whole structures, run as tasks on a dask.distributed cluster.

Each task opens the input itself (on a filesystem the workers share) and returns its partial
result, which is small (statistics, not arrays of atoms); the client combines the parts in
shard order, so a run gives the same result whichever worker ran which shard, and a task
retried after its worker died is counted once. Dask is an optional extra:
`pip install 'segcli[cluster]'`.
"""

import contextlib

import numpy as np

from segcli.errors import DataError

SHARDS_PER_WORKER = 4


def shard_bounds(n_atoms, shards):
    """The shards + 1 structure boundaries splitting structures of `n_atoms` atoms into
    contiguous ranges of whole structures with nearly equal atom counts: range k ends at the
    first structure where the running count reaches (k + 1)·total/shards (the same split on
    every machine)."""
    running = np.cumsum(n_atoms, dtype=np.int64)
    total = int(running[-1]) if len(running) else 0
    targets = np.arange(1, shards, dtype=np.int64) * total // shards
    cuts = np.searchsorted(running, targets, side="left") + 1
    return [0, *np.minimum(cuts, len(n_atoms)).tolist(), len(n_atoms)]


@contextlib.contextmanager
def cluster_client(address):
    """A dask.distributed Client of the scheduler at `address`, or of a new cluster of K worker
    processes for "local:K"; closed (the local cluster shut down) when the block ends.
    ImportError naming the extra when dask.distributed is not installed."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError as err:
        raise ImportError("--scheduler needs dask.distributed: pip install "
                          "'segcli[cluster]'") from err
    if address.startswith("local:"):
        workers = int(address.split(":", 1)[1])
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            yield client
    else:
        try:
            client = Client(address)
        except (OSError, TimeoutError) as err:
            raise DataError(f"the dask scheduler at {address} cannot be reached ({err})") from err
        with client:
            yield client


def _stats_part(layout, names, options, start, stop):
    from segcli.io import open_inputs
    from segcli.stats import field_stats

    with open_inputs(layout) as batch:
        return field_stats(batch, names, structures=slice(start, stop), **options)


def field_stats_on(client, layout, names, structures=slice(None), **options):
    """segcli.stats.field_stats of the batch `layout` (see Batch.layout) describes, computed
    shard by shard on the cluster of `client` (each worker opening only the files of its
    shard) and combined exactly (Chan's formulas, in shard order)."""
    from segcli.stats import merge_stats

    start, stop, _ = structures.indices(sum(len(n) for n in layout.n_atoms))
    n_atoms = np.concatenate(layout.n_atoms)[start:stop]
    shards = max(1, min(len(n_atoms), SHARDS_PER_WORKER * len(client.nthreads())))
    bounds = start + np.array(shard_bounds(n_atoms, shards))
    futures = [client.submit(_stats_part, layout, list(names), options, int(a), int(b),
                             pure=False) for a, b in zip(bounds[:-1], bounds[1:])]
    return merge_stats(client.gather(futures))
