"""Statistics files (`segcli stats -o`): per field, the moments that combine exactly."""

import os

import numpy as np

from segcli.errors import DataError
from segcli.io.hdf5 import plain
from segcli.io.writers import new_output

STATS_FORMAT = "segcli-stats"
MOMENTS = ("count", "mean", "m2", "min", "max", "std", "rms")
LEAF_MOMENTS = ("count", "mean", "m2", "min", "max")
STATS_ATTRIBUTE_BYTES = 1 << 28
"""The most an attribute of a statistics file may take when read back: `components` names
each component of a field (millions for a large per-atom tensor)."""


def write_stats(path, stats, attrs, force=False, leaves=None):
    """Write `stats` (name -> segcli.stats.FieldStats) to a new HDF5 file: root attributes
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
    from segcli.stats import FieldStats, Moments

    out = {}
    for name, group in h5.get("stats", {}).items():
        if "leaves" not in group:
            raise DataError(f"{path}: /stats/{name} has no leaves: only parts written with "
                            "`segcli stats --shard` can be merged")
        attrs = {k: plain(group.attrs[k]) for k in ("per", "components", "by_element",
                                                    "per_atom")}
        moments = Moments(*(group["leaves"][key][()] for key in LEAF_MOMENTS))
        by = plain(group.attrs["by"]) if "by" in group.attrs else None
        groups = None if by is None else plain(group.attrs["groups"])
        out[name] = FieldStats(name, attrs["per"], list(attrs["components"]),
                               bool(attrs["by_element"]), bool(attrs["per_atom"]), moments,
                               by, groups)
    return out
