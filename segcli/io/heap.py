"""HDF5's global heap, walked here before HDF5 walks it.

Variable-length strings, in attributes and datasets, live in global heap collections. HDF5
(2.0.0 included) steps through a collection's objects without checking that each step moves
forward, so a damaged collection whose free-space object claims 0 bytes makes it loop
forever, holding the GIL (`H5HG__cache_heap_deserialize`). Two guards walk collections
before HDF5 does (see `hdf5.check_metadata`, run on every HDF5 input):
- `guarded` opens a file through h5py's file-object driver, which reads each collection on
  its own: attributes are read through it;
- `TextHeaps` finds the collections of datasets of text from their heap IDs, read from the
  file's bytes (faster than HDF5 reads the strings).
A heap ID also says how long its string is, and HDF5 allocates that much before it reads the
collection: an attribute's heap IDs lie in its object header, out of segcli's reach, so its
text is read with the address space capped (segcli.memory.address_space_capped).
Once each is walked, the file reads safely through any handle.
"""

import contextlib
import errno
import io
import math
import os
import struct
import zlib

import h5py
import numpy as np

from segcli.errors import DataError

SIGNATURE = b"\x89HDF\r\n\x1a\n"
COLLECTION = b"GCOL"
LOCAL_HEAP = b"HEAP"
FREE_LIST_END = 1  # HDF5's H5HL_FREE_NULL


class HeapGuard(io.FileIO):
    """A file opened for HDF5 to read, which refuses a damaged global heap collection."""

    def __init__(self, path):
        super().__init__(path, "rb")
        self.path = path
        self.address_size = self.length_size = 8  # bytes of an address and a length, and
        self.base = 0  # the offset of address 0, from the superblock

    def seek(self, offset, whence=os.SEEK_SET):
        """FileIO's seek, where an offset past what any file holds (a damaged address that
        HDF5 reads at) is an OSError, as HDF5 reports one it cannot read, not OverflowError."""
        try:
            return super().seek(offset, whence)
        except OverflowError:
            raise OSError(errno.EINVAL, f"no byte {offset} in a file") from None

    def readinto(self, buffer):
        start = self.tell()
        count = super().readinto(buffer)
        view = memoryview(buffer)[:count]
        if view[:8] == SIGNATURE and count > 14:
            self.address_size, self.length_size = view[13:15] if view[8] < 2 else view[9:11]
            self.base = start  # where addresses count from: the superblock, after a user block
        elif view[:4] == COLLECTION and \
                check_collection(self.path, view, start, self.length_size) is None:
            self._check_whole(view, start)  # HDF5 reads the rest, on its own
        elif view[:4] == LOCAL_HEAP:
            self._check_free_list(view, start)
        return count

    def _check_free_list(self, view, start):
        """DataError unless the free list of the local heap (a group's link names) whose
        prefix is `view`, read at byte `start`, ends: HDF5 follows it, allocating a node a
        step, until it ends, and follows a list that loops until memory runs out."""
        length, address = self.length_size, self.address_size
        if len(view) < 8 + 2 * length + address:
            return
        size, head, data = (int.from_bytes(view[at:at + width], "little") for at, width in
                            ((8, length), (8 + length, length), (8 + 2 * length, address)))
        data += self.base
        if data + size > os.fstat(self.fileno()).st_size:
            return  # HDF5 cannot read it, and says so
        block = os.pread(self.fileno(), size, data)
        seen, offset = set(), head
        while offset != FREE_LIST_END and offset not in seen and offset + 2 * length <= size:
            seen.add(offset)
            offset = int.from_bytes(block[offset:offset + length], "little")
        if offset != FREE_LIST_END:
            raise DataError(f"{self.path}: damaged HDF5 file (the free list of the local heap "
                            f"at byte {start} {'loops' if offset in seen else 'runs past it'})")

    def _check_whole(self, view, start):
        """check_collection on the whole collection whose first bytes are `view`, read from
        the file here, where it lies in it."""
        header = 8 + self.length_size
        if len(view) < header:
            return
        size = int.from_bytes(view[8:header], "little")
        if start + size <= os.fstat(self.fileno()).st_size:
            check_collection(self.path, memoryview(os.pread(self.fileno(), size, start)), start,
                             self.length_size)


def check_collection(path, view, start, length_size=8):
    """The sizes of the objects (index -> bytes) of the global heap collection read at byte
    `start` of `path` (`view`, its bytes, or its first bytes when HDF5 reads it in two steps:
    then None); DataError unless it can be walked object by object to its end, each step
    forward and inside it."""
    header = 8 + length_size
    if len(view) < header:
        return None
    size = int.from_bytes(view[8:header], "little")
    if size > len(view):
        return None  # HDF5 reads it again, whole
    if size < header:
        raise DataError(f"{path}: damaged HDF5 file (the global heap collection at byte "
                        f"{start} claims {size} bytes)")
    unpack = struct.Struct(f"<H6x{ {2: 'H', 4: 'I', 8: 'Q'}.get(length_size, 'Q') }").unpack_from
    position, sizes = header, {}
    while position + header <= size:
        index, object_size = unpack(view, position)
        if index:
            sizes[index] = object_size
        step = header + (object_size + 7) // 8 * 8 if index else object_size
        if step <= 0 or position + step > size:
            raise DataError(f"{path}: damaged HDF5 file (in the global heap collection at byte "
                            f"{start}, object {index} at byte {start + position} claims "
                            f"{object_size} bytes of the {size - position} left)")
        position += step
    return sizes


@contextlib.contextmanager
def guarded(path):
    """The HDF5 file at `path`, open read-only so that reading a damaged global heap
    collection raises DataError (see check_collection) where HDF5 would loop forever;
    DataError when it cannot be opened."""
    try:
        raw = HeapGuard(path)
    except OSError as err:
        raise DataError(f"{path}: cannot open it ({err.strerror or err})") from err
    with raw:
        try:
            h5 = h5py.File(raw, "r")
        except OSError as err:
            raise DataError(f"{path}: cannot open it as HDF5 ({err})") from err
        try:
            yield h5
        finally:
            h5.close()


class TextHeaps:
    """The global heap collections that the datasets of text of the open file `h5` (at
    `path`; `raw`: the same, open with open()) point to, each walked once with
    check_collection so that HDF5 never walks one first. Their heap IDs are read from the
    file's bytes: each string is stored as its length, then the collection's address and the
    object's index (HDF5 file format, "Variable-length" datatype)."""

    def __init__(self, path, h5, raw):
        self.path = path
        self._raw = raw  # the file, open for reading bytes
        plist = h5.id.get_create_plist()
        self.base = plist.get_userblock()
        offset_size, self.length_size = plist.get_sizes()
        self.heap_id = np.dtype([("length", "<u4"), ("address", f"<u{offset_size}"),
                                 ("index", "<u4")])
        self.undefined = (1 << 8 * offset_size) - 1
        self.sizes = {}  # address -> bytes of each object by its index, of each collection walked
        self._size = os.fstat(raw.fileno()).st_size

    def check(self, dsid):
        """Walks the collections of the dataset `dsid` (low-level); False where its storage
        cannot be read so (compact, or a filter other than deflate: HDF5 skips shuffle for
        variable-length data), for the caller to read it through `guarded`."""
        offset = dsid.get_offset()  # None but for contiguous storage in this file
        if offset is not None:  # unfiltered: filters need chunks
            return self._check_stored(dsid, [(offset, dsid.get_storage_size(), 0)], [], 0)
        plist = dsid.get_create_plist()
        layout = plist.get_layout()
        if layout == h5py.h5d.VIRTUAL:
            return True  # its strings lie in its source files
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        if layout == h5py.h5d.COMPACT:
            return False
        if layout == h5py.h5d.CONTIGUOUS:
            return True  # no storage in this file (external files, or none written)
        stored = [(info.byte_offset, info.size, info.filter_mask)
                  for info in map(dsid.get_chunk_info, range(dsid.get_num_chunks()))]
        whole = self.heap_id.itemsize * math.prod(plist.get_chunk())  # a chunk inflated, at most
        return self._check_stored(dsid, stored, filters, whole)

    def _check_stored(self, dsid, stored, filters, whole):
        """check of the dataset `dsid` whose heap IDs are stored as `stored` ((offset, size,
        mask of the `filters` skipped) of each block), each inflating to at most `whole`
        bytes."""
        item = self.heap_id.itemsize
        for offset, size, skipped in stored:
            if offset is None or size == 0 or offset + size > self._size:
                continue  # HDF5 refuses to read it
            applied = [f for i, f in enumerate(filters) if not skipped >> i & 1]
            if set(applied) - {h5py.h5z.FILTER_DEFLATE}:
                return False
            data = os.pread(self._raw.fileno(), size, offset)
            try:
                for _ in applied:
                    data = zlib.decompressobj().decompress(data, whole)
            except zlib.error:
                continue  # HDF5 cannot inflate it either
            ids = np.frombuffer(data[:len(data) // item * item], self.heap_id)
            self._check_lengths(dsid, ids[ids["length"] > 0])
        return True

    def _check_lengths(self, dsid, ids):
        """Walks the collections that the heap IDs `ids` (of strings of `dsid`) point to, and
        DataError when a string claims more bytes than its object holds (HDF5 would allocate
        what it claims, gigabytes, before it found out)."""
        if len(ids) and (ids["address"] == ids["address"][0]).all():
            parts = [(ids["address"][0], ids)]
        else:
            ids = ids[np.argsort(ids["address"], kind="stable")]
            addresses, starts = np.unique(ids["address"], return_index=True)
            parts = zip(addresses, np.split(ids, starts[1:]))
        for address, part in parts:
            address = int(address)
            if not 0 < address < self.undefined:
                continue
            if address not in self.sizes:
                self.sizes[address] = self._check_at(self.base + address)
            held = self.sizes[address]
            if held is None:  # HDF5 would allocate what the string claims before refusing
                raise DataError(f"{self.path}: damaged HDF5 file ({_name(dsid)} holds a string "
                                f"in a global heap collection at byte {self.base + address}, "
                                "where the file holds none)")
            index = part["index"]
            stored = np.where(index < len(held), held[np.minimum(index, len(held) - 1)], 0)
            short = np.flatnonzero(stored < part["length"])
            if len(short):
                bad = part[short[0]]
                raise DataError(
                    f"{self.path}: damaged HDF5 file ({_name(dsid)} holds a string of "
                    f"{bad['length']} bytes whose object {bad['index']} in the global heap "
                    f"collection at byte {self.base + address} holds {stored[short[0]]})")

    def _check_at(self, start):
        """The bytes each object of the collection at byte `start` holds, by its index (see
        check_collection); None when there is none (no signature there, or it or its claimed
        size runs past the end of the file)."""
        if start + 8 + self.length_size > self._size:
            return None
        head = os.pread(self._raw.fileno(), 8 + self.length_size, start)
        if head[:4] != COLLECTION or len(head) < 8 + self.length_size:
            return None
        size = int.from_bytes(head[8:], "little")
        if start + size > self._size:
            return None
        sizes = check_collection(self.path, memoryview(os.pread(self._raw.fileno(), size, start)),
                                 start, self.length_size)
        held = np.zeros(max(sizes, default=0) + 1, np.int64)
        held[list(sizes)] = list(sizes.values())
        return held


def _name(dsid):
    """The path of the dataset `dsid`, for messages."""
    return h5py.h5i.get_name(dsid).decode(errors="replace")
