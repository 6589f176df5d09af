"""The threads a segcli process reads and writes with: a pool of `count()` threads, which the
work given to `run` and `ordered` shares. Reading files (os.preadv), inflating them (zlib) and
the passes in C let go of Python's lock, so these threads use as many cores.

    threads.set_count(4)
    threads.run([lambda: os.preadv(fd, [a], 0), lambda: os.preadv(fd, [b], len(a))])
    out.writelines(threads.ordered(functools.partial(text, block) for block in blocks))
"""

import collections
import concurrent.futures
import os
import threading

MOST = 8
"""The default number of threads is the cores this process may use, at most this."""


class _State:
    """The count set_count gave (None: the default) and the pool of that many threads, made
    on first use."""

    def __init__(self):
        self.count = None
        self.pool = None
        self.lock = threading.Lock()

    def forget_pool(self):
        """A child process does not inherit its parent's threads."""
        self.pool = None


_state = _State()
if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_state.forget_pool)


def cores():
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def count():
    """How many threads `run` uses: those set_count gave, else SEGCLI_THREADS where it is a
    positive integer, else the cores this process may use, at most MOST."""
    if _state.count:
        return _state.count
    given = os.environ.get("SEGCLI_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else min(MOST, cores())


def set_count(threads):
    """Use `threads` threads from now on (None: the default, see count)."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    with _state.lock:
        _state.count = threads
        if _state.pool is not None:
            _state.pool.shutdown(wait=False)
            _state.pool = None


def share(processes):
    """The threads each of `processes` processes on this machine takes (as SEGCLI_THREADS
    tells them): those set_count gave, else the cores, split evenly, at least 1 and at most
    MOST each."""
    return max(1, min(MOST, (_state.count or cores()) // processes))


def run(tasks):
    """Run the callables `tasks`, on the pool's threads when there are several of both; once
    all have ended, the first exception one raised (in the order given) is raised here."""
    if len(tasks) < 2 or count() < 2:
        for task in tasks:
            task()
        return
    pool = _pool()
    futures = [pool.submit(task) for task in tasks]
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def ordered(tasks):
    """Yield the results of the callables `tasks` (an iterable, taken as it goes), in order:
    computed on the pool's threads, at most twice as many as there are threads ahead of the
    one yielded; in the caller's thread where count() is 1. An exception of a task is raised
    where its result would be yielded; closing the generator cancels those not begun."""
    if count() < 2:
        yield from (task() for task in tasks)
        return
    pool, ahead, futures = _pool(), 2 * count(), collections.deque()
    try:
        for task in tasks:
            futures.append(pool.submit(task))
            if len(futures) >= ahead:
                yield futures.popleft().result()
        while futures:
            yield futures.popleft().result()
    finally:
        for future in futures:
            future.cancel()


def _pool():
    """The pool of count() threads, made on first use."""
    with _state.lock:
        if _state.pool is None:
            _state.pool = concurrent.futures.ThreadPoolExecutor(count(),
                                                                thread_name_prefix="segcli")
        return _state.pool
