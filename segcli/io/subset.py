"""A new segcli HDF5 file holding some of a batch's structures."""

import os

import numpy as np

from segcli.errors import DataError
from segcli.io.core import path_text
from segcli.io.formats import capable
from segcli.io.hdf5 import plain, read_rows
from segcli.io.outputs import ensure_room, new_output
from segcli.io.writers import BatchWriter, FieldChoice

BLOCK_BYTES = 8 << 20
ROW_GROUPS = {"structures": "structure", "present": "structure", "atoms": "atom",
              "results": None}
"""The groups whose datasets have a row per structure or atom (results: as `per` says)."""
STREAM_ATOMS = 100_000


def write_subset(batch, keep, output, attrs=None, progress=None, force=False, choice=None):
    """Write the structures of `batch` where `keep` ((S,) bool) is true, in their order, to a
    new segcli HDF5 file `output` (replacing one there only with `force`), with the root
    attributes `attrs`; with `choice` (a FieldChoice), its fields converted as it says
    (streamed, as other formats are).

    A segcli HDF5 file is copied dataset by dataset: /structures, /atoms, /present and /results
    (per its `per` attribute) sliced, anything else whole, each with its dtype (strings too),
    attributes, chunking and filters, reading at most BLOCK_BYTES at a time. Other formats
    stream their structures through BatchWriter; many files also give the output where each
    structure came from (the root attribute `sources`, /structures/source and
    /structures/source_index, see Batch.source_of). The file appears only once complete.
    `progress.update(n)` is called as n more structures' worth of `batch` is done (see
    segcli.cli.common.progress). Returns (structures, atoms) written.
    """
    import h5py

    keep = np.asarray(keep, bool)
    output = os.fspath(output)
    for why in getattr(batch.fields, "conflicts", {}).values():
        # a name held in ways that do not merge is no field: copying "every field" would
        # leave it out, exit 0
        raise DataError(f"{batch.path}: {why}; select copies every field (`segcli convert "
                        "--drop NAME` first)")
    copies = choice is None and capable(batch, "copies_datasets")
    source = h5py.File(batch.path, "r") if copies else None
    try:
        with new_output(output, force) as tmp, h5py.File(tmp, "w") as h5:
            if source is None:
                _stream(batch, keep, h5, progress, choice or FieldChoice())
                if len(batch.sources) > 1:
                    h5.attrs["sources"] = np.array([path_text(p) for p in batch.sources],
                                                   dtype=h5py.string_dtype())
            else:
                _copy(batch, keep, source, h5, progress)
            for key, value in (attrs or {}).items():
                h5.attrs[key] = value
    except OSError as err:
        raise DataError(f"{output}: cannot write ({err})") from err
    finally:
        if source is not None:
            source.close()
    return int(keep.sum()), int(batch.n_atoms[keep].sum())


def _stream(batch, keep, h5, progress, choice):
    """Append the kept structures of each chunk of `batch.stream` to a BatchWriter, converted
    as `choice` says, a field that only some of them have filled as `convert --fill-missing
    nan` fills it."""
    writer = BatchWriter(h5, fill=np.nan)
    stated = choice.units(batch)
    for pieces in batch.stream(STREAM_ATOMS):
        if len(batch.sources) > 1:
            pieces = [_with_sources(batch, p) for p in pieces]
        kept = [p.take(keep[p.start:p.start + len(p.n_atoms)]) for p in pieces]
        kept = [p for p in kept if len(p.n_atoms)]
        if kept:
            writer.append(batch.path, choice.apply(batch.path, kept, stated),
                          units=choice.written(stated))
        if progress is not None:
            progress.update(sum(len(p.n_atoms) for p in pieces))
    writer.finish()


def _with_sources(batch, piece):
    """A piece with the per-structure fields source and source_index (see Batch.source_of)."""
    source, index = batch.source_of(slice(piece.start, piece.start + len(piece.n_atoms)))
    return piece._replace(structures={**piece.structures, "source": source,
                                      "source_index": index})


def _copy(batch, keep, source, h5, progress):
    """Copy every group, dataset and attribute of `source` to `h5`, under every name it has
    (see _names), the per-structure and per-atom datasets sliced to the kept structures;
    progress goes by the bytes copied, as structures' worth."""
    import h5py

    offsets = {"structure": np.arange(batch.n_structures + 1),
               "atom": np.concatenate([[0], np.cumsum(batch.n_atoms)])}
    _copy_attrs(source, h5)
    names = _names(source)
    sizes = [obj.id.get_storage_size() if isinstance(obj, h5py.Dataset) and first is None else 0
             for _, obj, _, first in names]
    total = max(sum(sizes), 1)
    copied = reported = 0
    for (name, obj, link, first), size in zip(names, sizes):
        if obj is None or (first is not None and isinstance(obj, h5py.Group)
                           and isinstance(link, h5py.SoftLink)):
            h5[name] = link  # to nothing, or back to a group copied: kept as it is
        elif first is not None:
            h5[name] = h5[first]
        elif isinstance(obj, h5py.Group):
            _copy_attrs(obj, h5.require_group(name))
        elif isinstance(obj, h5py.Dataset) and (per := _per(batch, name, obj)) is not None:
            _copy_rows(batch.path, obj, h5, name, keep, offsets[per])
        else:
            source.copy(obj, h5, name)
        copied += size
        if progress is not None:
            worth = batch.n_structures * copied // total
            progress.update(worth - reported)
            reported = worth
    if progress is not None:
        progress.update(batch.n_structures - reported)


def _names(source):
    """(name, object, link, first) for every name in the file `source`, parents first,
    following hard, soft and external links: object is a Group, Dataset or Datatype (None for
    a dangling link), link the link itself, first the name the object was first given under
    the same one of the four groups of rows (or outside them) (else None; then a group's names
    follow). So a field reached through a link is copied as a dataset of its rows, and each
    object is copied at most five times, so cycles and fans of links end."""
    import h5py

    out, seen = [], {}

    def walk(group, prefix):
        for key in group:
            name = prefix + key
            obj, link = group.get(key), group.get(key, getlink=True)
            scope = name.split("/")[0]
            scope = scope if scope in ROW_GROUPS else None
            first = None if obj is None else seen.setdefault((obj.id, scope), name)
            out.append((name, obj, link, None if first == name else first))
            if first == name and isinstance(obj, h5py.Group):
                walk(obj, name + "/")

    walk(source, "")
    return out


def _per(batch, name, obj):
    """"structure" or "atom": what the rows of a dataset are; None outside the four groups."""
    group = name.split("/")[0]
    per = ROW_GROUPS.get(group)
    if group == "results":
        per = plain(obj.attrs.get("per"))
        if per not in ("structure", "atom"):
            raise DataError(f"{batch.path}: /{name} has no attribute per (\"structure\" or "
                            "\"atom\"), so its rows cannot be selected")
    if per is not None:
        rows = batch.n_structures if per == "structure" else int(batch.n_atoms.sum())
        if obj.ndim == 0 or obj.shape[0] != rows:
            raise DataError(f"{batch.path}: /{name} has {obj.shape[0] if obj.ndim else 'no'} "
                            f"rows, but the file has {rows} {per}s")
    return per


def _copy_rows(path, ds, h5, name, keep, offsets):
    """The rows of `ds` that belong to kept structures (structure s: rows offsets[s] to
    offsets[s + 1]) into a new dataset `name` of `h5` shaped and filtered like `ds`, read in
    blocks of at most BLOCK_BYTES (only the span of kept rows in each)."""
    lengths = np.diff(offsets)
    rows = int(lengths[keep].sum())
    trailing = ds.shape[1:]
    options = {} if ds.dtype.kind == "O" else {"fillvalue": ds.fillvalue}
    if ds.chunks:
        options.update(chunks=(min(ds.chunks[0], max(rows, 1)), *ds.chunks[1:]),
                       maxshape=(None, *trailing), compression=ds.compression,
                       compression_opts=ds.compression_opts, shuffle=ds.shuffle,
                       fletcher32=ds.fletcher32, scaleoffset=ds.scaleoffset)
    out = h5.create_dataset(name, shape=(rows, *trailing), dtype=ds.dtype, **options)
    _copy_attrs(ds, out)
    step = max(1, BLOCK_BYTES // max(1, int(np.prod(trailing)) * ds.dtype.itemsize))
    written = 0
    for lo in range(0, len(ds), step):
        hi = min(lo + step, len(ds))
        a = int(np.searchsorted(offsets, lo, side="right")) - 1
        b = int(np.searchsorted(offsets, hi, side="left"))
        starts, ends = np.clip(offsets[a:b], lo, hi), np.clip(offsets[a + 1:b + 1], lo, hi)
        mask = np.repeat(keep[a:b], ends - starts)
        if not mask.any():
            continue
        first, last = int(np.argmax(mask)), len(mask) - int(np.argmax(mask[::-1]))
        block = read_rows(path, ds, lo + first, lo + last)[mask[first:last]]
        ensure_room(h5, block)
        out[written:written + len(block)] = block
        written += len(block)


def _copy_attrs(source, target):
    """Every attribute of `source` onto `target`, with its HDF5 type."""
    for key in source.attrs:
        target.attrs.create(key, source.attrs[key], dtype=source.attrs.get_id(key).dtype)
