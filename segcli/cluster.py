"""Jobs split into shards of whole structures, run one after another here or as tasks on a
dask.distributed cluster: a job maps its shards to partial results and combines them once.

Each task opens the input itself (on a filesystem the workers share) and returns what is
small: statistics' leaves, or the device it computed on, having written its results into
their rows of the output's file or into a part file beside the output (results never go
through the scheduler). The client combines the partial results in shard order, so a run
gives the same result whichever worker ran which shard, and a task retried after its worker
died is counted once (it writes the same rows, or replaces its part file whole). Dask is an
optional extra: `pip install 'segcli[cluster]'`.
"""

import contextlib
import itertools
import logging
import os
import subprocess

import numpy as np

from segcli.errors import DataError

SHARDS_PER_WORKER = 4
CONNECT_SECONDS = 10
"""The longest a scheduler is waited for (less where Dask's distributed.comm.timeouts.connect
says so): a server that is no Dask scheduler may never answer."""
WORKER_MODULES = ("segcli.api.compute", "segcli.engine", "segcli.io.direct", "segcli.io.hdf5",
                  "segcli.curate.selection", "segcli.shards", "segcli.curate.statistics")
"""What tasks import (with numpy and h5py): loaded once in the server that forks a local
cluster's workers. Not segcli.ops, whose import starts threads that a fork would not carry
over, nor JAX and Warp, which `stats` would wait for (each worker of `reduce` imports them)."""


def visible_gpus(environ=os.environ):
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them, else as
    `nvidia-smi -L` lists them (none without it)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60,
                                check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listed.stdout.splitlines())
            if line.startswith("GPU ")] if listed.returncode == 0 else []


def _local_cluster(address):
    """A new cluster here: K single-threaded worker processes for "local:K"; for "local:gpus"
    one per visible GPU, each seeing only its own (dask-cuda's LocalCUDACluster when it is
    installed). Its workers preload this module (see dask_setup)."""
    from dask.distributed import LocalCluster, Nanny, Scheduler, SpecCluster

    count = address.split(":", 1)[1]
    # workers' own logs say nothing the client does not report (a task's error), and a worker
    # whose heartbeat meets a scheduler closing after such an error logs a traceback
    quiet = {"dashboard_address": ":0", "silence_logs": logging.CRITICAL}
    if count != "gpus":
        return LocalCluster(n_workers=int(count), threads_per_worker=1, processes=True,
                            env=_threads_share(int(count)), preload=[__name__], **quiet)
    gpus = visible_gpus()
    if not gpus:
        raise DataError("--scheduler local:gpus: no GPU is visible (CUDA_VISIBLE_DEVICES or "
                        "nvidia-smi -L lists none)")
    share = _threads_share(len(gpus))
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        workers = {f"gpu-{gpu}": {"cls": Nanny, "options": {
            "nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": gpu, **share},
            "preload": [__name__], "silence_logs": logging.CRITICAL}} for gpu in gpus}
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
        return SpecCluster(workers, scheduler, silence_logs=logging.CRITICAL)
    return LocalCUDACluster(CUDA_VISIBLE_DEVICES=gpus, threads_per_worker=1, env=share,
                            preload=[__name__], **quiet)


def dask_setup(worker):
    """Run as a worker that preloads this module starts (those of --scheduler local:..., or
    `dask worker --preload segcli.cluster`): it keeps freed host blocks for reuse, as the
    segcli program does (see segcli.keep_freed_buffers). Without, a worker's tasks
    fault in fresh pages for every chunk (benchmarks/RESULTS.md, cluster.py)."""
    from segcli import keep_freed_buffers

    keep_freed_buffers()


def start_worker_server():
    """Start the server that forks a local cluster's workers, in the background: it imports
    dask.distributed and WORKER_MODULES while this process does its own work, and each worker
    it forks then starts with them loaded. It has none of this process's threads or open
    files, unlike a plain fork. False, and nothing started, where processes cannot be forked
    or without Dask."""
    import importlib.util
    import multiprocessing
    from multiprocessing import forkserver

    if ("forkserver" not in multiprocessing.get_all_start_methods()
            or importlib.util.find_spec("distributed") is None):
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["distributed", __name__, *WORKER_MODULES])
    forkserver.ensure_running()
    return True


@contextlib.contextmanager
def _forked_workers():
    """Worker processes started in the block are forked by start_worker_server's server,
    where it runs (else spawned, Dask's default)."""
    import dask

    if not start_worker_server():
        yield
        return
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        yield


def _threads_share(workers):
    """The environment that gives each of `workers` processes here its share of this
    process's threads (see segcli.threads)."""
    from segcli import threads

    return {"SEGCLI_THREADS": str(threads.share(workers))}


@contextlib.contextmanager
def cluster_client(address):
    """A dask.distributed Client of the scheduler at `address`, or of a new cluster here for
    "local:K" or "local:gpus" (see _local_cluster), shut down when the block ends."""
    from dask.distributed import Client

    if address.startswith("local:"):
        with _forked_workers(), _local_cluster(address) as cluster, Client(cluster) as client:
            yield client
    else:
        seconds = _connect_seconds()
        _check_scheduler(address, seconds)
        try:
            client = Client(address, timeout=seconds)
        except (OSError, TimeoutError) as err:
            raise DataError(f"the dask scheduler at {address} cannot be reached ({err})") from err
        with client:
            yield client


def _connect_seconds():
    import dask
    from dask.utils import parse_timedelta

    return min(CONNECT_SECONDS, parse_timedelta(dask.config.get(
        "distributed.comm.timeouts.connect"), default="seconds"))


def _check_scheduler(address, seconds):
    """DataError unless a dask scheduler answers at `address` within about `seconds` (the Client
    would wait for ever for a server that accepts and then says nothing, and so may Dask's
    handshake: it is asked in a thread left behind if it does not end in time)."""
    import asyncio
    import threading

    from distributed.comm import connect

    async def identity():
        comm = await connect(address, timeout=seconds)
        try:
            await asyncio.wait_for(comm.write({"op": "identity", "reply": True}), seconds)
            return await asyncio.wait_for(comm.read(), seconds)
        finally:
            comm.abort()

    outcome = {}

    def ask():
        try:
            outcome["reply"] = asyncio.run(identity())
        except Exception as err:  # noqa: BLE001  (refused, reset, timed out, a bad address)
            outcome["error"] = err

    thread = threading.Thread(target=ask, name="segcli-scheduler-check", daemon=True)
    thread.start()
    thread.join(2 * seconds + 0.5)
    if thread.is_alive():
        raise DataError(f"{address}: no dask scheduler answers there within {seconds:g} s")
    if "error" in outcome:
        err = outcome["error"]
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if address.startswith("inproc://"):
            reason = "an inproc address names a scheduler in this same process, and none is there"
        raise DataError(f"the dask scheduler at {address} cannot be reached ({reason})") from err
    reply = outcome["reply"]
    if not (isinstance(reply, dict) and reply.get("type") == "Scheduler"):
        raise DataError(f"{address}: answers, but is no dask scheduler")


def shard_count(client, n_structures):
    """How many shards a job on `client`'s cluster is split into: a few per worker thread (so
    that a slow or lost worker delays little), at most one per structure, at least one."""
    return max(1, min(n_structures, SHARDS_PER_WORKER * sum(client.nthreads().values())))


def shared(client, value):
    """`value` as a Future on `client`'s cluster that tasks receive as the value, for an
    argument of every task that is large, such as a batch's layout: sent once, and fetched
    by each worker from the others. It is the result of a task that unpickles it, not
    scattered data, so that the scheduler computes it again where the workers holding it
    died (Dask keeps one replica of what no task waits for, and lost scattered data is lost
    for good, with every task that needs it)."""
    import pickle

    import dask
    from dask.utils import parse_bytes

    blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    # the blob is sent once, whatever its size: Dask warns of large graphs for what else is
    threshold = "distributed.admin.large-graph-warning-threshold"
    with dask.config.set({threshold: parse_bytes(dask.config.get(threshold)) + len(blob)}):
        return client.submit(pickle.loads, blob, pure=False)


def map_shards(client, function, calls, progress=None, sizes=None):
    """[function(*call) for call in calls], in that order: on `client`'s cluster, one task per
    call, or here one after another when `client` is None (see shards_as_done)."""
    done = dict(shards_as_done(client, function, calls, progress, sizes))
    return [done[k] for k in range(len(calls))]


def shards_as_done(client, function, calls, progress=None, sizes=None):
    """(k, function(*calls[k])) for each call as it finishes: on `client`'s cluster, one task
    per call, in the order they end, or here one after another when `client` is None; so the
    caller uses each result while the others compute. The first task to raise DataError
    raises it here, and the tasks not yet done are cancelled when the caller stops early. As
    call k finishes, `progress.update(sizes[k])` is called (1 without `sizes`; see
    segcli.cli.common.progress)."""
    sizes = [1] * len(calls) if sizes is None else [int(n) for n in sizes]
    if client is None:
        for k, call in enumerate(calls):
            value = function(*call)
            if progress is not None:
                progress.update(sizes[k])
            yield k, value
        return
    from dask.distributed import as_completed

    futures = [client.submit(_task, function, *call, pure=False) for call in calls]
    index = {future.key: k for k, future in enumerate(futures)}
    try:
        # each result fetched by the client's own thread as its task ends, not one by one here
        for future, outcome in as_completed(futures, with_results=True, raise_errors=False):
            k = index[future.key]
            value, error = _outcome(future, outcome, f"shard {k + 1} of {len(calls)}")
            if error is not None:
                raise error
            if progress is not None:
                progress.update(sizes[k])
            yield k, value
    finally:
        pending = [future for future in futures if not future.done()]
        if pending:
            client.cancel(pending)


def _outcome(future, outcome, name):
    """The (value, DataError or None) of a _task's ended `future` from its `outcome` (as
    as_completed gives it without raising), or DataError where the cluster lost the task
    `name`: its workers kept dying, or the scheduler cancelled it. A task's own failure
    raises as it is."""
    from dask.distributed import KilledWorker

    if future.status == "finished":
        return outcome
    if future.status == "error":
        _, error, traceback = outcome
        if not isinstance(error, KilledWorker):
            raise error.with_traceback(traceback)
        raise DataError(f"{name} was not computed: its worker died on each of its "
                        f"{error.allowed_failures + 1} tries (the last at "
                        f"{error.last_worker.address}); the workers' logs say why") from None
    reason = getattr(outcome, "reason", "unknown")
    because = "" if reason == "unknown" else f" ({reason})"
    raise DataError(f"{name} was not computed: the cluster cancelled it{because}") from None


def in_order(done):
    """The (k, value) pairs of `done`, which come in any order of k = 0, 1, ..., in that
    order: each as soon as every pair before it has come."""
    waiting, next_k = {}, 0
    for k, value in done:
        waiting[k] = value
        while next_k in waiting:
            yield next_k, waiting.pop(next_k)
            next_k += 1


def _task(function, *args):
    """(function(*args), None) on a worker, or (None, the DataError it raised): bad data is an
    outcome that the client reports in one line, not a failure for every worker to log."""
    try:
        return function(*args), None
    except DataError as error:
        return None, error


def stats_part(layout, names, leaves, where, options):
    """The leaf statistics (segcli.curate.statistics.leaf_stats) of the batch `layout`
    describes (see segcli.io.open_inputs) over the structures between `leaves` where the
    --where conditions `where` hold: one task."""
    from segcli.curate.selection import where_mask
    from segcli.curate.statistics import leaf_stats
    from segcli.io import open_inputs

    with open_inputs(layout) as batch:
        keep = where_mask(batch, where, structures=slice(leaves[0], leaves[-1])) if where \
            else None
        return leaf_stats(batch, names, leaves, keep=keep, **options)


def leaf_stats_sharded(client, batch, names, leaves, progress=None, where=(), keep=None,
                       **options):
    """segcli.curate.statistics.leaf_stats of `batch` over the structures between `leaves`
    (leaf boundaries, see segcli.shards.leaf_bounds) where the --where conditions `where` hold
    (`keep`: where they do, see segcli.curate.selection.where_mask): here in one piece
    (`client` None), or as shards on `client`'s cluster, whose tasks open the file themselves
    (and evaluate `where` over their structures); joined in leaf order. `progress.update(n)`
    is called as n more structures are done."""
    from segcli.curate.statistics import join_leaves, leaf_stats
    from segcli.memory import offsets_of
    from segcli.shards import even_cuts

    leaves = np.asarray(leaves, np.int64)
    if client is None:
        return join_leaves([leaf_stats(batch, list(names), leaves, progress=progress,
                                       keep=keep, **options)])
    offsets = offsets_of(batch.n_atoms)
    cuts = even_cuts(np.diff(offsets[leaves]), shard_count(client, len(leaves) - 1))
    layout = shared(client, batch.layout)
    calls = [(layout, list(names), leaves[a:b + 1].tolist(), where, options)
             for a, b in itertools.pairwise(cuts)]
    # progress counts the structures that the conditions keep, as it does without a cluster
    sizes = [int(leaves[b] - leaves[a]) if keep is None else int(keep[leaves[a]:leaves[b]].sum())
             for a, b in itertools.pairwise(cuts)]
    return join_leaves(map_shards(client, stats_part, calls, progress, sizes))


def run_on_cluster(client, progress, batch, computation, target, lo, hi, task, recipe, attrs,
                   keep=None):
    """A computation (segcli.api.compute.Computation) over structures [lo, hi) of `batch` as
    shards on `client`'s cluster, into `target` (a segcli.io.sinks.Target) as one run writes
    it: each shard a task `task(*recipe, lo, hi, place, attrs)` that opens the input itself
    (recipe[0], its layout, is sent once) and returns the label of its device. Into an HDF5
    file, this process makes the output and each task writes its rows straight into it; into
    a stream (or memory), each task writes a part file into a temporary directory beside the
    output, passed on in structure order as it comes, while the others compute. Returns (the
    first shard's device label, the arrays a memory target kept, else None)."""
    from segcli.io import sinks
    from segcli.io.outputs import scratch_directory
    from segcli.shards import shard_bounds

    into_file = target.sink.hdf5
    opened_streams = []
    with contextlib.ExitStack() as opened:
        if not into_file:
            parts_dir = opened.enter_context(scratch_directory(
                os.path.dirname(os.path.abspath(target.path)) if target.path else os.getcwd()))
        n_atoms = batch.n_atoms[lo:hi]
        bounds = shard_bounds(n_atoms, shard_count(client, len(n_atoms)))
        if into_file:
            sink = opened.enter_context(sinks.open_sink(target, computation, batch, lo, hi,
                                                        attrs, keep, placed=True))
            places = sink.rows_of_shards(bounds)
        else:
            places = [os.path.join(parts_dir, f"part-{k}.h5") for k in range(len(bounds) - 1)]

            def open_stream(device):
                opened_streams.append(opened.enter_context(sinks.open_sink(
                    target, computation, batch, lo, hi, {**attrs, "device": device}, keep)))
                return opened_streams[0]

        recipe = (shared(client, recipe[0]), *recipe[1:])
        calls = [(*recipe, lo + int(a), lo + int(b), place, attrs)
                 for (a, b), place in zip(itertools.pairwise(bounds), places)]
        sizes = [int(b - a) for a, b in itertools.pairwise(bounds)]
        with contextlib.closing(shards_as_done(client, task, calls, progress, sizes)) as done:
            device = (_rows_written(sink, bounds, done) if into_file else
                      _parts_passed_on(places, computation.outputs, keep, open_stream, done))
    kept = opened_streams[0] if opened_streams else None
    return device, kept.arrays() if isinstance(kept, sinks.Collect) else None


def _rows_written(sink, bounds, done):
    """Each shard of `done` ((k, device label) as each ends) wrote its rows into the file of
    `sink` (an Hdf5Sink): they get no fill; the results' attribute `device` is the first's,
    which is returned."""
    first = None
    for n, (k, device) in enumerate(done):
        if n == 0:
            sink.add_attrs({"device": device})
            first = device
        sink.written_elsewhere(int(bounds[k]), int(bounds[k + 1]))
    return first


def _parts_passed_on(places, outputs, keep, open_stream, done):
    """Each part file places[k] of `done` ((k, device label) as each ends), checked, written
    in structure order into the stream `open_stream(device)` opens as the first comes, while
    the others compute; the rows of structures `keep` leaves out dropped. Returns the first's
    device label."""
    from segcli.io.core import Chunk
    from segcli.io.merge import check_cover, describe_part, part_rows

    parts, stream, first = [None] * len(places), None, None
    for k, device in in_order(done):
        parts[k] = describe_part(places[k], like=parts[0])
        if stream is None:
            stream, first = open_stream(device), device
        for start, counts, rows in part_rows([parts[k]], list(outputs)):
            chunk = Chunk(start, counts, {}, {})
            if keep is not None:
                chunk, rows = _kept_rows(chunk, rows, outputs, keep)
            if len(chunk.n_atoms):
                stream.write(chunk, rows)
    check_cover(parts)
    return first


def _kept_rows(chunk, rows, outputs, keep):
    """(the chunk's structures that `keep` ((S,) bool) marks, their rows of each dataset of
    `rows`, in its dtype of `outputs`): a part's NaN rows of structures not selected left out."""
    mask = keep[chunk.start:chunk.start + len(chunk.n_atoms)]
    atoms = np.repeat(mask, chunk.n_atoms)
    return chunk.take(mask), {d: r[mask if outputs[d][0] == "structure" else atoms].astype(
        outputs[d][2], copy=False) for d, r in rows.items()}
