"""Differentiable segment ops over batches of atomic systems, computed by Warp kernels.

Every function takes per-atom arrays with a leading axis of N rows, segment ids `idx` of
shape (N,) (int32 or int64) or a `Segments` (sorted ids and their offsets, built once and
reused: no op then looks for the offsets), and a static `num_segments` M, and works under `jax.jit`,
`jax.vmap`, `jax.grad`, `jax.jvp`, `jax.jacfwd`, `jax.jacrev`, `jax.hessian` and `lax.scan`,
to any order, on the CPU and on CUDA GPUs.

Semantics shared by all functions:

* Ids outside ``[0, num_segments)`` are dropped by reductions and give 0 in gathers
  (`segmented_mul`, `segmented_matvec`), as ``jax.ops.segment_sum`` does; no id, however
  wrong, reads or writes outside an array.
* ``indices_are_sorted=True`` promises non-decreasing ids and skips checking it; results are
  undefined if the promise is false. Non-decreasing ids (whether promised or detected) are
  reduced in a fixed order, so results are bitwise repeatable; other ids use atomics.
* float32 and float64 compute natively; float16 and bfloat16 accumulate in float32 and are
  returned in their own dtype.
* Empty segments give 0. `segmented_rms_norm` and `segmented_max_norm` have gradient 0 where
  the norm is 0, and `segmented_max_norm` sends its gradient to the first row attaining the max.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from segcli.ops import _primitives as P

__all__ = [
    "Segments",
    "check_segments",
    "segment_ids",
    "segmented_count",
    "segmented_dot",
    "segmented_matvec",
    "segmented_max_norm",
    "segmented_mean",
    "segmented_mul",
    "segmented_rms_norm",
    "segmented_sum",
    "segments",
]

_NATIVE = (jnp.float32, jnp.float64)


def _num_segments(num_segments):
    try:
        m = int(num_segments)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"num_segments must be a static Python int, got {num_segments!r}") from None
    if m != num_segments or m < 0:
        raise ValueError(f"num_segments must be a non-negative integer, got {num_segments!r}")
    if m >= 2**31 - 1:
        raise ValueError(f"num_segments must be below 2**31 - 1, got {m}")
    return m


def _ids(idx, n, m, name="idx"):
    """Ids as int32, with every out-of-range id clipped to -1 or M (order is kept)."""
    if isinstance(idx, np.ndarray) and np.issubdtype(idx.dtype, np.integer) and idx.dtype != np.int32:
        idx = np.clip(idx, -1, m).astype(np.int32)
    idx = jnp.asarray(idx)
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (N,), got shape {idx.shape}")
    if n is not None and idx.shape[0] != n:
        raise ValueError(f"{name} has length {idx.shape[0]} but x has {n} rows (shape of {name}: {idx.shape})")
    if idx.dtype != jnp.int32:
        idx = jnp.clip(idx, -1, m).astype(jnp.int32)
    return idx


def _floats(name, x, rows=None):
    """x as a float array computed in float32/float64, and the dtype to return."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a real floating-point array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name} must have a leading axis of rows, got a scalar")
    if rows is not None and x.shape[0] != rows[1]:
        raise ValueError(f"{name} must have {rows[1]} rows ({rows[0]}), got shape {x.shape}")
    dtype = x.dtype
    return (x if dtype in _NATIVE else x.astype(jnp.float32)), dtype


class Segments(NamedTuple):
    """Sorted segment ids with their CSR offsets, built once (see `segments`) and passed as
    `idx` to any op, which then finds no offsets of its own and reduces in order.

    Attributes:
      ids: (N,) int32, non-decreasing.
      offsets: (M+1,) int32; offsets[s] is the first row whose id is s or more (rows
        offsets[s]:offsets[s+1] form segment s).

    Example::

        seg = segments(np.array([2, 0, 3]))  # ids [0 0 2 2 2], offsets [0 2 2 5]
        segmented_sum(x, seg, 3)             # as segmented_sum(x, seg.ids, 3)
    """

    ids: jax.Array
    offsets: jax.Array


def segments(n_atoms):
    """The Segments of consecutive segments of n_atoms[s] rows each (see `segment_ids`)."""
    ids = segment_ids(n_atoms)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(n_atoms), dtype=np.int64)])
    return Segments(ids, jnp.asarray(offsets.astype(np.int32)))


def _segments(idx, n, m):
    """(ids, offsets) for the primitives from ids (offsets then empty: the reductions find
    them) or a Segments."""
    if not isinstance(idx, Segments):
        return _ids(idx, n, m), jnp.zeros((0,), jnp.int32)
    offsets = jnp.asarray(idx.offsets)
    if offsets.shape != (m + 1,) or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"Segments.offsets must be (num_segments + 1,) = ({m + 1},) integers, "
                         f"got shape {offsets.shape} and dtype {offsets.dtype}")
    return _ids(idx.ids, n, m, "Segments.ids"), offsets.astype(jnp.int32)


def _common(name, x, idx, num_segments):
    m = _num_segments(num_segments)
    x, dtype = _floats(name, x)
    return x, _segments(idx, x.shape[0], m), m, dtype


def _params(m, indices_are_sorted):
    return {"num_segments": m, "indices_are_sorted": bool(indices_are_sorted)}


def _nonzero_counts(seg, params, dtype):
    """Rows per segment as `dtype`, with empty segments counted as 1 (so they average to 0)."""
    counts = P.count(*seg, params["num_segments"], params["indices_are_sorted"])
    return jnp.maximum(counts, 1).astype(dtype)


def _safe_sqrt(s):
    """sqrt with every derivative 0 (never NaN) where s is 0."""
    zero = s == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, s)))


def _grouped(x):
    """(N, *F) as (N, 1, K): one group of K = prod(F) features."""
    return x.reshape(x.shape[0], 1, math.prod(x.shape[1:]))


def _rows(x):
    """(N, *F) as (N, K)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def segmented_sum(x, idx, num_segments, *, indices_are_sorted=False):
    """Sum of the rows of x (N, *F) over each segment: (M, *F)."""
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = P.sum_p.bind(_rows(x), *seg, **_params(m, indices_are_sorted))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


def segmented_count(idx, num_segments, *, indices_are_sorted=False):
    """Number of ids equal to each segment: (M,) int32."""
    m = _num_segments(num_segments)
    return P.count(*_segments(idx, None, m), m, bool(indices_are_sorted))


def segmented_mean(x, idx, num_segments, *, indices_are_sorted=False):
    """Mean of the rows of x (N, *F) over each segment: (M, *F); an empty segment gives 0."""
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = _params(m, indices_are_sorted)
    total = P.sum_p.bind(_rows(x), *seg, **params)
    return (total / _nonzero_counts(seg, params, x.dtype)[:, None]).reshape(m, *x.shape[1:]).astype(dtype)


def segmented_dot(x, y, idx, num_segments, *, indices_are_sorted=False):
    """Σ over each segment of <x[i], y[i]>, contracting all trailing axes: (M,)."""
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    y, _ = _floats("y", y, ("as x", x.shape[0]))
    if y.shape != x.shape:
        raise ValueError(f"x and y must have the same shape, got x {x.shape} and y {y.shape}")
    y = y.astype(x.dtype)
    out = P.dot_p.bind(_grouped(x), _grouped(y), *seg, **_params(m, indices_are_sorted))
    return out[:, 0].astype(dtype)


def segmented_mul(x, y, idx, num_segments):
    """x[i] * y[idx[i]] for x (N, *F) and y (M,): (N, *F); out-of-range ids give 0."""
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    y, _ = _floats("y", y, ("num_segments", m))
    if y.ndim != 1:
        raise ValueError(f"y must have shape (num_segments,) = ({m},), got {y.shape}")
    out = P.scale_p.bind(_grouped(x), y.astype(x.dtype)[:, None], *seg, **_params(m, False))
    return out.reshape(x.shape).astype(dtype)


def segmented_rms_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """sqrt(Σ |x[i]|² / count) over each segment: (M,); an empty segment gives 0."""
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = _params(m, indices_are_sorted)
    squares = _squared_norms(_grouped(x), seg, tuple(params.items()))[:, 0]
    return _safe_sqrt(squares / _nonzero_counts(seg, params, x.dtype)).astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _squared_norms(g, seg, params):
    """Σ |g[i]|² per segment and group: dot(g, g), with the JVP 2 dot(g, t) (one kernel, not two)."""
    return P.dot_p.bind(g, g, *seg, **dict(params))


@_squared_norms.defjvp
def _squared_norms_jvp(params, primals, tangents):
    g, seg = primals
    return _squared_norms(g, seg, params), 2 * P.dot_p.bind(g, tangents[0], *seg, **dict(params))


def segmented_max_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """max |x[i]| over each segment: (M,); an empty segment gives 0."""
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = tuple(_params(m, indices_are_sorted).items())
    return _safe_sqrt(_max_squared_norm(_grouped(x), seg, params)[:, 0]).astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _max_squared_norm(g, seg, params):
    """max_i |g[i]|² per segment and group, straight from the kernel."""
    return P.max_norm_p.bind(g, *seg, **dict(params))[0]


@_max_squared_norm.defjvp
def _max_squared_norm_jvp(params, primals, tangents):
    # Through the rows that attain the max (M of them), so every order differentiates correctly.
    g, seg = primals
    _, first = P.max_norm_p.bind(g, *seg, **dict(params))

    def rows(a):
        if a.shape[0] == 0:
            return jnp.zeros((*first.shape, a.shape[2]), a.dtype)
        return a.at[first, jnp.arange(a.shape[1])].get(mode="fill", fill_value=0)

    winners, moves = rows(g), rows(tangents[0])
    return jnp.sum(winners * winners, axis=-1), 2 * jnp.sum(winners * moves, axis=-1)


def segmented_matvec(v, m, idx, num_segments):
    """m[idx[i]]ᵀ @ v[i] for v (N, 3) and m (M, 3, 3): (N, 3); out-of-range ids give 0."""
    v, seg, segments, dtype = _common("v", v, idx, num_segments)
    m, _ = _floats("m", m)
    if v.ndim != 2 or v.shape[1] != 3:
        raise ValueError(f"v must have shape (N, 3), got {v.shape}")
    if m.shape != (segments, 3, 3):
        raise ValueError(f"m must have shape (num_segments, 3, 3) = ({segments}, 3, 3), got {m.shape}")
    out = P.matvec_p.bind(v[:, None], m.astype(v.dtype)[:, None], *seg, **_params(segments, False), transpose=False)
    return out[:, 0].astype(dtype)


def segment_ids(n_atoms):
    """Sorted segment ids (N,) int32 for segments of n_atoms[s] rows each: 0,0,…,1,1,…"""
    n_atoms = jnp.asarray(n_atoms)
    if n_atoms.ndim != 1 or not jnp.issubdtype(n_atoms.dtype, jnp.integer):
        raise ValueError(f"n_atoms must be a 1-D integer array, got shape {n_atoms.shape} and dtype {n_atoms.dtype}")
    n_atoms = np.asarray(n_atoms)
    if (n_atoms < 0).any():
        raise ValueError(f"n_atoms must be non-negative, got {int(n_atoms.min())} at position {int(np.argmin(n_atoms))}")
    return jnp.asarray(np.repeat(np.arange(len(n_atoms), dtype=np.int32), n_atoms))


def check_segments(idx, num_segments):
    """Raise ValueError naming the first id outside [0, num_segments) (concrete arrays only)."""
    m = _num_segments(num_segments)
    ids = np.asarray(idx)
    if ids.ndim != 1:
        raise ValueError(f"idx must be one-dimensional (N,), got shape {ids.shape}")
    bad = np.flatnonzero((ids < 0) | (ids >= m))
    if bad.size:
        raise ValueError(f"idx[{bad[0]}] = {ids[bad[0]]} is outside [0, {m}) ({bad.size} ids out of range)")
