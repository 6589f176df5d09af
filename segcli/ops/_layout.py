"""Segment ids and offsets: `segments`, `segments_of_offsets`, `segment_ids`, `check_segments`."""


import jax
import jax.numpy as jnp
import numpy as np

from segcli.ops import _primitives as P
from segcli.ops._common import Segments, _num_segments


def segments(n_atoms):
    """The Segments of consecutive segments of n_atoms[s] rows each (see `segment_ids`)."""
    n_atoms = _counts(n_atoms)
    offsets = np.concatenate([[0], np.cumsum(n_atoms, dtype=np.int64)]).astype(np.int32)
    return Segments(*jax.device_put((_host_ids(n_atoms), offsets)))


def segments_of_offsets(offsets, rows):
    """The Segments of CSR `offsets` (M+1,) int32, non-decreasing, over `rows` (static) rows,
    its ids made on the device (under `jax.jit` too): rows ahead of offsets[0] get id -1 and
    rows from offsets[M] on id M, out of range, so every op drops them (padding).

    Example::

        seg = segments_of_offsets(jnp.array([1, 3, 3, 4], jnp.int32), 6)
        seg.ids                   # [-1 0 0 2 3 3]
        segmented_sum(x, seg, 3)  # rows 1:3, none, row 3
    """
    offsets = jnp.asarray(offsets, jnp.int32)
    return Segments(P.segment_ids_of(offsets, int(rows)), offsets)


def segment_ids(n_atoms):
    """Sorted segment ids (N,) int32 for segments of n_atoms[s] rows each: 0,0,…,1,1,…"""
    return jnp.asarray(_host_ids(_counts(n_atoms)))


def _counts(n_atoms):
    """n_atoms as a NumPy array (read once from the device if it is there), checked: 1-D,
    integer, non-negative."""
    n_atoms = np.asarray(n_atoms)
    if n_atoms.ndim != 1 or n_atoms.dtype.kind not in "iu":
        raise ValueError(f"n_atoms must be a 1-D integer array, got shape {n_atoms.shape} "
                         f"and dtype {n_atoms.dtype}")
    if (n_atoms < 0).any():
        raise ValueError(f"n_atoms must be non-negative, got {int(n_atoms.min())} "
                         f"at position {int(np.argmin(n_atoms))}")
    return n_atoms


def _host_ids(n_atoms):
    return np.repeat(np.arange(len(n_atoms), dtype=np.int32), n_atoms)


def check_segments(idx, num_segments):
    """Raise ValueError naming the first id outside [0, num_segments) (concrete arrays only)."""
    m = _num_segments(num_segments)
    ids = np.asarray(idx)
    if ids.ndim != 1:
        raise ValueError(f"idx must be one-dimensional (N,), got shape {ids.shape}")
    bad = np.flatnonzero((ids < 0) | (ids >= m))
    if bad.size:
        raise ValueError(f"idx[{bad[0]}] = {ids[bad[0]]} is outside [0, {m}) "
                         f"({bad.size} ids out of range)")
