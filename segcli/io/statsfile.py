"""Statistics files (`segcli stats -o`): per field, the moments that combine exactly."""

import os

import numpy as np

from segcli.errors import DataError
from segcli.io.core import N_ELEMENTS
from segcli.io.hdf5 import plain
from segcli.io.outputs import new_output
from segcli.moments import FieldStats, Moments

STATS_FORMAT = "segcli-stats"
MOMENTS = ("count", "mean", "m2", "min", "max", "std", "rms")
LEAF_MOMENTS = ("count", "mean", "m2", "min", "max")
STATS_ATTRIBUTE_BYTES = 1 << 28
"""The most an attribute of a statistics file may take when read back: `components` names
each component of a field (millions for a large per-atom tensor)."""


def write_stats(path, stats, attrs, force=False, leaves=None):
    """Write `stats` (name -> segcli.moments.FieldStats) to a new HDF5 file: root attributes
    format, version and `attrs`; a group /stats/<name> per field holding count (G,) and mean,
    m2, min, max, std, rms (G, K) for its G groups (those with values: atomic numbers in
    `element` when grouped by element, the values of the field that the attribute `by` names
    in `group` when grouped by it, all of them in the attribute `groups`) and K components
    (the attribute `components`). A
    shard's part also holds its `leaves` (name -> FieldStats stacked by leaf) in
    /stats/<name>/leaves, which `segcli merge` joins."""
    import h5py

    path = os.fspath(path)
    # HDF5 1.8's object headers keep attributes of any size (a field of 5000 components has
    # 5000 component names), where the default ones stop at 64 KiB
    with new_output(path, force) as tmp, h5py.File(tmp, "w", libver=("v108", "latest")) as h5:
        h5.attrs.update({"format": STATS_FORMAT, "version": 1, **attrs})
        h5.create_group("stats", track_order=True)  # read back in the order of the FIELDs
        for s in stats.values():
            group = h5.create_group(f"stats/{s.name}")
            group.attrs.update(per=s.per, components=s.components, by_element=s.by_element,
                               per_atom=s.per_atom)
            rows = np.flatnonzero(s.moments.count) if s.grouped else np.zeros(1, int)
            if s.by_element:
                group["element"] = rows
            if s.by is not None:
                group.attrs.update(by=s.by, groups=_storable(s.groups))
                group["group"] = _storable([s.groups[g] for g in rows])
            for key in MOMENTS:
                group[key] = getattr(s.moments, key)[rows]
            if leaves is not None:
                for key in LEAF_MOMENTS:
                    group.create_dataset(f"leaves/{key}", data=getattr(leaves[s.name].moments, key),
                                         compression="gzip", shuffle=True)


def _storable(values):
    """Group values (ints or strings) as an array h5py stores (strings variable-length)."""
    import h5py

    if values and isinstance(values[0], str):
        return np.array(values, dtype=h5py.string_dtype())
    return np.array(values, np.int64)


def read_leaves(path, h5):
    """name -> FieldStats stacked by leaf, from the open stats part `h5` (at `path`);
    DataError when it holds no leaves (a file not written with --shard)."""

    out = {}
    for name, group in h5.get("stats", {}).items():
        if "leaves" not in group:
            raise DataError(f"{path}: /stats/{name} has no leaves: only parts written with "
                            "`segcli stats --shard` can be merged")
        attrs = {k: plain(group.attrs[k]) for k in ("per", "components", "by_element",
                                                    "per_atom")}
        moments = _checked(path, f"/stats/{name}/leaves",
                           Moments(*(group["leaves"][key][()] for key in LEAF_MOMENTS)))
        by = plain(group.attrs["by"]) if "by" in group.attrs else None
        groups = None if by is None else plain(group.attrs["groups"])
        out[name] = FieldStats(name, attrs["per"], list(attrs["components"]),
                               bool(attrs["by_element"]), bool(attrs["per_atom"]), moments,
                               by, groups)
    return out


def _checked(path, where, moments):
    """`moments` as read from `where` in the file `path`; DataError naming the first dataset
    that no values could give: counts that are not whole and non-negative, and, where a group
    counts values, a mean, M2, min or max that is not finite, a negative M2 or a min above
    the max."""
    count = np.asarray(moments.count)
    shape = (*count.shape, np.shape(moments.mean)[-1] if np.ndim(moments.mean) else 0)
    if count.dtype.kind not in "iu" or (count < 0).any():
        first = count.ravel()[np.argmin(count.ravel() >= 0)] if count.size else count.dtype
        raise DataError(f"{path}: {where}/count holds {first}, not a count of values (a whole "
                        "number, 0 or more)")
    counted = (count > 0)[..., np.newaxis]
    for key in LEAF_MOMENTS[1:]:
        values = np.asarray(getattr(moments, key))
        if values.shape != shape or values.dtype.kind != "f":
            raise DataError(f"{path}: {where}/{key} has shape {values.shape} and dtype "
                            f"{values.dtype}, not {shape} floats as its count says")
        if not np.isfinite(values[np.broadcast_to(counted, shape)]).all():
            raise DataError(f"{path}: {where}/{key} holds a value that is not finite where "
                            "values were counted")
    if (np.asarray(moments.m2) < 0).any() or (counted & (moments.min > moments.max)).any():
        raise DataError(f"{path}: {where} holds a negative m2 or a min above its max, which "
                        "no values give")
    return moments


def is_stats_file(path):
    """Whether `path` is an HDF5 file whose root attribute `format` says statistics."""
    import h5py

    from segcli.io.hdf5 import HDF5_ERRORS
    from segcli.io.heap import guarded

    try:
        if not h5py.is_hdf5(path):
            return False
        with guarded(path) as h5:
            return plain(h5.attrs.get("format")) == STATS_FORMAT
    except (*HDF5_ERRORS, UnicodeDecodeError, DataError):
        return False  # not one: its reader says what is wrong


def read_stats(path):
    """(name -> FieldStats, its `structures` count or None, the Spans of the input it covers,
    see segcli.io.coverage) of the statistics file `path` (`segcli stats -o`): each field's
    moments over all its groups (every element, or each value of `groups`); DataError naming
    what is wrong."""
    from segcli.io.coverage import covers_of, refuse_empty, span_of
    from segcli.io.hdf5 import HDF5_ERRORS, check_metadata, damaged
    from segcli.io.heap import guarded

    refuse_empty(path)
    if not is_stats_file(path):
        raise DataError(f"{path}: not a statistics file (segcli stats -o), as the others are")
    out = {}
    with guarded(path) as h5:
        try:
            check_metadata(path, h5, h5, STATS_ATTRIBUTE_BYTES)
            for name, group in h5.get("stats", {}).items():
                attrs = {k: plain(group.attrs[k]) for k in ("per", "components", "by_element",
                                                            "per_atom")}
                by = plain(group.attrs["by"]) if "by" in group.attrs else None
                groups = None if by is None else list(plain(group.attrs["groups"]))
                stored = _checked(path, f"/stats/{name}",
                                  Moments(*(group[key][()] for key in LEAF_MOMENTS)))
                if attrs["by_element"]:
                    rows = group["element"][()]
                elif by is not None:
                    rows = [groups.index(value) for value in plain(group["group"][()])]
                else:
                    rows = [0]
                size = N_ELEMENTS if attrs["by_element"] else len(groups or [0])
                moments = Moments.empty(size, len(attrs["components"]))
                for key in LEAF_MOMENTS:
                    getattr(moments, key)[rows] = getattr(stored, key)
                out[name] = FieldStats(name, attrs["per"], list(attrs["components"]),
                                       bool(attrs["by_element"]), bool(attrs["per_atom"]),
                                       moments, by, groups)
            attrs = {k: plain(v) for k, v in h5.attrs.items()}
        except (*HDF5_ERRORS, IndexError) as err:
            raise damaged(path, err) from err
    spans = covers_of(path, attrs["covers"]) if "covers" in attrs else [span_of(path, attrs)]
    start, _, stop = str(attrs.get("structures")).partition(":")
    return out, int(stop) - int(start) if start.isdigit() and stop.isdigit() else None, spans


def merge_stats_files(paths, partial=False):
    """(name -> FieldStats, structures or None, the attributes `covers` and `missing` of what
    they cover, see segcli.io.coverage.coverage_attrs) of the statistics files `paths`
    together: the fields they all hold, grouped alike (groups of a field joined: the union of
    their values), their moments merged in the order given (Chan's formulas). DataError when
    a field is grouped, or its components are, differently in two files, and when they do not
    cover their inputs once (see segcli.io.coverage.check_spans: shards of a job must all be
    there, unless `partial`; ranges of other runs must not overlap)."""
    from segcli.io.coverage import check_spans, coverage_attrs, refuse_repeated

    refuse_repeated(paths)
    merged, structures, spans = {}, 0, []
    for path in paths:
        stats, count, covered = read_stats(path)
        spans += covered
        structures = None if None in (structures, count) else structures + count
        common = stats.keys() if not merged else merged.keys() & stats.keys()
        merged = {name: _joined(path, merged.get(name), stats[name])
                  for name in sorted(common, key=list(stats).index)}
    return merged, structures, coverage_attrs(spans, check_spans(spans, partial, whole=False))


def _joined(path, total, s):
    """FieldStats `total` (None at first) and `s` (of `path`) merged."""
    from dataclasses import replace

    if total is None:
        return s
    how = ("per", "components", "by_element", "per_atom", "by")
    if any(getattr(total, k) != getattr(s, k) for k in how):
        raise DataError(f"{path}: /stats/{s.name} is {_described(s)}, but in the files before "
                        f"it {_described(total)}: statistics merge only alike")
    if total.by is None:
        return replace(total, moments=total.moments.merge(s.moments))
    groups = total.groups + [g for g in s.groups if g not in total.groups]
    return replace(total, groups=groups,
                   moments=_regrouped(total, groups).merge(_regrouped(s, groups)))


def _regrouped(s, groups):
    """The moments of `s` (grouped by a field) laid out over `groups`, a superset of its own."""

    out = Moments.empty(len(groups), len(s.components))
    rows = [groups.index(g) for g in s.groups]
    for key in LEAF_MOMENTS:
        getattr(out, key)[rows] = getattr(s.moments, key)
    return out


def _described(s):
    grouping = ("by element" if s.by_element else f"by {s.by}" if s.by else "ungrouped")
    return (f"per {s.per}{' per atom' if s.per_atom else ''}, {grouping}, components "
            f"{', '.join(map(str, s.components))}")
