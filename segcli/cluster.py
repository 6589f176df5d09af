"""The Dask side of segcli.executor: a dask.distributed client (of a scheduler, or of a
cluster started here), its workers' setup, and units run as tasks.

Each task opens the input itself (on a filesystem the workers share) and returns what is
small: statistics' leaves, or the device it computed on, having written its results into
their rows of the output's file or into a part file beside the output (results never go
through the scheduler). The executor joins the results in unit order, so a run gives the
same result whichever worker ran which unit, and a task retried after its worker died is
counted once (it writes the same rows, or replaces its part file whole). Dask is an optional
extra: `pip install 'segcli[cluster]'`.
"""

import contextlib
import logging
import os
import subprocess

from segcli.errors import DataError

SHARDS_PER_WORKER = 4
CONNECT_SECONDS = 10
"""The longest a scheduler is waited for (less where Dask's distributed.comm.timeouts.connect
says so): a server that is no Dask scheduler may never answer."""
WORKER_MODULES = ("segcli.api.compute", "segcli.api.curate", "segcli.executor", "segcli.engine",
                  "segcli.io.direct", "segcli.io.hdf5", "segcli.curate.selection",
                  "segcli.shards", "segcli.curate.statistics")
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


def shard_count(client, n_leaves):
    """How many units a job on `client`'s cluster is split into: a few per worker thread (so
    that a slow or lost worker delays little), at most one per leaf, at least one."""
    return max(1, min(n_leaves, SHARDS_PER_WORKER * sum(client.nthreads().values())))


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


def shards_as_done(client, function, calls, names=None):
    """(k, function(*calls[k])) for each call as it finishes on `client`'s cluster, one task
    per call, in the order they end (see segcli.executor.run, which orders them). The first
    task to raise DataError raises it here, and the tasks not yet done are cancelled when
    the caller stops early; a task the cluster loses is a DataError naming it (`names[k]`,
    else shard k + 1 of all)."""
    from dask.distributed import as_completed

    names = names or [f"shard {k + 1} of {len(calls)}" for k in range(len(calls))]
    futures = [client.submit(_task, function, *call, pure=False) for call in calls]
    index = {future.key: k for k, future in enumerate(futures)}
    try:
        # each result fetched by the client's own thread as its task ends, not one by one here
        for future, outcome in as_completed(futures, with_results=True, raise_errors=False):
            k = index[future.key]
            value, error = _outcome(future, outcome, names[k])
            if error is not None:
                raise error
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


def _task(function, *args):
    """(function(*args), None) on a worker, or (None, the DataError it raised): bad data is an
    outcome that the client reports in one line, not a failure for every worker to log."""
    try:
        return function(*args), None
    except DataError as error:
        return None, error
