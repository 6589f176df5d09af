"""Moments of values that combine exactly: per group and component the count, mean, sum of
squared deviations (M2), min and max, two partial results (of chunks, structure ranges or
shards) combining by Chan, Golub and LeVeque's pairwise formulas, exact to rounding in any
order; and the statistics of a field built on them. Pure NumPy, below the readers and
writers (segcli.io.statsfile stores them).

    m = Moments.of(np.array([[1.0], [2.0], [4.0]]))
    both = m.merge(Moments.of(np.array([[8.0]])))  # the moments of all four values
"""

from dataclasses import dataclass, replace

import numpy as np

MOMENT_NAMES = ("count", "mean", "m2", "min", "max")


@dataclass(frozen=True)
class Moments:
    """Count (G,), and mean, M2 (sum of squared deviations), min and max (G, K) of values in
    G groups of K components."""

    count: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @classmethod
    def empty(cls, groups, components, leaves=None):
        """No values, in `groups` groups of `components` components (stacked by leaf for
        `leaves` leaves)."""
        lead = (groups,) if leaves is None else (leaves, groups)
        shape = (*lead, components)
        return cls(np.zeros(lead, np.int64), np.zeros(shape), np.zeros(shape),
                   np.full(shape, np.inf), np.full(shape, -np.inf))

    @classmethod
    def of(cls, values, groups=None, n_groups=1):
        """The moments of the rows of `values` (n, *F), row i in group `groups[i]` (default 0)."""
        rows = as_rows(values)
        if groups is None:
            return cls.of_runs(np.ascontiguousarray(rows.T, np.float64), [len(rows)])
        groups = np.asarray(groups, np.intp)
        order = np.argsort(groups, kind="stable")
        return cls.of_runs(np.ascontiguousarray(rows[order].T, np.float64),
                           np.bincount(groups, minlength=n_groups))

    @classmethod
    def of_runs(cls, columns, count):
        """The moments (C, K) of `columns` (K, n), K components of n values in C consecutive
        runs of `count` (C,) values. Each run is reduced on its own, in order, in two passes
        (its mean, then the squared deviations from it), so its bits do not depend on what
        else is in `columns`."""
        count = np.asarray(count, np.int64)
        out = cls.empty(len(count), len(columns))
        out.count[:] = count
        runs = np.flatnonzero(count)
        if len(runs):
            starts = (np.cumsum(count) - count)[runs]
            mean = np.add.reduceat(columns, starts, axis=1) / count[runs]
            deviations = np.repeat(mean, count[runs], axis=1)
            np.subtract(columns, deviations, out=deviations)
            np.multiply(deviations, deviations, out=deviations)
            out.mean[runs] = mean.T
            out.m2[runs] = np.add.reduceat(deviations, starts, axis=1).T
            out.min[runs] = np.minimum.reduceat(columns, starts, axis=1).T
            out.max[runs] = np.maximum.reduceat(columns, starts, axis=1).T
        return out

    def merge(self, other):
        """The moments of both sets of values together (Chan et al.'s pairwise update); also
        entry by entry for moments stacked along leading axes."""
        n_a, n_b = self.count[..., None], other.count[..., None]
        n = np.maximum(n_a + n_b, 1)
        delta = other.mean - self.mean
        return Moments(self.count + other.count,
                       self.mean + delta * (n_b / n),
                       self.m2 + other.m2 + delta * delta * (n_a * n_b / n),
                       np.minimum(self.min, other.min), np.maximum(self.max, other.max))

    def __getitem__(self, index):
        """The moments of the leading-axis entries `index` (of moments stacked by leaf)."""
        return Moments(*(getattr(self, k)[index] for k in MOMENT_NAMES))

    @classmethod
    def stack(cls, parts):
        """Moments stacked by leaf (each of `parts` already so) joined along that axis (one
        part: itself, not copied)."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in MOMENT_NAMES))

    def tree_reduce(self):
        """The moments of all leaves (the leading axis) together, merged pairwise in a fixed
        binary tree over the leaf numbers: the same bits however the leaves were computed.
        Groups without values in any leaf (or no leaves) are left with no values, unmerged."""
        some = np.flatnonzero(self.count.any(axis=0))
        out = Moments.empty(*self.mean.shape[1:])
        if len(some):
            merged = Moments(*(getattr(self, k)[:, some] for k in MOMENT_NAMES))._tree()
            for key in MOMENT_NAMES:
                getattr(out, key)[some] = getattr(merged, key)
        return out

    def _tree(self):
        level = self
        while len(level.count) > 1:
            pairs = len(level.count) // 2
            merged = level[0:2 * pairs:2].merge(level[1:2 * pairs:2])
            level = merged if len(level.count) % 2 == 0 else Moments.stack(
                [merged, level[len(level.count) - 1:]])
        return level[0]

    @property
    def std(self):
        """Population standard deviation (NaN for an empty group)."""
        with np.errstate(invalid="ignore"):
            return np.sqrt(self.m2 / self.count[..., None])

    @property
    def rms(self):
        """Root of the mean square (NaN for an empty group)."""
        return np.sqrt(self.std ** 2 + self.mean * self.mean)


@dataclass
class FieldStats:
    """Moments of one field over a batch: per component (`components` names them, "norm" last
    for vector fields), in one group or, with `by_element`, one per atomic number, or, with
    `by` (a per-structure field's name), one per value of `groups` (that field's values)."""

    name: str
    per: str
    components: list
    by_element: bool
    per_atom: bool
    moments: Moments = None
    by: str | None = None
    groups: list | None = None

    @property
    def grouped(self):
        return self.by_element or self.by is not None

    def rows(self):
        """One dict per (element or group,) component with count, mean, std, rms, min and max; a
        field without values gives one row of count 0 per component."""
        m = self.moments
        groups = np.flatnonzero(m.count) if self.grouped else [0]
        out = []
        columns = {"mean": m.mean, "std": m.std, "rms": m.rms, "min": m.min, "max": m.max}
        for g in groups:
            for k, component in enumerate(self.components):
                row = {"field": self.name}
                if self.by_element:
                    row["element"] = int(g)
                elif self.by is not None:
                    row["group"] = self.groups[g]
                row.update(component=component, count=int(m.count[g]))
                row.update({key: float(v[g, k]) if m.count[g] else None
                            for key, v in columns.items()})
                out.append(row)
        return out


def component_names(shape):
    """"" for a scalar field; "0", "1", ... or "0_1", ... then "norm" for a vector field."""
    if not shape:
        return [""]
    return ["_".join(map(str, i)) for i in np.ndindex(*shape)] + ["norm"]


def as_rows(array):
    """An array (n, *F) as rows (n, prod(F))."""
    array = np.asarray(array)
    return array.reshape(len(array), int(np.prod(array.shape[1:], dtype=np.int64)))



def join_leaves(parts):
    """Leaf statistics of consecutive ranges (each name -> FieldStats stacked by leaf, as
    leaf_stats returns), joined in the order given."""
    return {name: replace(first, moments=Moments.stack([part[name].moments for part in parts]))
            for name, first in parts[0].items()}


def merge_stats(parts):
    """The statistics of the leaves of `parts` (see join_leaves) together, merged in one fixed
    tree over the leaves (Moments.tree_reduce)."""
    out = {}
    for name, s in join_leaves(parts).items():
        out[name] = replace(s, moments=s.moments.tree_reduce())
    return out
