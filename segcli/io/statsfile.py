"""Statistics files (`segcli stats -o`): per field, the moments that combine exactly."""

import os

import numpy as np

from segcli.io.writers import new_output

STATS_FORMAT = "segcli-stats"
MOMENTS = ("count", "mean", "m2", "min", "max", "std", "rms")


def write_stats(path, stats, attrs, force=False):
    """Write `stats` (name -> segcli.stats.FieldStats) to a new HDF5 file: root attributes
    format, version and `attrs`; a group /stats/<name> per field holding count (G,) and mean,
    m2, min, max, std, rms (G, K) for its G groups (those with values, atomic numbers in
    `element` when grouped by element) and K components (the attribute `components`)."""
    import h5py

    path = os.fspath(path)
    with new_output(path, force) as tmp, h5py.File(tmp, "w") as h5:
        h5.attrs.update({"format": STATS_FORMAT, "version": 1, **attrs})
        for s in stats.values():
            group = h5.create_group(f"stats/{s.name}")
            group.attrs.update(per=s.per, components=s.components, by_element=s.by_element,
                               per_atom=s.per_atom)
            rows = np.flatnonzero(s.moments.count) if s.by_element else np.zeros(1, int)
            if s.by_element:
                group["element"] = rows
            for key in MOMENTS:
                group[key] = getattr(s.moments, key)[rows]
