"""The threads a segcli process reads and reduces with: a pool of `count()` threads, which the
work given to `run` shares. Reading files (os.preadv, zlib) and NumPy's passes over large
arrays let go of Python's lock, so these threads use as many cores.

    threads.set_count(4)
    threads.run([lambda: np.sum(a), lambda: np.sum(b)])
"""

import concurrent.futures
import os
import threading

MOST = 8
"""The default number of threads is the cores this process may use, at most this."""

_count = None
_pool = None
_lock = threading.Lock()


def cores():
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def count():
    """How many threads `run` uses: those set_count gave, else SEGCLI_THREADS where it is a
    positive integer, else the cores this process may use, at most MOST."""
    if _count:
        return _count
    given = os.environ.get("SEGCLI_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else min(MOST, cores())


def set_count(threads):
    """Use `threads` threads from now on (None: the default, see count)."""
    global _count, _pool
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    with _lock:
        _count = threads
        if _pool is not None:
            _pool.shutdown(wait=False)
            _pool = None


def share(processes):
    """The threads each of `processes` processes on this machine takes (as SEGCLI_THREADS
    tells them): those set_count gave, else the cores, split evenly, at least 1 and at most
    MOST each."""
    return max(1, min(MOST, (_count or cores()) // processes))


def run(tasks):
    """Run the callables `tasks`, on the pool's threads when there are several of both; once
    all have ended, the first exception one raised (in the order given) is raised here."""
    global _pool
    if len(tasks) < 2 or count() < 2:
        for task in tasks:
            task()
        return
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(count(), thread_name_prefix="segcli")
        pool = _pool
    futures = [pool.submit(task) for task in tasks]
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def _forget_pool():
    """A child process does not inherit its parent's threads."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)
