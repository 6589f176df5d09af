"""HDF5 files: the segcli-batch layout, and the conformer-group layout of ANI-1x, SPICE and
Transition1x, read in place."""

import contextlib
import errno
import functools
import itertools
import math
import os
from typing import NamedTuple

import h5py
import numpy as np

from segcli.errors import DataError
from segcli.fields import NUMERIC_KINDS, STRING
from segcli.io.core import FORMAT, VERSION, Batch, Chunk, FieldInfo, Schema, integral_numbers
from segcli.io.direct import Reader
from segcli.io.heap import TextHeaps, guarded
from segcli.io.units import convention, stated
from segcli.memory import Window, address_space_capped, check_memory, offsets_of, plan_chunks

POSITION_NAMES = ("coordinates", "conformations", "positions")
NUMBER_NAMES = ("atomic_numbers", "species")
ATTRIBUTE_BYTES = 1 << 20
"""The most an attribute of an input file may take in the file (a damaged one can claim
gigabytes, which HDF5 would allocate before segcli could refuse them)."""
TEXT_READ_SLACK = 512 << 20
"""Memory left free for other threads while an attribute's text is read (address_space_capped)."""
HDF5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)
"""What h5py raises for damaged metadata or data."""


_REFUSALS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EACCES, errno.EPERM)
"""Errors of opening a file that say what the system refuses, not what the file holds."""


def damaged(path, err):
    """The DataError for an HDF5 file that h5py cannot read (`err`: what it raised), or cannot
    open for a reason of the system's (too many open files, too little memory, permission)."""
    if isinstance(err, OSError) and err.errno in _REFUSALS:
        return DataError(f"{path}: cannot open it ({os.strerror(err.errno)})")
    return DataError(f"{path}: damaged HDF5 file ({type(err).__name__}: {err})")


def _utf8(path, raw, what):
    """The name `raw` (bytes) of `what` as text; DataError when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: the name of {what}, {raw!r}, is not UTF-8 text") from None


def _is_utf8(item):
    """Whether an attribute's string is UTF-8 text (h5py gives bytes, or str that hides
    undecodable bytes as surrogates)."""
    try:
        item.decode("utf-8") if isinstance(item, bytes) else str(item).encode("utf-8")
    except UnicodeError:
        return False
    return True


def _check_text(path, texts, what):
    """DataError unless every string of an attribute (`texts`) is UTF-8 text."""
    bad = [item for item in texts if not _is_utf8(item)]
    if bad:
        raise DataError(f"{path}: {what} holds {bad[0]!r}, which is not UTF-8 text")


def check_attributes(path, obj, where, limit=ATTRIBUTE_BYTES):
    """DataError unless each attribute of `obj` (a File, Group, Dataset or Datatype at `where`)
    has a UTF-8 name and holds numbers, or UTF-8 text, in at most `limit` bytes, checked by
    its size in the file before it is read."""
    for index in range(h5py.h5a.get_num_attrs(obj.id)):
        attr = h5py.h5a.open(obj.id, index=index)
        name = _utf8(path, attr.name, f"an attribute of {where}")
        what = f"attribute {name} of {where}"
        points = attr.get_space().get_simple_extent_npoints()
        try:
            stored = attr.get_storage_size()
        except RuntimeError:  # HDF5's answer for an attribute of no elements
            stored = 0
        size = max(stored, points * attr.get_type().get_size())
        if size > limit:
            raise DataError(f"{path}: {what} takes {size} bytes, more than the {limit} that "
                            "segcli reads of an attribute")
        string = h5py.check_string_dtype(attr.dtype) is not None
        if not (string or attr.dtype.kind in NUMERIC_KINDS):
            raise DataError(f"{path}: {what} holds {_kind(attr.dtype)}, not numbers or text")
        if string:  # variable-length text lies outside the attribute: its size is known once read
            texts = _attribute_text(path, obj, name, what, limit)
            size = sum(len(text) for text in texts)
            if size > limit:
                raise DataError(f"{path}: {what} holds {size} bytes of text, more than the "
                                f"{limit} that segcli reads of an attribute")
            _check_text(path, texts, what)


def _attribute_text(path, obj, name, what, limit):
    """The text of attribute `name` of `obj`, read with room for a few times `limit` bytes:
    DataError where its heap IDs claim more (HDF5 would allocate what they claim, gigabytes
    in a damaged file, before finding the collection's strings shorter)."""
    room = 4 * limit + TEXT_READ_SLACK
    try:
        with address_space_capped(room):
            return np.ravel(np.asarray(obj.attrs[name], dtype=object))
    except (OSError, MemoryError) as err:
        if "alloc" not in str(err) and not isinstance(err, MemoryError):
            raise
        raise DataError(f"{path}: {what} claims more text than {room} bytes of memory hold "
                        "(a damaged heap ID?); segcli reads at most "
                        f"{limit} bytes of an attribute") from None


def _kind(dtype):
    """What values of an HDF5 type that segcli does not read are, for messages."""
    if h5py.check_ref_dtype(dtype) is not None:
        return "references"
    if h5py.check_enum_dtype(dtype) is not None:
        return f"enumerated values (an HDF5 enum of {dtype})"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable-length sequences"
    return f"{'compound' if dtype.names else 'opaque'} values of dtype {dtype}"


class Node(NamedTuple):
    """An object of an HDF5 file as its header says: its path (the first that reaches it),
    kind (h5o.TYPE_*), number of attributes and, for a dataset, its shape (None for an empty
    dataspace) and HDF5 type (encoded: see `dtype`)."""

    name: str
    kind: int
    attributes: int
    shape: tuple | None = None
    type: bytes | None = None

    @property
    def ndim(self):
        return 0 if self.shape is None else len(self.shape)

    @property
    def dtype(self):
        """The dataset's dtype, as h5py gives it."""
        return _decoded(self.type)


@functools.cache
def _decoded(encoded):
    """The dtype of an HDF5 type encoded by h5t (each distinct type decoded once)."""
    return h5py.h5t.decode(encoded).dtype


@functools.cache
def _memory_type(encoded):
    """The HDF5 type that h5py reads values of a dataset of the encoded type into."""
    return h5py.h5t.py_create(_decoded(encoded))


class Contents(NamedTuple):
    """What check_metadata read of a file's object headers: `objects` (address -> Node, each
    object that hard links reach, once) and `links` (address of a group -> {name: the
    address of the object of a hard link, None for a soft or external link} of its links,
    in name order)."""

    objects: dict
    links: dict
    root: int


def check_metadata(path, h5, text, limit=ATTRIBUTE_BYTES):
    """DataError naming the first link of the file `h5` (at `path`) whose name is not UTF-8,
    or the first object whose attributes segcli cannot read safely (see check_attributes).
    Objects are read no further than their headers, but attributes are read through `text`
    (the same file open with heap.guarded) and each global heap collection of text that
    datasets hold is walked (heap.check_strings), so that any read of the file after is
    safe from HDF5's loop over a damaged one; links are visited through `text` too, for its
    check of local heaps. Returns the Contents it read."""
    links = []  # (name, type, address of a hard link's object) of each link
    text.id.links.visit(lambda raw, info: links.append((raw, info.type, info.u)), info=True)
    for raw, _, _ in links:
        _utf8(path, raw, "an object")
    check_attributes(path, text, "/", limit)
    objects = []  # (name, kind, attributes, address) of each object (h5py's visits lose errors)
    h5py.h5o.visit(h5.id, lambda raw, info: objects.append(
        (raw, info.type, info.num_attrs, info.addr)), info=True)
    nodes, types = {}, {}
    with open(path, "rb") as file:
        heaps = TextHeaps(path, h5, file)
        for raw, kind, attributes, address in objects:
            name = f"/{raw.decode()}"
            if attributes:
                check_attributes(path, text[name], name, limit)
            if kind != h5py.h5o.TYPE_DATASET:
                nodes[address] = Node(name, kind, attributes)
                continue
            dsid = h5py.h5d.open(h5.id, raw)
            stored = dsid.get_type()
            if (isinstance(stored, h5py.h5t.TypeStringID) and stored.is_variable_str()
                    and not heaps.check(dsid)):
                _read_strings(text[name])
            encoded = stored.encode()
            nodes[address] = Node(name, kind, attributes, dsid.shape,
                                  types.setdefault(encoded, encoded))
    root = h5py.h5o.get_info(h5.id).addr
    hard, children = {b"": root}, {}
    for raw, kind, address in links:
        parent, _, key = raw.rpartition(b"/")
        if kind == h5py.h5l.TYPE_HARD:
            hard[raw] = address
        children.setdefault(hard[parent], {})[key.decode()] = address if kind == \
            h5py.h5l.TYPE_HARD else None
    return Contents(nodes, children, root)


def _read_strings(ds, rows=1 << 16):
    """Reads the strings of `ds`, a block of `rows` at a time."""
    if ds.ndim == 0:
        ds[()]
    for lo in range(0, len(ds) if ds.ndim else 0, rows):
        ds[lo:lo + rows]


def read_rows(path, ds, lo, hi, out=None, reader=None):
    """Rows [lo, hi) of a dataset (of strings: an object array of str), read into `out` when it
    is an array of their shape and dtype (else a new array), or left in the file's pages where
    `out` is a segcli.memory.Window that they can fill, by `reader` (a direct.Reader of the
    file) where it can; DataError if the file cannot give them."""
    if isinstance(out, Window):
        rows = reader.window(ds, lo, hi, out) if reader is not None else None
        if rows is not None:
            out.fallback = None
            return rows
        out = out.fallback
    if reader is not None:
        rows = reader.read(ds, lo, hi, out)
        if rows is not None:
            return rows
    try:
        if h5py.check_string_dtype(ds.dtype):
            return ds.asstr()[lo:hi]
        if (out is None or hi <= lo or out.shape != (hi - lo, *ds.shape[1:])
                or out.dtype != ds.dtype):
            return ds[lo:hi]
        ds.read_direct(out, np.s_[lo:hi])
        return out
    except (*HDF5_ERRORS, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read {ds.name} rows {lo}:{hi} ({err})") from err
    except MemoryError:
        raise DataError(f"{path}: {ds.name} rows {lo}:{hi} take more memory than this machine "
                        "has (a damaged file can claim any number of rows)") from None


def plain(value):
    """An HDF5 attribute as a JSON-friendly Python value."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    return value.decode() if isinstance(value, bytes) else value


def units_of(path, ds, default=None):
    """The units the dataset `ds` states in its attribute `units` (see units.stated), else
    `default`; DataError when the attribute is not text."""
    if "units" not in ds.attrs:
        return default
    units = plain(ds.attrs["units"])
    if not isinstance(units, str):
        raise DataError(f"{path}: attribute units of {ds.name} is {units!r}, not text")
    return stated(units)


PART_IDENTITY = ("op", "fields", "precision", "source_fingerprint")
"""Attributes of a result that a virtual dataset over parts and each part it reads share."""


def _identity(obj):
    """The PART_IDENTITY attributes of a result dataset, or of the group holding it (a
    gradient's /results/NAME/d_FIELD), as plain values."""
    holder = obj if "op" in obj.attrs or obj.parent is None else obj.parent
    return {key: plain(holder.attrs[key]) for key in PART_IDENTITY if key in holder.attrs}


def _part_changed(virtual, read):
    """How the result in the dataset `read` of a part differs from the one the virtual
    dataset `virtual` took it for when it was made (another op, fields, precision or input),
    or None: a part rewritten by another job would be read silently otherwise (one of
    another length is refused as it is read)."""
    mine, theirs = _identity(virtual), _identity(read)
    for key in PART_IDENTITY:
        if key in mine and key in theirs and mine[key] != theirs[key]:
            return f"now holds {key} {theirs[key]!r}, not {mine[key]!r}"
    return None


VIRTUAL_READ = set()
"""The files whose virtual datasets this process reads: h5py objects of theirs left in
reference cycles are collected before the segcli program exits (cli.common.as_program)."""


def open_file(path, batch_class, **options):
    """An HDF5 file opened as `batch_class` (SegcliBatch or ConformerBatch, given `options`);
    DataError when HDF5 cannot read it."""
    try:
        h5 = h5py.File(path, "r", rdcc_nbytes=0)
    except OSError as err:
        if "unable to lock file" in str(err):
            raise DataError(f"{path}: busy: another program has it open for writing (HDF5's "
                            "file lock); try again once it is done") from err
        raise DataError(f"{path}: truncated or corrupt HDF5 file ({err})") from err
    try:
        with guarded(path) as text:
            contents = check_metadata(path, h5, text)
        return batch_class(path, h5, contents, **options)
    except BaseException as err:
        with contextlib.suppress(*HDF5_ERRORS):
            h5.close()
        if isinstance(err, HDF5_ERRORS):
            raise damaged(path, err) from err
        raise


class SegcliBatch(Batch):
    """A segcli-batch HDF5 file (SPEC §4), open as `h5` (its layout names its datasets, so
    the Contents that opening read are not needed); `counts`: its n_atoms as an earlier open
    of the unchanged file read and checked them (see Layout.open), not read again."""

    format = "segcli"
    _states_units = True

    def __init__(self, path, h5, contents=None, counts=None):
        super().__init__(path)
        self._h5 = h5
        self._reader = Reader(path, h5)
        if plain(h5.attrs["format"]) != FORMAT:
            raise DataError(f"{path}: attribute format is {plain(h5.attrs['format'])!r}, "
                            f"not {FORMAT!r}")
        version = plain(h5.attrs.get("version"))
        if version != VERSION:
            raise DataError(f"{path}: version {version!r} of {FORMAT} is not supported (this "
                            f"segcli reads version {VERSION})")
        groups = {name: self._group(name) for name in ("atoms", "structures", "present")}
        stored_counts = groups["structures"].get("n_atoms")
        if not isinstance(stored_counts, h5py.Dataset):
            raise DataError(f"{path}: /structures/n_atoms is missing")
        if counts is None:
            self.n_atoms, self._offsets = self._counts(stored_counts)
        elif stored_counts.shape == np.shape(counts):
            self.n_atoms = np.asarray(counts, np.int64)
            self._offsets = offsets_of(self.n_atoms)
        else:
            raise DataError(f"{path}: /structures/n_atoms has changed since it was read "
                            f"(shape {stored_counts.shape}, was {np.shape(counts)})")
        rows = {"atom": self._offsets[-1], "structure": len(self.n_atoms)}
        self._stored, self._datasets = {}, {}
        for per, group in (("atom", "atoms"), ("structure", "structures")):
            for name, ds in groups[group].items():
                where = f"/{group}/{name}"
                if not isinstance(ds, h5py.Dataset):
                    raise DataError(f"{path}: {where} is a group, not a field (a dataset of "
                                    f"one row per {per})")
                if where == "/structures/n_atoms":
                    continue
                is_string = h5py.check_string_dtype(ds.dtype) is not None
                if not (is_string or ds.dtype.kind in NUMERIC_KINDS) or \
                        h5py.check_enum_dtype(ds.dtype) is not None:
                    raise DataError(f"{path}: {where} holds {_kind(ds.dtype)}; a field holds "
                                    "numbers, booleans or strings")
                self._check_rows(where, ds, per, rows[per])
                self._check_written(where, ds, self._absent_rows(groups["present"].get(name), per))
                if name in self._stored:
                    raise DataError(f"{path}: '{name}' is both in /atoms and in /structures")
                dtype = STRING if is_string else np.dtype(np.int64) if \
                    self._float_numbers(ds) else ds.dtype
                self._stored[name] = FieldInfo(name, per, ds.shape[1:], dtype,
                                               units_of(path, ds))
                self._datasets[name] = ds
        self._masks = {}
        for name, ds in groups["present"].items():
            if name in self._stored:
                if not isinstance(ds, h5py.Dataset) or ds.shape != (len(self.n_atoms),) or \
                        ds.dtype != bool:
                    raise DataError(f"{path}: /present/{name} must be a ({len(self.n_atoms)},) "
                                    f"bool array, one entry per structure")
                self._masks[name] = ds
        self._result_fields = {}
        for name in self._result_names():
            ds = h5["results"][name]
            per = plain(ds.attrs.get("per"))
            if per is None or ds.dtype.kind not in NUMERIC_KINDS:
                continue
            if not isinstance(per, str) or per not in rows:
                raise DataError(f"{path}: /results/{name} has per={per!r}, neither 'atom' nor "
                                "'structure'")
            self._check_rows(f"/results/{name}", ds, per, rows[per])
            if name not in self._stored:
                self._result_fields[name] = FieldInfo(name, per, ds.shape[1:], ds.dtype,
                                                      units_of(path, ds))
                self._datasets[name] = ds

    @staticmethod
    def _float_numbers(ds):
        """Whether ds is /atoms/numbers holding floats: atomic numbers, given as int64 where
        each is an integer (see _numbers)."""
        return ds.name == "/atoms/numbers" and ds.dtype.kind == "f"

    def _group(self, name):
        """Group /`name` of the file, or an empty dict where there is none; DataError for
        another kind of object by that name."""
        group = self._h5.get(name)
        if group is not None and not isinstance(group, h5py.Group):
            raise DataError(f"{self.path}: /{name} is a dataset, not a group")
        return {} if group is None else group

    def _counts(self, ds):
        """The atom counts of /structures/n_atoms, `ds`, as int64, and their offsets (see
        offsets_of); DataError for counts that are not integers, negative, never written, or
        whose sum int64 cannot hold (checked before anything is allocated for them)."""
        if ds.ndim != 1 or ds.dtype.kind not in "iu":
            raise DataError(f"{self.path}: /structures/n_atoms must be a 1-D integer array, "
                            f"not {ds.dtype} of shape {ds.shape}")
        self._check_written("/structures/n_atoms", ds, 0)
        counts = read_rows(self.path, ds, 0, len(ds))
        bad = np.flatnonzero((counts < 0) | (counts > np.iinfo(np.int64).max))
        if len(bad):
            value = counts[bad[0]]
            rule = ("cannot be negative" if value < 0
                    else f"cannot exceed {np.iinfo(np.int64).max}")
            raise DataError(f"{self.path}: /structures/n_atoms[{bad[0]}] is {value}; atom counts "
                            f"{rule}")
        counts = counts.astype(np.int64, copy=False)
        offsets = offsets_of(counts)
        running = offsets[1:]
        if len(running) and running.min() < 0:  # the first sum past int64's range wraps below 0
            raise DataError(f"{self.path}: /structures/n_atoms sums to more than "
                            f"{np.iinfo(np.int64).max} atoms (from structure "
                            f"{np.argmax(running < 0)})")
        return counts, offsets

    def _absent_rows(self, mask, per):
        """How many rows (per `per`) belong to structures that /present/NAME, `mask`, says lack
        the field (segcli leaves them unwritten, to read as the fill value); 0 without a
        valid mask (see the check of /present)."""
        if not (isinstance(mask, h5py.Dataset) and mask.shape == self.n_atoms.shape
                and mask.dtype == bool):
            return 0
        lacking = ~read_rows(self.path, mask, 0, len(mask))
        return int(self.n_atoms[lacking].sum()) if per == "atom" else int(lacking.sum())

    def _check_written(self, where, ds, absent):
        """DataError when dataset `ds` (at `where`) stores fewer elements than its rows but
        `absent` ones need: HDF5 would read its fill value for the rest (a chunked dataset's
        missing chunks, a contiguous one's missing storage). Virtual datasets are checked by
        _check_rows."""
        if ds.is_virtual or ds.size == 0 or ds.external:
            return
        if ds.chunks:
            stored = ds.id.get_num_chunks() * math.prod(ds.chunks)
        else:
            stored = ds.id.get_storage_size() // ds.id.get_type().get_size()
        need = ds.size - absent * math.prod(ds.shape[1:])
        if stored < need:
            raise DataError(f"{self.path}: {where} stores {stored} of the {need} values its "
                            "structures hold; the rest was never written (HDF5 would read "
                            "zeros)")

    def _check_rows(self, where, ds, per, rows):
        """DataError unless dataset `ds` (at `where`), per `per`, has `rows` rows and, if it
        is virtual, reads existing data everywhere (see _check_virtual)."""
        if ds.is_virtual:
            self._check_virtual(where, ds)
        if ds.ndim == 0 or ds.shape[0] != rows:
            length = ds.shape[0] if ds.ndim else "no"
            expected = ("/structures/n_atoms sums to" if per == "atom"
                        else "/structures/n_atoms has")
            raise DataError(f"{self.path}: {where} has {length} rows, but {expected} {rows}")

    def _check_virtual(self, where, ds):
        """DataError unless the virtual dataset `ds` (at `where`) maps every element to a
        dataset of a file that exists: HDF5 reads zeros for a missing file or dataset, and
        for elements that no source maps."""
        VIRTUAL_READ.add(self.path)
        here = os.path.dirname(os.path.abspath(self.path))
        mapped = 0
        for source in ds.virtual_sources():
            name = source.file_name
            mapped += source.vspace.get_select_npoints()
            target = self.path if name == "." else os.path.join(here, name)
            if not os.path.isfile(target):
                raise DataError(f"{self.path}: {where} is a virtual dataset reading {name}, "
                                "which is missing (keep the parts of `segcli merge --virtual` "
                                "beside it)")
            with h5py.File(target, "r") as part:
                read = part.get(source.dset_name)
                if not isinstance(read, h5py.Dataset):
                    raise DataError(f"{self.path}: {where} is a virtual dataset reading "
                                    f"{source.dset_name} of {name}, which has no such dataset")
                changed = _part_changed(ds, read)
                if changed:
                    raise DataError(f"{self.path}: {where} is a virtual dataset reading "
                                    f"{source.dset_name} of {name}, which {changed}: the part "
                                    "was replaced since the merge (merge the parts again)")
        if mapped < ds.size:
            raise DataError(f"{self.path}: {where} is a virtual dataset whose sources cover "
                            f"{mapped} of its {ds.size} elements (HDF5 would read zeros for "
                            "the rest)")

    def close(self):
        self._h5.close()

    def _result_names(self):
        """Names of the datasets under /results (NAME or NAME/d_FIELD), in file order,
        through hard and soft links too (a group reached twice is walked once)."""
        out, walked = [], set()

        def walk(group, prefix):
            walked.add(group.id)
            for key in group:
                obj = group.get(key)
                if isinstance(obj, h5py.Dataset):
                    out.append(prefix + key)
                elif isinstance(obj, h5py.Group) and obj.id not in walked:
                    walk(obj, f"{prefix}{key}/")

        if isinstance(self._h5.get("results"), h5py.Group):
            walk(self._h5["results"], "")
        return out

    @property
    def results(self):
        return {name: {k: plain(v) for k, v in self._h5["results"][name].attrs.items()}
                for name in self._result_names()}

    def _present(self, name):
        ds = self._masks.get(name)
        return None if ds is None else read_rows(self.path, ds, 0, len(ds))

    def fill_value(self, name):
        if name in self._masks and "fill_value" in self._datasets[name].attrs:
            return plain(self._datasets[name].attrs["fill_value"])
        return None

    def _pieces(self, start, stop, names, chunk_atoms, into=None, bounds=None):
        stop = self.n_structures if stop is None else stop
        names = list(self._stored) if names is None else names
        if bounds is None:
            bounds = start + np.array(plan_chunks(self.n_atoms[start:stop], chunk_atoms))
        per = {**self._result_fields, **self._stored}
        row_bytes = sum(per[name].dtype.itemsize * math.prod(per[name].shape) for name in names
                        if per[name].per == "atom")
        for a, b in itertools.pairwise(bounds):
            check_memory(self.path, self.n_atoms[a:b], a, row_bytes)
            lo, hi = self._offsets[a], self._offsets[b]
            data = {"atom": {}, "structure": {}}
            present = {}
            for name in names:
                ds = self._datasets[name]
                if per[name].per == "atom":
                    out = into(name, hi - lo) if into else None
                    data["atom"][name] = read_rows(self.path, ds, lo, hi, out, self._reader)
                else:
                    data["structure"][name] = read_rows(self.path, ds, a, b, reader=self._reader)
                if name in self._masks:
                    present[name] = read_rows(self.path, self._masks[name], a, b)
                if self._float_numbers(ds):
                    data["atom"][name] = self._numbers(data["atom"][name], a, b, present.get(name))
            yield Chunk(int(a), self.n_atoms[a:b], data["atom"], data["structure"], present)

    def _numbers(self, numbers, a, b, have):
        """Structures [a, b)'s atomic numbers stored as floats, as int64 (those of structures
        that `have` marks lacking them, 0); DataError naming the first that is no integer."""
        counts = self.n_atoms[a:b]
        if have is not None:
            numbers = np.where(np.repeat(have, counts), numbers, 0)
        ends = np.cumsum(counts)

        def where(row):
            s = int(np.searchsorted(ends, row, side="right"))
            return (f"{self.path}: /atoms/numbers: structure {a + s}: "
                    f"atom {row - int(ends[s] - counts[s])}")

        return integral_numbers(numbers, where)


class Molecule:
    """One group of the conformer layout: C conformers of the same n atoms; `datasets` maps
    each field to (its dataset's name, trailing shape, dtype, units), units as the dataset
    states them or else by its dataset's convention (see units.CONVENTIONS)."""

    def __init__(self, path, h5, name, links, dataset):
        """The group `name` of `h5` (at `path`), whose links are `links` (see Contents)
        and `dataset(key)` the Node of the dataset its link `key` reaches (None for another
        object or none)."""
        self.name = name
        key = next(k for k in NUMBER_NAMES if k in links)
        where = f"{name.rstrip('/')}/{key}"
        if dataset(key) is None:
            raise DataError(f"{path}: {where} is not a dataset")
        numbers = self._read(path, h5, dataset(key), where)
        if numbers.dtype.kind in "SUO":
            from ase.data import atomic_numbers
            try:
                numbers = [atomic_numbers[s.decode() if isinstance(s, bytes) else s]
                           for s in numbers]
            except KeyError as err:
                raise DataError(f"{path}: {dataset(key).name} holds {err}, not a chemical "
                                "symbol") from err
        self.numbers = integral_numbers(
            numbers, lambda atom: f"{path}: {dataset(key).name} (every conformer of group "
                                  f"{name}): atom {atom}")
        n = len(self.numbers)
        found = [k for k in POSITION_NAMES if k in links]
        if len(found) != 1:
            raise DataError(f"{path}: group {name} must hold exactly one of "
                            f"{', '.join(POSITION_NAMES)}; it holds {found or 'none'}")
        positions = dataset(found[0])
        if positions is None:
            raise DataError(f"{path}: {name.rstrip('/')}/{found[0]} is not a dataset")
        if positions.ndim != 3 or positions.shape[1:] != (n, 3):
            raise DataError(f"{path}: {positions.name} has shape {positions.shape}, "
                            f"not (conformers, {n}, 3) for the {n} atomic numbers")
        self.n_conformers = positions.shape[0]
        self.n_atoms = n
        fields = {"positions": (found[0], positions)}
        for key in links:
            if key not in NUMBER_NAMES + POSITION_NAMES and (ds := dataset(key)) is not None \
                    and ds.dtype.kind in NUMERIC_KINDS and ds.ndim \
                    and ds.shape[0] == self.n_conformers:
                fields[key] = (key, ds)
        self.datasets = {field: (key, ds.shape[1:], ds.dtype, units_of(
            path, h5[name][key], convention(found[0], key)) if ds.attributes
            else convention(found[0], key)) for field, (key, ds) in fields.items()}

    @staticmethod
    def _read(path, h5, node, where):
        """The atomic numbers (or symbols) of the dataset `node` at `where`, a 1-D array."""
        if node.ndim != 1:
            raise DataError(f"{path}: {node.name} must be 1-D, not of shape {node.shape}")
        values = np.empty(node.shape, node.dtype)
        h5py.h5d.open(h5.id, where.encode()).read(h5py.h5s.ALL, h5py.h5s.ALL, values,
                                                  _memory_type(node.type))
        return values


def find_molecules(path, h5, contents):
    """Groups holding atomic numbers, at any depth, in file order (links not followed into
    groups), from the Contents of `h5` (at `path`) that opening read."""
    molecules = []

    def walk(address, name):
        links = contents.links.get(address, {})
        resolved = {}

        def dataset(key):
            """The Node of the dataset that link `key` reaches, following soft and external
            links as h5py does; None for another object or none."""
            if key not in resolved:
                if links[key] is not None:
                    node = contents.objects[links[key]]._replace(
                        name=f"{name.rstrip('/')}/{key}")
                else:
                    obj = h5[name].get(key)
                    node = None if not isinstance(obj, h5py.Dataset) else Node(
                        obj.name, h5py.h5o.TYPE_DATASET, h5py.h5a.get_num_attrs(obj.id),
                        obj.shape, obj.id.get_type().encode())
                resolved[key] = node if node and node.kind == h5py.h5o.TYPE_DATASET else None
            return resolved[key]

        if any(k in links and dataset(k) is not None for k in NUMBER_NAMES):
            molecules.append(Molecule(path, h5, name, links, dataset))
        for key, target in links.items():
            if target is not None and contents.objects[target].kind == h5py.h5o.TYPE_GROUP:
                walk(target, f"{name.rstrip('/')}/{key}")

    walk(contents.root, "/")
    return molecules


class ConformerBatch(Batch):
    """The conformer-group layout: each conformer of each molecule group is one structure."""

    format = "conformers"
    _states_units = True

    def __init__(self, path, h5, contents):
        super().__init__(path)
        self._h5 = h5
        self._reader = Reader(path, h5)
        self._molecules = find_molecules(path, h5, contents)
        if not self._molecules:
            raise DataError(f"{path}: HDF5 file with neither the {FORMAT} layout (no format "
                            "attribute) nor conformer groups (no atomic_numbers or species)")
        self.n_atoms = np.repeat([m.n_atoms for m in self._molecules],
                                 [m.n_conformers for m in self._molecules]).astype(np.int64)
        self._first = np.cumsum([0] + [m.n_conformers for m in self._molecules])
        # (C, n, ...) is per atom, unless the same name has another shape in another group
        per_atom = {}
        for m in self._molecules:
            for name, (_, shape, _, _) in m.datasets.items():
                per_atom[name] = per_atom.get(name, True) and shape[:1] == (m.n_atoms,)
        schema, added = Schema(), set()  # adding a field as it was added before changes nothing
        for m, first in zip(self._molecules, self._first):
            infos = [FieldInfo("numbers", "atom", (), np.dtype(np.int64))]
            for name, (_, shape, dtype, units) in m.datasets.items():
                infos.append(FieldInfo(name, "atom", shape[1:], dtype, units) if per_atom[name]
                             else FieldInfo(name, "structure", shape, dtype, units))
            for info in infos:
                if info not in added:
                    schema.add(path, info, first)
                    added.add(info)
        self._stored = dict(schema)

    def close(self):
        self._h5.close()

    def _present(self, name):
        have = np.repeat([name == "numbers" or name in m.datasets for m in self._molecules],
                         [m.n_conformers for m in self._molecules])
        return None if have.all() else have

    def _pieces(self, start, stop, names, chunk_atoms, into=None, bounds=None):
        stop = self.n_structures if stop is None else stop
        m = int(np.searchsorted(self._first, start, side="right")) - 1
        while start < stop:
            mol, first = self._molecules[m], self._first[m]
            step = max(1, chunk_atoms // max(mol.n_atoms, 1))
            end = min(stop, first + mol.n_conformers)
            read = [(name, key) for name, (key, _, _, _) in mol.datasets.items()
                    if names is None or name in names]
            group = self._h5[mol.name] if read else None
            for a in range(start - first, end - first, step):
                b = min(a + step, end - first)
                data = {"atom": {}, "structure": {}}
                if names is None or "numbers" in names:
                    data["atom"]["numbers"] = np.tile(mol.numbers, b - a)
                for name, key in read:
                    array = read_rows(self.path, group[key], a, b, reader=self._reader)
                    per = self._stored[name].per
                    data[per][name] = (array.reshape(-1, *array.shape[2:]) if per == "atom"
                                       else array)
                yield Chunk(int(first + a), np.full(b - a, mol.n_atoms, np.int64),
                            data["atom"], data["structure"])
            start, m = end, m + 1
