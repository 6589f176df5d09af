"""Rows of HDF5 datasets read from the file's bytes by several threads at once.

h5py runs one call at a time (its lock) and inflates a compressed chunk in the calling thread,
so one process reads with one core. Where a dataset's storage is simple enough to read
without HDF5 (contiguous; or chunked along its rows only, each chunk stored raw or through
HDF5's shuffle and deflate filters), `Reader` reads a block of rows with segcli.threads:
`os.preadv` and zlib work without Python's lock. Anything else is left to h5py. Rows stored
contiguously can also be left in the file's pages (`Reader.window`), mapped rather than copied.

    reader = Reader("data.h5", h5)
    forces = reader.read(h5["atoms/forces"], 0, 1_000_000)
"""

import ctypes
import functools
import math
import mmap
import os
import zlib

import h5py
import numpy as np

from segcli import threads
from segcli.errors import DataError

MIN_PART = 4 << 20
"""Bytes of a contiguous read below which a thread is not worth starting."""

_SHUFFLE, _DEFLATE = h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_DEFLATE
_H5PY_ERRORS = (RuntimeError, KeyError, ValueError, TypeError, OSError)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages mapped at once, not on first use


@functools.cache
def _libc():
    """The C library, its mmap and munmap declared; None where it has none. Called through
    ctypes, they release Python's lock, which Python's own mmap module holds while it maps
    and populates a window's pages and while it unmaps them (10 and 7 ms for 64 MiB on a
    2-core VM), stopping every other thread of the process meanwhile."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
    except (OSError, AttributeError):
        return None
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class _Pages:
    """`size` bytes of file descriptor `fd` from `offset` (a multiple of the page size) mapped
    read-only and shared, populated at once, by libc (see _libc), as bytes for NumPy
    (np.asarray): unmapped when the last array over them goes. OSError where they cannot be
    mapped."""

    def __init__(self, fd, offset, size):
        self._address, self._size, libc = None, size, _libc()
        if libc is None:
            raise OSError("no C library to map files with")
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | _POPULATE, fd, offset)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        self._address, self._unmap = address, libc.munmap  # kept: at exit _libc may be gone
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1",
                                    "data": (address, True), "version": 3}

    def __del__(self):
        if self._address is not None:
            self._unmap(self._address, self._size)


class _Storage:
    """Where the rows of one dataset lie in its file: `offset` (contiguous), or the sorted
    first rows `starts` of its chunks of `chunk_rows` rows with their byte offsets, sizes and
    filter masks (chunked; a missing chunk reads as `fill`), `filters` the filter codes of its
    pipeline in the order they were applied."""

    def __init__(self, dsid, dtype, plist, filters):
        self.dtype = dtype
        self.row_bytes = dtype.itemsize * math.prod(dsid.shape[1:])
        self.rows = dsid.shape[0]
        self.offset = dsid.get_offset()
        self.fill = np.zeros((), dtype)
        plist.fill_value_defined()  # ValueError where the fill value's message is damaged, on
        plist.get_fill_value(self.fill)  # which reading the value would crash HDF5 (SIGSEGV)
        self.filters = filters
        if self.offset is not None:
            return
        self.chunk_rows = plist.get_chunk()[0]
        stored = []
        if hasattr(dsid, "chunk_iter"):
            dsid.chunk_iter(lambda info: stored.append(
                (info.chunk_offset[0], info.byte_offset, info.size, info.filter_mask)))
        else:  # an h5py or HDF5 that cannot list them in one call
            stored = [(info.chunk_offset[0], info.byte_offset, info.size, info.filter_mask)
                      for info in map(dsid.get_chunk_info, range(dsid.get_num_chunks()))]
        stored.sort()
        table = np.array(stored, np.int64).reshape(-1, 4)
        self.starts, self.offsets, self.sizes, self.masks = table.T

    def end(self):
        """The byte after the last one the dataset's storage takes in its file."""
        if self.offset is not None:
            return self.offset + self.rows * self.row_bytes
        return int((self.offsets + self.sizes).max(initial=0))

    @classmethod
    def of(cls, ds):
        """The storage of the dataset `ds`, or None where h5py should read it."""
        dtype, dsid = ds.dtype, ds.id
        if dtype.kind not in "iuf" or ds.ndim == 0 or ds.is_virtual or ds.external \
                or dsid.get_type() != h5py.h5t.py_create(dtype):  # bytes as NumPy holds them
            return None
        plist = dsid.get_create_plist()
        layout = plist.get_layout()
        filters = tuple(plist.get_filter(i)[0] for i in range(plist.get_nfilters()))
        if layout == h5py.h5d.CONTIGUOUS:
            return cls(dsid, dtype, plist, filters) if dsid.get_offset() is not None else None
        if layout != h5py.h5d.CHUNKED or tuple(ds.chunks[1:]) != tuple(ds.shape[1:]) \
                or set(filters) - {_SHUFFLE, _DEFLATE}:
            return None
        return cls(dsid, dtype, plist, filters)


def _read_exactly(path, name, fd, view, offset):
    """Fill the bytes `view` from byte `offset` of the file; DataError where it ends first."""
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:
            raise DataError(f"{path}: cannot read {name} at byte {offset + done} ({err})") from err
        if got == 0:
            raise DataError(f"{path}: {name} reads past the end of the file (byte "
                            f"{offset + done}); the file is truncated or damaged")
        done += got


class Reader:
    """Reads blocks of rows of the datasets of one open HDF5 file (`h5`, at `path`) with
    segcli.threads where it can (see the module), else with h5py."""

    def __init__(self, path, h5):
        self.path = path
        self._storage = {}
        self._fd = None
        self._fileno = h5.id.fileno
        if h5.driver != "sec2" or not hasattr(os, "preadv"):  # a file object or memory; Windows
            return
        try:
            self._fd = h5.id.get_vfd_handle()  # HDF5's own descriptor: pread moves nothing
            self._size = os.fstat(self._fd).st_size
        except _H5PY_ERRORS:
            self._fd = None

    def storage(self, ds):
        """The _Storage of `ds` (None: h5py reads it, and reports what it finds damaged),
        found once per dataset."""
        if self._fd is None or ds.file.id.fileno != self._fileno:
            return None  # a dataset reached through an external link lies in another file
        if ds.name not in self._storage:
            try:
                storage = _Storage.of(ds)
            except (*_H5PY_ERRORS, OverflowError):  # OverflowError: a chunk's address past 2^63
                storage = None
            if storage is not None and storage.end() > self._size:
                storage = None  # stored past the end of the file: h5py names the damage
            self._storage[ds.name] = storage
        return self._storage[ds.name]

    def read(self, ds, lo, hi, out=None):
        """Rows [lo, hi) of `ds`, into `out` where it has their shape and ds's dtype, else into
        a new array; None where h5py must read them (see the module)."""
        storage = self.storage(ds)
        if storage is None or not 0 <= lo <= hi <= storage.rows:
            return None
        shape = (hi - lo, *ds.shape[1:])
        if out is None or out.shape != shape or out.dtype != storage.dtype \
                or not out.flags.c_contiguous:
            out = np.empty(shape, storage.dtype)
        if hi == lo:
            return out
        flat = out.reshape(hi - lo, -1).view(np.uint8).reshape(-1)
        if storage.offset is not None:
            tasks = self._contiguous(ds.name, storage, lo, hi, flat)
        else:
            tasks = self._chunked(ds.name, storage, lo, hi, flat)
        threads.run(tasks)
        return out

    def window(self, ds, lo, hi, request):
        """Rows [lo, hi) of `ds` left in the file's pages as `request` (a
        segcli.memory.Window) asks: its window set to a read-only map of them and of the bytes
        around them (the dataset's other rows, or before its start and past its end whatever
        the file holds there: so that its first rows too are mapped where they do not start at
        an aligned address),
        and the rows returned (a view of it); None where `ds` is not stored contiguously as
        NumPy holds it, or no such window lies within the file."""
        storage = self.storage(ds)
        if storage is None or storage.offset is None or not 0 <= lo < hi <= storage.rows:
            return None
        row_bytes = storage.row_bytes
        skip = next((k for k in range(request.align + 1)
                     if (storage.offset + (lo - k) * row_bytes) % request.align == 0), None)
        if skip is None or skip + hi - lo > request.rows:
            return None
        start = storage.offset + (lo - skip) * row_bytes
        if start < 0 or start + request.rows * row_bytes > self._size:
            return None
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            if os.fstat(self._fd).st_size < start + request.rows * row_bytes:
                return None  # cut short since it was opened: reading it says so
            pages = np.asarray(_Pages(self._fd, base, start - base + request.rows * row_bytes))
        except (OSError, ValueError):
            return None
        shape = (request.rows, *ds.shape[1:])
        request.array = pages[start - base:].view(storage.dtype).reshape(shape)
        request.skip, request.given = skip, hi - lo
        return request.array[skip:skip + hi - lo]

    def _raw(self, name, runs, flat, row_bytes):
        """Tasks reading the raw runs (file offset, a, b: the bytes flat[a:b]) into the bytes
        `flat`: runs that follow one another in the file and in `flat` joined, then cut at
        whole rows into up to threads.count() parts of at least MIN_PART bytes each."""
        joined = []
        for offset, a, b in runs:
            if joined and joined[-1][0] + joined[-1][2] - joined[-1][1] == offset \
                    and joined[-1][2] == a:
                joined[-1][2] = b
            else:
                joined.append([offset, a, b])
        total = sum(b - a for _, a, b in joined)
        part = max(MIN_PART, -(-total // threads.count()) // row_bytes * row_bytes)
        return [functools.partial(_read_exactly, self.path, name, self._fd,
                                  flat[lo:min(b, lo + part)], offset + lo - a)
                for offset, a, b in joined for lo in range(a, b, part)]

    def _contiguous(self, name, storage, lo, hi, flat):
        """Tasks reading rows [lo, hi) of contiguous storage into the bytes `flat`."""
        return self._raw(name, [(storage.offset + lo * storage.row_bytes, 0, len(flat))], flat,
                         storage.row_bytes)

    def _chunked(self, name, storage, lo, hi, flat):
        """Tasks reading rows [lo, hi) of chunked storage into the bytes `flat`: the raw chunks
        as by _raw, one task for each filtered or missing one."""
        size = storage.chunk_rows * storage.row_bytes
        first, last = lo // storage.chunk_rows, (hi - 1) // storage.chunk_rows
        found = np.searchsorted(storage.starts, np.arange(first, last + 1) * storage.chunk_rows)
        runs, tasks = [], []
        for number, index in zip(range(first, last + 1), found.tolist()):
            start = number * storage.chunk_rows
            a = (max(lo, start) - lo) * storage.row_bytes
            b = (min(hi, start + storage.chunk_rows) - lo) * storage.row_bytes
            skip = max(lo - start, 0) * storage.row_bytes
            if index == len(storage.starts) or storage.starts[index] != start:
                tasks.append(lambda into=flat[a:b]: into.view(storage.dtype).fill(storage.fill))
                continue
            offset, mask = int(storage.offsets[index]), int(storage.masks[index])
            applied = [f for i, f in enumerate(storage.filters) if not mask >> i & 1]
            if applied:
                stored = int(storage.sizes[index])
                tasks.append(lambda into=flat[a:b], at=offset, stored=stored, skip=skip,
                             applied=applied:
                             self._inflate(name, storage, into, at, stored, skip, size, applied))
            else:
                runs.append((offset + skip, a, b))
        return self._raw(name, runs, flat, storage.row_bytes) + tasks

    def _inflate(self, name, storage, into, offset, stored, skip, size, applied):
        """Read the filtered chunk of `stored` bytes at `offset`, undo its `applied` filters
        (last applied first) and copy its bytes from `skip` into `into`."""
        raw = bytearray(stored)
        _read_exactly(self.path, name, self._fd, memoryview(raw), offset)
        data = np.frombuffer(raw, np.uint8)
        if _DEFLATE in applied:
            try:
                data = np.frombuffer(zlib.decompress(data, bufsize=size), np.uint8)
            except zlib.error as err:
                raise DataError(f"{self.path}: {name} has a chunk at byte {offset} that does "
                                f"not inflate ({err}); the file is damaged") from None
        if len(data) != size:
            raise DataError(f"{self.path}: {name} has a chunk at byte {offset} that holds "
                            f"{len(data)} bytes, not {size}; the file is damaged")
        if _SHUFFLE not in applied:
            into[:] = data[skip:skip + len(into)]
            return
        # shuffled: the first byte of every element, then the second, ...
        item = storage.dtype.itemsize
        planes, elements = data.reshape(item, -1), into.reshape(-1, item)
        for byte in range(item):
            elements[:, byte] = planes[byte, skip // item:skip // item + len(elements)]
