"""Memory: what this process can still take, chunks of whole structures that fit a bound, and
windows of a file's pages mapped instead of copied.

    plan_chunks(np.array([3, 5, 2]), 6)  # [0, 1, 2, 3]: structure 1 alone holds 5 atoms
"""

import contextlib
import os
import resource
import threading

import numpy as np

from segcli.errors import DataError


def available_memory():
    """Bytes of memory this process can still take: the kernel's MemAvailable (Linux), else the
    machine's physical memory; at most what the limit on its address space leaves (see
    address_space_left)."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        have = int(line.split()[1]) * 1024
    left = address_space_left()
    return have if left is None else min(have, left)


_CAP = threading.RLock()
"""Held while address_space_capped caps the address space, and while the limit is read."""


@contextlib.contextmanager
def address_space_capped(extra):
    """Within, allocations that would grow the process's address space by more than `extra`
    bytes fail (HDF5's with an OSError, Python's with MemoryError); nothing changes where the
    address space cannot be measured (no /proc) or is limited more already. Process-wide, for
    a moment (an attribute's read): meanwhile another thread's allocation of more than `extra`
    fails too, and address_space_left waits for the limit as set. One cap at a time, and the
    limit as it was afterwards."""
    with _CAP:
        try:
            with open("/proc/self/statm") as statm:
                mapped = int(statm.read().split()[0]) * resource.getpagesize()
        except (OSError, ValueError, IndexError):
            mapped = None
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = None if mapped is None else mapped + extra
        if cap is None or (hard != resource.RLIM_INFINITY and cap >= hard) or \
                (soft != resource.RLIM_INFINITY and cap >= soft):
            yield
            return
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def address_space_left():
    """Bytes of address space that the limit on it (RLIMIT_AS, ulimit -v) leaves this process,
    or None where there is no limit (or the process's size cannot be read)."""
    with _CAP:  # the limit as set, not a cap of address_space_capped's
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmSize:"))
        return max(limit - int(line.split()[1]) * 1024, 0)
    return None


def check_memory(path, n_atoms, first, row_bytes):
    """DataError naming the largest structure of `n_atoms` (structures numbered from `first`)
    when its atoms, at `row_bytes` each, cannot fit in the memory available: a structure is
    never split across chunks, whatever --chunk-atoms says."""
    if not len(n_atoms):
        return
    largest = int(np.argmax(n_atoms))
    need, have = int(n_atoms[largest]) * row_bytes, available_memory()
    if need > have:
        raise DataError(f"{path}: structure {first + largest} has {n_atoms[largest]} atoms, "
                        f"which need {need} bytes at once, more than the {have} bytes of "
                        "memory available")


class Window:
    """What an `into` of Batch.iter_chunks may return instead of an array: a request to leave a
    chunk's rows of a per-atom field where the file stores them, in a read-only memory map of
    its pages (populated at once), rather than copy them, where the format can. The window
    holds `rows` rows, from one at most `align` rows ahead of the chunk's first (`skip` of
    them) such that the window starts at an address that is a multiple of `align` bytes; the
    reader sets `array` to the window, `skip` and `given` (the chunk's rows), and gives the
    Chunk array[skip:skip + given]. Left unset where the rows cannot be mapped so: the reader
    then reads them into `fallback` (an array, as `into` returns) or a new array."""

    def __init__(self, rows, fallback=None, align=64):
        self.rows, self.fallback, self.align = rows, fallback, align
        self.array, self.skip, self.given = None, 0, 0

    def holds(self, rows):
        """Whether `rows` (a Chunk's field) are the rows the reader gave of this window."""
        return (self.array is not None and len(rows) == self.given
                and rows.ctypes.data == self.array[self.skip:].ctypes.data
                and rows.shape[1:] == self.array.shape[1:] and rows.dtype == self.array.dtype)


def offsets_of(counts):
    """0, then the running sums of `counts` (int64), made in one new array: a file's structures
    can number 10⁸, and on a VM the page faults of each fresh array of them cost more than the
    sums."""
    offsets = np.empty(len(counts) + 1, np.int64)
    offsets[0] = 0
    np.cumsum(counts, out=offsets[1:])
    return offsets


def plan_chunks(n_atoms, chunk_atoms):
    """Bounds [b0, b1, ...] of runs of whole structures holding at most `chunk_atoms` atoms.

    A structure bigger than the bound forms a run of its own.
    """
    cum = offsets_of(n_atoms)
    bounds = [0]
    while bounds[-1] < len(n_atoms):
        a = bounds[-1]
        b = int(np.searchsorted(cum, cum[a] + chunk_atoms, side="right")) - 1
        bounds.append(max(b, a + 1))
    return bounds
