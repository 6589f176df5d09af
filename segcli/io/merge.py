"""Joining parts: outputs of one job over disjoint ranges of structures (shards) made into the
file that one run over all of them writes, by copy or as HDF5 virtual datasets.

    parts = check_parts(["r-0.h5", "r-1.h5"])   # DataError for gaps, overlaps, mismatches
    merge_parts(parts, "r.h5")
    parts = check_parts(paths, partial=True)    # gaps allowed: the output names them (`missing`)
"""

import contextlib
import itertools
import os
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np

from segcli.errors import DataError
from segcli.io.core import FORMAT
from segcli.io.coverage import (
    Span,
    check_spans,
    ranges_text,
    refuse_empty,
    refuse_repeated,
    span_of,
)
from segcli.io.hdf5 import (
    ATTRIBUTE_BYTES,
    HDF5_ERRORS,
    check_attributes,
    check_metadata,
    damaged,
    plain,
    read_rows,
)
from segcli.io.heap import guarded
from segcli.io.outputs import ensure_room, new_output
from segcli.io.statsfile import STATS_ATTRIBUTE_BYTES, STATS_FORMAT
from segcli.memory import offsets_of, plan_chunks
from segcli.moments import merge_stats

BLOCK_BYTES = 8 << 20
PART_ONLY = ("shard", "selection", "created", "structures")
"""Attributes that differ between parts of one job (and between a part and one run)."""
SHARD_ONLY = ("shard", "selection")
"""Attributes of a shard's part that the join of the parts does not have."""


@dataclass
class Part:
    """One part file: the structures it covers, its results (name -> attrs) or statistics."""

    kind: str  # FORMAT or STATS_FORMAT
    span: Span
    attrs: dict  # the root attributes
    datasets: dict  # name under /results or /stats -> the attributes that must agree

    path = property(lambda self: self.span.path)
    start = property(lambda self: self.span.start)
    stop = property(lambda self: self.span.stop)


@contextlib.contextmanager
def _reading(path):
    """The part file `path` open read-only (see guarded), what h5py raises while it is read
    (damaged metadata or data) a DataError naming it."""
    with guarded(path) as h5:
        try:
            yield h5
        except HDF5_ERRORS as err:
            raise damaged(path, err) from err


def _describe(path):
    """The Part of the file `path`; DataError when it is not a result or statistics file of
    a job over a known range of structures, or its results' rows are not those structures'."""
    refuse_empty(path)
    with _reading(path) as h5:
        return _described(path, h5)


def _described(path, h5):
    """The Part of the open file `h5` (see _describe), its attributes checked first (see
    check_metadata; statistics files name their components in attributes of any size)."""
    import h5py

    check_attributes(path, h5, "/")
    attrs = {k: plain(v) for k, v in h5.attrs.items()}
    kind = attrs.get("format")
    check_metadata(path, h5, h5, STATS_ATTRIBUTE_BYTES if kind == STATS_FORMAT else ATTRIBUTE_BYTES)
    virtual = []
    h5.visititems(lambda n, obj: virtual.append(n) if isinstance(obj, h5py.Dataset)
                  and obj.is_virtual else None)
    if virtual:  # its rows lie in other files, which the guarded file object cannot open
        raise DataError(f"{path}: /{virtual[0]} is a virtual dataset (of merge --virtual): "
                        "merge the parts it reads instead")
    if kind == FORMAT:
        names = []
        if isinstance(h5.get("results"), h5py.Group):
            h5["results"].visititems(
                lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
        datasets = {n: {**{k: plain(v) for k, v in h5["results"][n].attrs.items()},
                        "dtype": str(h5["results"][n].dtype),
                        "shape": list(h5["results"][n].shape[1:])} for n in names}
        ranges = {d.get("structures") for d in datasets.values()}
        recorded = next(iter(datasets.values()), {})
        what = "results"
    elif kind == STATS_FORMAT:
        datasets = {n: {k: plain(v) for k, v in g.attrs.items()}
                    for n, g in h5.get("stats", {}).items()}
        ranges = {attrs.get("structures")}
        recorded = attrs
        what = "statistics"
    else:
        raise DataError(f"{path}: neither results (segcli reduce/grad -o) nor statistics "
                        "(segcli stats -o)")
    if not datasets:
        raise DataError(f"{path}: holds no {what} to merge")
    if None in ranges or len(ranges) != 1:
        raise DataError(f"{path}: its {what} carry no single `structures` range (written "
                        "by an older segcli?)")
    span = span_of(path, recorded)
    if kind == FORMAT:
        _check_rows(path, h5, span.stop - span.start, datasets)
    return Part(kind, span, attrs, datasets)


def _check_rows(path, h5, count, datasets):
    """DataError unless the result file `h5` holds `count` structures: rows of /structures,
    and of each result of `datasets` (name -> attrs) one per structure or per atom (`per`)."""
    n_atoms = h5["structures/n_atoms"]
    if len(n_atoms) != count:
        raise DataError(f"{path}: holds {len(n_atoms)} structures, but its results say "
                        f"structures {h5['results'][next(iter(datasets))].attrs['structures']}")
    for name, ds in h5["structures"].items():
        if len(ds) != count:
            raise DataError(f"{path}: /structures/{name} has {len(ds)} rows for {count} "
                            "structures")
    atoms, step = 0, BLOCK_BYTES // 8
    for lo in range(0, count, step):
        block = read_rows(path, n_atoms, lo, min(lo + step, count)).astype(np.int64)
        if (block < 0).any():
            raise DataError(f"{path}: /structures/n_atoms holds a negative count")
        atoms += int(block.sum())
    for name, attrs in datasets.items():
        rows = {"structure": count, "atom": atoms}.get(attrs.get("per"))
        if rows is None:
            raise DataError(f"{path}: /results/{name} has per={attrs.get('per')!r}, not "
                            "'structure' or 'atom'")
        if len(h5["results"][name]) != rows:
            raise DataError(f"{path}: /results/{name} has {len(h5['results'][name])} rows, "
                            f"but its {count} structures have {rows} {attrs['per']}s")


def _agreeing(attrs):
    return {k: v for k, v in attrs.items() if k not in PART_ONLY}


def check_parts(paths, partial=False):
    """The Parts of the files `paths`, in structure order, checked to be of one job over
    ranges that neither overlap nor, unless `partial`, lack a structure or shard of the job
    (see segcli.io.coverage.check_spans); DataError naming the files and ranges."""
    if not paths:
        raise DataError("no parts to merge")
    paths = [os.fspath(p) for p in paths]
    refuse_repeated(paths)
    parts = sorted(map(_describe, paths), key=lambda p: (p.start, p.stop))
    for part in parts[1:]:
        _check_alike(part, parts[0])
    check_spans([p.span for p in parts], partial)
    return parts


def lacking(parts):
    """The ranges (start, stop) of structures of their job that checked `parts` lack."""
    return check_spans([p.span for p in parts], partial=True)[parts[0].span.fingerprint]


def describe_part(path, like=None):
    """The Part of the file `path`, checked to be of the same job as the Part `like` if
    given: parts checked one by one as they come (then check_cover)."""
    part = _describe(os.fspath(path))
    if like is not None:
        _check_alike(part, like)
    return part


def _check_alike(part, first):
    """DataError unless the Parts `part` and `first` hold the same results or statistics of
    one job and input."""
    if part.kind != first.kind:
        raise DataError(f"{part.path}: holds {part.kind}, but {first.path} {first.kind}")
    if set(part.datasets) != set(first.datasets):
        raise DataError(f"{part.path}: holds {', '.join(sorted(part.datasets))}, but "
                        f"{first.path} {', '.join(sorted(first.datasets))}")
    for name, attrs in part.datasets.items():
        mine, theirs = _agreeing(attrs), _agreeing(first.datasets[name])
        for key in sorted(mine.keys() | theirs.keys()):
            if mine.get(key) != theirs.get(key):
                raise DataError(f"{part.path}: {name} has {key}={mine.get(key)!r}, but "
                                f"{first.path} has {theirs.get(key)!r}: parts of different "
                                "jobs or inputs")
    if _agreeing(part.attrs) != _agreeing(first.attrs):
        key = next(k for k in sorted(_agreeing(part.attrs).keys() | _agreeing(
            first.attrs).keys()) if part.attrs.get(k) != first.attrs.get(k))
        raise DataError(f"{part.path}: attribute {key} is {part.attrs.get(key)!r}, but "
                        f"{first.path} has {first.attrs.get(key)!r}: parts of different "
                        "jobs or inputs")


def check_cover(parts):
    """DataError unless `parts` (of one input, in structure order) neither overlap nor leave
    a gap between them."""
    between = [(a, b) for a, b in lacking(parts) if parts[0].start <= a and b <= parts[-1].stop]
    if between:
        a, b = between[0]
        before = next(p for p in reversed(parts) if p.stop <= a)
        after = next(p for p in parts if p.start >= b)
        raise DataError(f"parts leave structures {a}:{b} uncovered ({before.path} has "
                        f"{before.start}:{before.stop}, {after.path} {after.start}:{after.stop})")


def merged_attrs(parts, attrs):
    """The attributes of the join of `parts` from one part's: the whole range, no shard."""
    out = {k: v for k, v in attrs.items() if k not in SHARD_ONLY}
    if "structures" in attrs:
        out["structures"] = f"{parts[0].start}:{parts[-1].stop}"
    return out


def _root_attrs(parts):
    """The root attributes of the join of `parts`: one part's, and `missing`, the ranges of
    their job's structures that they lack, if any."""
    missing = lacking(parts)
    return {**merged_attrs(parts, parts[0].attrs),
            **({"missing": ranges_text(missing)} if missing else {})}


def merge_parts(parts, output, virtual=False, force=False):
    """Write the join of checked `parts` (see check_parts) to the new file `output`: the file
    one run over all their structures writes (but for `created`). Results are copied, or
    with `virtual` mapped as HDF5 virtual datasets onto the parts by relative paths."""
    if parts[0].kind == STATS_FORMAT:
        if virtual:
            raise DataError("statistics parts are merged into new moments; --virtual is for "
                            "results")
        _merge_stats(parts, output, force)
        return
    import h5py

    output = os.fspath(output)
    files = [h5py.File(p.path, "r") for p in parts]
    try:
        with new_output(output, force) as tmp, h5py.File(tmp, "w") as h5:
            h5.attrs.update(_root_attrs(parts))
            names = [f"structures/{n}" for n in files[0]["structures"]]
            names += [f"results/{n}" for n in parts[0].datasets]
            for name in names:
                _join(h5, name, parts, files, output if virtual else None)
    finally:
        for f in files:
            f.close()


def _join(h5, name, parts, files, virtual_of):
    """Dataset `name` of `h5` as the parts' datasets one after another (virtual ones, with
    paths relative to the file `virtual_of`, when given)."""
    import h5py

    sources = [f[name] for f in files]
    rows = sum(len(ds) for ds in sources)
    first = sources[0]
    shape, dtype = (rows, *first.shape[1:]), first.dtype
    if virtual_of:
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        here = os.path.dirname(os.path.abspath(virtual_of))
        row = 0
        for part, ds in zip(parts, sources):
            if len(ds):
                relative = os.path.relpath(os.path.abspath(part.path), here)
                layout[row:row + len(ds)] = h5py.VirtualSource(relative, name, shape=ds.shape)
            row += len(ds)
        out = h5.create_virtual_dataset(name, layout)
    else:
        out = h5.create_dataset(name, shape=shape, dtype=dtype)
        step = max(1, BLOCK_BYTES // max(1, int(np.prod(shape[1:])) * dtype.itemsize))
        row = 0
        for part, ds in zip(parts, sources):
            for lo in range(0, len(ds), step):
                block = read_rows(part.path, ds, lo, min(lo + step, len(ds)))
                ensure_room(h5, block)
                out[row:row + len(block)] = block
                row += len(block)
    attrs = merged_attrs(parts, {k: first.attrs[k] for k in first.attrs})
    if "created" in attrs:
        attrs["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for key, value in attrs.items():
        out.attrs[key] = value


def _merge_stats(parts, output, force):
    """The statistics of the joined leaves of stats parts, as one run writes them."""
    from segcli.io.statsfile import read_leaves, write_stats

    leaves = []
    for part in parts:
        with _reading(part.path) as h5:
            leaves.append(read_leaves(part.path, h5))
    write_stats(output, merge_stats(leaves), _root_attrs(parts), force=force)


def part_rows(parts, names, atoms_per_block=1 << 20):
    """(first structure, n_atoms, {name: rows}) in blocks of whole structures over the parts'
    results `names` (per structure or per atom), in structure order: to print or store them.
    A block holds at most `atoms_per_block` atoms where a result is per atom, else as many
    structures."""
    for part in parts:
        with _reading(part.path) as h5:
            n_atoms = read_rows(part.path, h5["structures/n_atoms"], 0,
                                part.stop - part.start).astype(np.int64, copy=False)
            datasets = {name: h5[f"results/{name}"] for name in names}
            per_atom = {name for name, ds in datasets.items()
                        if plain(ds.attrs.get("per")) == "atom"}
            if per_atom:
                offsets = offsets_of(n_atoms)
                bounds = plan_chunks(n_atoms, atoms_per_block)
            else:
                bounds = [*range(0, len(n_atoms), atoms_per_block), len(n_atoms)]
            for a, b in itertools.pairwise(bounds):
                rows = {}
                for name, ds in datasets.items():
                    lo, hi = (offsets[a], offsets[b]) if name in per_atom else (a, b)
                    rows[name] = read_rows(part.path, ds, int(lo), int(hi))
                yield part.start + a, n_atoms[a:b], rows
