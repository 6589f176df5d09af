"""Differentiable segment ops over batches of atomic systems, computed by Warp kernels.

Every function takes per-atom arrays with a leading axis of N rows, segment ids `idx` of
shape (N,) (int32 or int64) or a `Segments` (sorted ids and their offsets, built once and
reused: no op then looks for the offsets), and a static `num_segments` M, and works under `jax.jit`,
`jax.vmap`, `jax.grad`, `jax.jvp`, `jax.jacfwd`, `jax.jacrev`, `jax.hessian` and `lax.scan`,
to any order, on the CPU and on CUDA GPUs. Called eagerly, each is one dispatch of a jitted
program, compiled on the first call of its shapes, dtypes and static arguments.

Semantics shared by all functions:

* Ids outside ``[0, num_segments)`` are dropped by reductions and give 0 in gathers
  (`segmented_mul`, `segmented_matvec`), as ``jax.ops.segment_sum`` does; no id, however
  wrong, reads or writes outside an array.
* ``indices_are_sorted=True`` promises non-decreasing ids and skips checking it; results are
  undefined if the promise is false. Non-decreasing ids (whether promised or detected) are
  reduced in a fixed order, so results are bitwise repeatable; other ids use atomics.
* float32 and float64 compute natively; float16 and bfloat16 accumulate in float32 and are
  returned in their own dtype.
* An empty segment gives 0 in sum, mean, dot, var, std, rms_norm, max_norm, count and
  bincount; -inf in max and logsumexp and +inf in min (for integers: their dtype's smallest
  and largest values), as ``jax.ops.segment_max``/``segment_min`` give.
* `segmented_rms_norm` and `segmented_max_norm` have gradient 0 where the norm is 0, and
  `segmented_max_norm` sends its gradient to the first row attaining the max.
* `segmented_mean`, `segmented_rms_norm` and `segmented_max_norm` are finite wherever their
  exact values are, up to the float max (no sum or square on the way overflows), and so are
  their derivatives.
"""

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from segcli.ops import _primitives as P

__all__ = [
    "REDUCTIONS",
    "Segments",
    "check_segments",
    "segment_ids",
    "segmented_bincount",
    "segmented_count",
    "segmented_dot",
    "segmented_logsumexp",
    "segmented_matvec",
    "segmented_max",
    "segmented_max_norm",
    "segmented_mean",
    "segmented_min",
    "segmented_mul",
    "segmented_reductions",
    "segmented_rms_norm",
    "segmented_softmax",
    "segmented_std",
    "segmented_sum",
    "segmented_var",
    "segments",
    "segments_of_offsets",
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


def _length(length):
    """bincount's `length` as an int, checked."""
    if not isinstance(length, int | np.integer) or length < 0:
        raise ValueError(f"length must be a non-negative static int, got {length!r}")
    return int(length)


def _array(a):
    """`a` as a JAX array (arrays and tracers as they are: no dispatch)."""
    return a if isinstance(a, jax.Array) else jnp.asarray(a)


def _int32(a, top, xp=jnp):
    """Integers `a` as int32 without wrapping: where int32 could not hold a dtype's values,
    those below 0 become -1 and those above `top` (≥ 0) become `top`, so order is kept."""
    if a.dtype == np.int32:
        return a
    if a.dtype.itemsize < 4:  # every value fits
        return a.astype(np.int32)
    if np.issubdtype(a.dtype, np.unsignedinteger):
        return xp.minimum(a, a.dtype.type(top)).astype(np.int32)
    return xp.clip(a, -1, top).astype(np.int32)


def _taken_ids(idx, m):
    """`idx` (ids or a Segments) as arrays, NumPy ids of another integer dtype made int32 on
    the host (`_int32`), before JAX could narrow them to int32 (x64 off) and wrap."""
    if isinstance(idx, Segments):
        return Segments(_taken_ids(idx.ids, m), _array(idx.offsets))
    if isinstance(idx, np.ndarray) and np.issubdtype(idx.dtype, np.integer):
        idx = _int32(idx, m, np)
    return _array(idx)


def _ids(idx, rows, m, name="idx"):
    """Ids as int32 (`_int32`: order kept, out-of-range ids still out of range), one for each
    row of `rows` (the name and shape of the operand they label), if given."""
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (N,), got shape {idx.shape}")
    if rows is not None and idx.shape[:1] != rows[1][:1]:
        operand, shape = rows
        raise ValueError(f"{name} has length {idx.shape[0]} but {operand} has {shape[0]} rows "
                         f"(shape of {name}: {idx.shape}, of {operand}: {shape})")
    return _int32(idx, m)


_WIDENED = {"int8": jnp.int32, "int16": jnp.int32, "uint8": jnp.int32, "uint16": jnp.int32,
            "uint32": jnp.int64}
"""Integer dtypes computed in a wider one (the result cast back wraps as the narrow sum would)."""


def _floats(name, x, rows=None, integers=False):
    """x as an array computed in float32/float64 (or, with `integers`, int32/int64: booleans
    as 0 and 1, so that their sum and max are `any` and their min `all` once cast back), and
    the dtype to return."""
    if integers and x.dtype == jnp.bool_:
        x = x.astype(jnp.int32)
        return _floats(name, x, rows, integers)[0], jnp.dtype(jnp.bool_)
    if integers and jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.uint64:
        if x.ndim == 0:
            raise ValueError(f"{name} must have a leading axis of rows, got a scalar")
        wide = _WIDENED.get(x.dtype.name, x.dtype)
        if wide == jnp.int64 and not jax.config.jax_enable_x64:  # int32 wraps as uint32 would
            return jax.lax.bitcast_convert_type(x, jnp.int32), x.dtype
        return x.astype(wide), x.dtype
    if not jnp.issubdtype(x.dtype, jnp.floating):
        allowed = ("real floating-point or int8..int64/uint8..uint32 or bool" if integers
                   else "real floating-point")
        raise TypeError(f"{name} must be a {allowed} array, got dtype {x.dtype}"
                        + ("" if integers else " (integer data: segmented_sum, _max, _min)"))
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


def _segments(idx, rows, m):
    """(ids, offsets) for the primitives from ids (offsets then empty: the reductions find
    them) or a Segments; `rows`: (name, shape) of the operand they label, or None."""
    if not isinstance(idx, Segments):
        return _ids(idx, rows, m), jnp.zeros((0,), jnp.int32)
    offsets = idx.offsets
    if offsets.shape != (m + 1,) or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"Segments.offsets must be (num_segments + 1,) = ({m + 1},) integers, "
                         f"got shape {offsets.shape} and dtype {offsets.dtype}")
    return _ids(idx.ids, rows, m, "Segments.ids"), offsets.astype(jnp.int32)


def _common(name, x, idx, m, integers=False):
    x, dtype = _floats(name, x, integers=integers)
    return x, _segments(idx, (name, x.shape), m), m, dtype


def _params(m, indices_are_sorted):
    return {"num_segments": m, "indices_are_sorted": indices_are_sorted}


def _nonzero_counts(seg, params, dtype):
    """Rows per segment as `dtype`, with empty segments counted as 1 (so they average to 0)."""
    counts = P.count(*seg, params["num_segments"], params["indices_are_sorted"])
    return jnp.maximum(counts, 1).astype(dtype)


def _grouped(x):
    """(N, *F) as (N, 1, K): one group of K = prod(F) features."""
    return x.reshape(x.shape[0], 1, math.prod(x.shape[1:]))


def _rows(x):
    """(N, *F) as (N, K)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


_SEGMENT_ARGS = """\
      idx: (N,) int32 or int64 segment ids, or a `Segments`. Ids outside [0, num_segments)
        are dropped by reductions and give 0 in per-row results.
      num_segments: M, a static int."""
_SORTED_ARG = """\
      indices_are_sorted: a promise (not checked) that the ids are non-decreasing. Sorted
        ids, promised or found, are reduced in a fixed order: bitwise repeatable."""


REDUCTIONS = P.REDUCTIONS
"""The reductions segmented_reductions computes together: sum, mean, rms_norm, max_norm."""


def _reductions(reductions):
    """segmented_reductions' names as a tuple, checked."""
    names = (reductions,) if isinstance(reductions, str) else tuple(reductions)
    unknown = [name for name in names if name not in REDUCTIONS]
    if unknown or not names:
        raise ValueError(f"reductions must name one or more of {', '.join(REDUCTIONS)}, "
                         f"got {reductions!r}")
    return names


_STATIC = {"num_segments": _num_segments, "indices_are_sorted": bool, "length": _length,
           "reductions": _reductions}
"""The static parameters of the ops, each with its check and conversion on the host."""


def _op(function):
    """A public op: its docstring filled with the arguments every op shares, and each call one
    dispatch of a `jax.jit` of it (compiled once per static parameters and argument shapes), its
    static parameters checked and its arrays taken in on the host first."""
    shared = _SEGMENT_ARGS
    if "indices_are_sorted" in function.__code__.co_varnames:
        shared += "\n" + _SORTED_ARG
    function.__doc__ = function.__doc__.replace("      {segment args}\n", shared + "\n")
    signature = inspect.signature(function)
    jitted = jax.jit(function, static_argnames=[n for n in signature.parameters if n in _STATIC])

    @functools.wraps(function)
    def op(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        m = _num_segments(bound.arguments["num_segments"])
        return jitted(**{name: _taken(name, value, m) for name, value in bound.arguments.items()})

    return op


def _taken(name, value, m):
    """An argument of an op as its jitted function takes it, given M = num_segments checked."""
    if name == "num_segments":
        return m
    if name in _STATIC:
        return _STATIC[name](value)
    return _taken_ids(value, m) if name == "idx" else _array(value)


@_op
def segmented_sum(x, idx, num_segments, *, indices_are_sorted=False):
    """Sum of the rows of each segment.

    Args:
      x: (N, *F) floats or integers (integers are summed in their own dtype, wrapping on
        overflow as ``jax.ops.segment_sum`` does; booleans give their `any`).
      {segment args}

    Returns:
      (M, *F) in x's dtype: out[s] = Σ_{idx[i]=s} x[i]; 0 for an empty segment.

    Example::

        segmented_sum(jnp.array([1., 2., 3.]), jnp.array([0, 0, 2]), 3)  # [3., 0., 3.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments, integers=True)
    out = P.sum_p.bind(_rows(x), *seg, **_params(m, indices_are_sorted))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_count(idx, num_segments, *, indices_are_sorted=False):
    """Rows per segment.

    Args:
      {segment args}

    Returns:
      (M,) int32: out[s] = #{i : idx[i] = s}.

    Example::

        segmented_count(jnp.array([0, 0, 2, 5]), 3)  # [2, 0, 1] (5 is out of range)
    """
    return P.count(*_segments(idx, None, num_segments), num_segments, indices_are_sorted)


@_op
def segmented_mean(x, idx, num_segments, *, indices_are_sorted=False):
    """Mean of the rows of each segment.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F): Σ_{idx[i]=s} x[i] / count, the sum divided once by the count (so [1., 6., 7.]
      gives 14/3 rounded); where that sum overflows, Σ x[i] · (1/count): finite wherever the
      mean is, up to the float max. 0 for an empty segment.

    Example::

        segmented_mean(jnp.array([1., 2., 3.]), jnp.array([0, 0, 2]), 3)  # [1.5, 0., 3.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = P.mean_p.bind(_rows(x), *seg, **_params(m, indices_are_sorted))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_dot(x, y, idx, num_segments, *, indices_are_sorted=False):
    """Sum over each segment of the rows' inner products, contracting all trailing axes.

    Args:
      x, y: (N, *F) floats of one shape.
      {segment args}

    Returns:
      (M,): out[s] = Σ_{idx[i]=s} <x[i], y[i]>; 0 for an empty segment.

    Example::

        x = jnp.ones((3, 3))
        segmented_dot(x, 2 * x, jnp.array([0, 0, 1]), 2)  # [12., 6.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    y, _ = _floats("y", y, ("as x", x.shape[0]))
    if y.shape != x.shape:
        raise ValueError(f"x and y must have the same shape, got x {x.shape} and y {y.shape}")
    y = y.astype(x.dtype)
    out = P.dot_p.bind(_grouped(x), _grouped(y), *seg, **_params(m, indices_are_sorted))
    return out[:, 0].astype(dtype)


@_op
def segmented_mul(x, y, idx, num_segments):
    """Each row times its segment's scalar.

    Args:
      x: (N, *F) floats.
      y: (M,) floats, one per segment.
      {segment args}

    Returns:
      (N, *F): out[i] = x[i] * y[idx[i]]; 0 for a row whose id is out of range.

    Example::

        segmented_mul(jnp.ones((3, 2)), jnp.array([2., 3.]), jnp.array([0, 1, 1]), 2)
        # [[2., 2.], [3., 3.], [3., 3.]]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    y, _ = _floats("y", y, ("num_segments", m))
    if y.ndim != 1:
        raise ValueError(f"y must have shape (num_segments,) = ({m},), got {y.shape}")
    out = P.scale_p.bind(_grouped(x), y.astype(x.dtype)[:, None], *seg, **_params(m, False))
    return out.reshape(x.shape).astype(dtype)


@_op
def segmented_rms_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """Root mean square norm of each segment's rows.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M,): sqrt(Σ_{idx[i]=s} |x[i]|² / count); 0 for an empty segment. Finite wherever the
      norm is, up to the float max, and exact down to the smallest numbers (a segment whose
      squares overflow or underflow is summed again, scaled by a power of two), and so are its
      derivatives. Every derivative is 0 (never NaN) where the norm is 0.

    Example::

        segmented_rms_norm(jnp.array([[3., 4.], [0., 0.]]), jnp.array([0, 0]), 1)  # [3.5355]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = _params(m, indices_are_sorted)
    return _rms_norms(_grouped(x), seg, tuple(params.items()))[:, 0].astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _rms_norms(g, seg, params):
    """sqrt(Σ |g[i]|² / count) per segment and group of g (N, G, K), by one kernel."""
    return P.rms_norm_p.bind(g, *seg, **dict(params))


@_rms_norms.defjvp
def _rms_norms_jvp(params, primals, tangents):
    g, seg = primals
    norms = _rms_norms(g, seg, params)
    return norms, _rms_norm_tangent_p.bind(g, tangents[0], norms, *seg, **dict(params))


def _norm_terms(g, norms, idx, offsets, params):
    """(ι, count, δ, zero) of rms_norm's derivatives: ι a power of two near 1/norm, held
    constant (every derivative stays exact, and no g · ι overflows), the rows per segment
    (M, 1), δ = count · norm · ι, and where the norm is 0 (every derivative is 0 there)."""
    _, inverse = P.power_of_two(jax.lax.stop_gradient(norms))
    zero = norms == 0
    counts = _nonzero_counts((idx, offsets), params, g.dtype)[:, None]
    return inverse, counts, counts * jnp.where(zero, 1, norms * inverse), zero


def _rms_norm_tangent(g, dg, norms, idx, offsets, **params):
    """d norm = Σ <g[i], dg[i]> / (count · norm) = Σ <g[i] · ι, dg[i]> / δ."""
    inverse, _, divisor, zero = _norm_terms(g, norms, idx, offsets, params)
    dot = P.scaled_dot_p.bind(g, dg, inverse, idx, offsets, **params)
    return jnp.where(zero, 0, dot / divisor)


def _rms_norm_tangent_transpose(ct, g, dg, norms, idx, offsets, **params):
    return [None, _rms_norm_cotangent(g, ct, norms, (idx, offsets), tuple(params.items())),
            None, None, None]


_rms_norm_tangent_p = P.custom_transposed("rms_norm_tangent", _rms_norm_tangent, linear=(1,),
                                          like=2, transpose=_rms_norm_tangent_transpose)
"""rms_norm's tangent map (linear in dg), transposed into _rms_norm_cotangent, which has a
JVP of its own in turn."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _rms_norm_cotangent(g, c, norms, seg, params):
    """rms_norm's transposed tangent map: the cotangent g[i] · c[s] / (count · norm) of g for a
    cotangent c (M, G) of the norms (= rms_norm(g), held constant: the JVP differentiates
    through g)."""
    if P.ids_known_sorted(seg[1], dict(params)["indices_are_sorted"]):  # the norms summed in it
        return P.rms_norm_cotangent_p.bind(g, c, *seg, **dict(params))
    inverse, _, divisor, zero = _norm_terms(g, norms, *seg, dict(params))
    return P.rescale_p.bind(g, inverse, jnp.where(zero, 0, c / divisor), *seg, **dict(params))


@_rms_norm_cotangent.defjvp
def _rms_norm_cotangent_jvp(params, primals, tangents):
    g, c, norms, seg = primals
    out = _rms_norm_cotangent(g, c, norms, seg, params)
    return out, _rms_norm_curvature_p.bind(g, tangents[0], tangents[1], norms, c, *seg,
                                           **dict(params))


def _rms_norm_curvature(g, dg, dc, norms, c, idx, offsets, **params):
    """The JVP of _rms_norm_cotangent, linear in (dg, dc): dg[i] · c[s] / (count · norm) +
    g[i] · (dc / δ - c · count · ι · S / δ³)[s] · ι, S = Σ <g[i] · ι, dg[i]>, in one kernel
    after the dot (ids known sorted: one kernel, the norms and the dot summed in it)."""
    if P.ids_known_sorted(offsets, params["indices_are_sorted"]):
        return P.rms_norm_curvature_rows_p.bind(g, dg, dc, c, idx, offsets, **params)
    terms = _norm_terms(g, norms, idx, offsets, params)
    dot = P.scaled_dot_p.bind(g, dg, terms[0], idx, offsets, **params)
    return _curvature_rows(g, dg, dc, dot, c, terms, idx, offsets, params)


def _curvature_rows(g, rows, dc, dot, c, terms, idx, offsets, params):
    """rows · ι · c / δ + g · ι · (dc - c · count · ι · dot / δ²) / δ, 0 where the norm is 0
    (`terms` from _norm_terms)."""
    inverse, counts, divisor, zero = terms
    along = jnp.where(zero, 0, (dc - c * counts * inverse * dot / divisor ** 2) / divisor)
    return P.rescale2_p.bind(rows, g, inverse, jnp.where(zero, 0, c / divisor), along, idx,
                             offsets, **params)


def _rms_norm_curvature_transpose(u, g, dg, dc, norms, c, idx, offsets, **params):
    """The transpose of the curvature, a Hessian: for dg the map itself at (u, 0) (both its
    terms by one kernel, where JAX would add two rescales), for dc R / δ, R = Σ <g · ι, u>
    (the same scaled dot as the map's, which XLA computes once)."""
    ct_dg = ct_dc = None
    if ad.is_undefined_primal(dg):
        ct_dg = _rms_norm_curvature(g, u, jnp.zeros_like(c), norms, c, idx, offsets, **params)
    if ad.is_undefined_primal(dc):
        inverse, _, divisor, zero = _norm_terms(g, norms, idx, offsets, params)
        dot = P.scaled_dot_p.bind(g, u, inverse, idx, offsets, **params)
        ct_dc = jnp.where(zero, 0, dot / divisor)
    return [None, ct_dg, ct_dc, None, None, None, None]


_rms_norm_curvature_p = P.custom_transposed(
    "rms_norm_curvature", _rms_norm_curvature, linear=(1, 2), like=0,
    transpose=_rms_norm_curvature_transpose)


def _lowest(dtype, kind):
    """The value of an empty segment's max (kind "max") or min: ∓inf, the integer bound, or
    for booleans (reduced as 0 and 1) False and True, as 0 and 1."""
    if dtype == jnp.bool_:
        return int(kind == "min")
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.min if kind == "max" else info.max
    return -jnp.inf if kind == "max" else jnp.inf


def _extreme_values(kind, rows, seg, params, dtype):
    """Each segment's max or min (`kind`) of each column of rows (N, K): the entries the
    search chose, so that the derivative flows to them; for an empty segment _lowest of
    `dtype` (the caller's, which rows may widen)."""
    first = P.extreme_p.bind(rows[:, :, None], *seg, kind=kind, **params)
    taken = P.take_p.bind(rows[:, :, None], first, *seg, **params)[..., 0]
    return jnp.where(first == rows.shape[0], _lowest(dtype, kind), taken)


_SIGN_BIT = np.uint32(2**31)


def _extreme(kind, x, idx, num_segments, indices_are_sorted):
    if x.dtype == jnp.uint32:  # ordered as int32 with the sign bit flipped (no int64 needed)
        flipped = jax.lax.bitcast_convert_type(x ^ _SIGN_BIT, jnp.int32)
        out = _extreme(kind, flipped, idx, num_segments, indices_are_sorted)
        return jax.lax.bitcast_convert_type(out, jnp.uint32) ^ _SIGN_BIT
    x, seg, m, dtype = _common("x", x, idx, num_segments, integers=True)
    out = _extreme_values(kind, _rows(x), seg, _params(m, indices_are_sorted), dtype)
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_max(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise max of each segment's rows.

    Args:
      x: (N, *F) floats or integers (reduced in their own dtype).
      {segment args}

    Returns:
      (M, *F) in x's dtype; -inf (integers: their smallest value; booleans: False) for an
      empty segment, as ``jax.ops.segment_max``; NaN where a segment's component holds one.
      The derivative of each component flows to the first row (in row order) attaining it,
      so ties split nothing.

    Example::

        segmented_max(jnp.array([1., 5., 5., 2.]), jnp.array([0, 0, 0, 2]), 3)  # [5., -inf, 2.]
    """
    return _extreme("max", x, idx, num_segments, indices_are_sorted)


@_op
def segmented_min(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise min of each segment's rows.

    Args:
      x: (N, *F) floats or integers (reduced in their own dtype).
      {segment args}

    Returns:
      (M, *F) in x's dtype; +inf (integers: their largest value; booleans: True) for an
      empty segment, as ``jax.ops.segment_min``; NaN where a segment's component holds one.
      The derivative of each component flows to the first row attaining it.

    Example::

        segmented_min(jnp.array([1., 5., 1., 2.]), jnp.array([0, 0, 0, 2]), 3)  # [1., inf, 2.]
    """
    return _extreme("min", x, idx, num_segments, indices_are_sorted)


@_op
def segmented_max_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """Largest norm of each segment's rows.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M,): max_{idx[i]=s} |x[i]|; 0 for an empty segment. Each norm is computed with the row
      scaled by a power of two near its largest entry, so it is finite wherever it is true,
      up to the float max. The derivative flows to the first row attaining the max, and is
      0 (never NaN) where the norm is 0.

    Example::

        segmented_max_norm(jnp.array([[3., 4.], [1., 0.]]), jnp.array([0, 0]), 1)  # [5.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = _params(m, indices_are_sorted)
    return _max_norms(_grouped(x), seg, tuple(params.items()))[:, 0].astype(dtype)


@_op
def segmented_reductions(x, idx, num_segments, reductions, *, indices_are_sorted=False):
    """Several reductions of the same rows at once.

    Args:
      x: (N, *F) floats.
      {segment args}
      reductions: names among "sum", "mean", "rms_norm" and "max_norm" (static).

    Returns:
      A tuple: for each name, what segmented_<name>(x, idx, num_segments) returns, bit for
      bit, and with the same derivatives. On CPUs, for rows of 3 features and ids known
      sorted (a Segments, or the promise), one kernel reads each segment's rows once for all
      of them; elsewhere each is computed as its own function computes it.

    Example::

        x = jnp.array([[3., 4., 0.], [0., 0., 0.]])
        segmented_reductions(x, jnp.array([0, 0]), 1, ("max_norm", "rms_norm"))  # [[5.], [3.5355]]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = tuple(_params(m, indices_are_sorted).items())
    return tuple(out.reshape(m, *x.shape[1:]).astype(dtype) if name in ("sum", "mean")
                 else out[:, 0].astype(dtype)
                 for name, out in zip(reductions, _together(_grouped(x), seg, reductions, params)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _together(g, seg, names, params):
    """[each named reduction of g (N, 1, K)]: sum and mean (M, K), rms_norm and max_norm (M, 1),
    by one primitive (see P.reductions_p)."""
    return P.reductions_p.bind(g, *seg, names=names, **dict(params))


@_together.defjvp
def _together_jvp(names, params, primals, tangents):
    """Each reduction's value and tangent by its own primitive and rules."""
    (g, seg), (dg, _) = primals, tangents
    p = dict(params)
    alone = {"sum": lambda g: P.sum_p.bind(g[:, 0], *seg, **p),
             "mean": lambda g: P.mean_p.bind(g[:, 0], *seg, **p),
             "rms_norm": lambda g: _rms_norms(g, seg, params),
             "max_norm": lambda g: _max_norms(g, seg, params)}
    return jax.jvp(lambda g: [alone[name](g) for name in names], (g,), (dg,))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _max_norms(g, seg, params):
    """max |g[i]| per segment of g (N, 1, K), by the kernels alone where nothing is
    differentiated."""
    return P.max_norm_p.bind(g, *seg, **dict(params))


@_max_norms.defjvp
def _max_norms_jvp(params, primals, tangents):
    """The norms of the rows the search chose, and their derivative (see _norms)."""
    (g, seg), (dg, _) = primals, tangents
    first = P.extreme_p.bind(g, *seg, kind="max_norm", **dict(params))
    norms, tangent = jax.jvp(_norms, (P.take_p.bind(g, first, *seg, **dict(params))[:, 0],),
                             (P.take_p.bind(dg, first, *seg, **dict(params))[:, 0],))
    return norms[:, None], tangent[:, None]


@jax.custom_jvp
def _norms(rows):
    """|rows[s]| of rows (M, K), each row scaled by a power of two near its largest entry
    (so no square overflows or underflows)."""
    return P.scaled_norms(rows)


@_norms.defjvp
def _norms_jvp(primals, tangents):
    """d |v| = <v, dv> / |v|, with v and |v| (not dv, which would underflow) divided by a power
    of two near |v|, held constant: every derivative stays exact; 0 where |v| is."""
    (rows,), (dv,) = primals, tangents
    norms = _norms(rows)
    _, inverse = P.power_of_two(jax.lax.stop_gradient(norms))
    zero = norms == 0
    units = rows * inverse[:, None] / jnp.where(zero, 1, norms * inverse)[:, None]
    return norms, jnp.where(zero, 0, jnp.sum(units * dv, axis=1))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _variance(rows, seg, params):
    """Σ (x[i] - mean)² / count per segment of rows (N, K): two passes, no cancellation (see
    P.moments_p)."""
    return P.moments_p.bind(rows, *seg, **dict(params))[..., 1]


@_variance.defjvp
def _variance_jvp(params, primals, tangents):
    """d var = 2 Σ (x - mean) dx / count by P.variance_tangent_p: the gradient, and each
    derivative of it, one kernel where the ids are known sorted (the variance itself unused)."""
    (rows, seg), (drows, _) = primals, tangents
    return (_variance(rows, seg, params),
            P.variance_tangent_p.bind(rows, drows, *seg, **dict(params)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _std(rows, seg, params):
    """sqrt(Σ (x[i] - mean)² / count) per segment of rows (N, K) (see P.moments_p)."""
    return jnp.sqrt(P.moments_p.bind(rows, *seg, **dict(params))[..., 1])


@_std.defjvp
def _std_jvp(params, primals, tangents):
    """d std = Σ (x - mean) dx / (count · std), 0 where std is 0, by P.std_tangent_p: its
    transpose (the gradient) and their derivatives one kernel each where the ids are known
    sorted on GPUs (the std itself unused)."""
    (rows, seg), (drows, _) = primals, tangents
    return _std(rows, seg, params), P.std_tangent_p.bind(rows, drows, *seg, **dict(params))


@_op
def segmented_var(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise population variance of each segment's rows: the mean of squared
    deviations from the segment's mean (two passes, no cancellation).

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F); 0 for an empty segment.

    Example::

        segmented_var(jnp.array([1., 3., 7.]), jnp.array([0, 0, 1]), 2)  # [1., 0.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _variance(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_std(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise population standard deviation of each segment's rows, sqrt(var).

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F); 0 for an empty segment. Every derivative is 0 (never NaN) where it is 0.

    Example::

        segmented_std(jnp.array([1., 3., 7.]), jnp.array([0, 0, 1]), 2)  # [1., 0.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _std(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _logsumexp(rows, seg, params):
    """log Σ exp x[i] per segment of rows (N, K): its shift plus the log of its sum (see
    P.exp_sums_p); -inf where the sum is 0."""
    out = P.exp_sums_p.bind(rows, *seg, **dict(params))
    none = out[..., 1] == 0
    return jnp.where(none, -jnp.inf, jnp.log(jnp.where(none, 1, out[..., 1]))) + out[..., 0]


@_logsumexp.defjvp
def _logsumexp_jvp(params, primals, tangents):
    """d lse = Σ softmax(x)[i] dx[i]: 0 (not NaN) where lse is -inf."""
    (rows, seg), (drows, _) = primals, tangents
    return (_logsumexp(rows, seg, params),
            P.sum_p.bind(_softmax(rows, seg, params) * drows, *seg, **dict(params)))


def _softmax(rows, seg, params):
    """exp(x[i] - shift) / Σ of its segment per row of rows (N, K); 0 where that sum is 0 or
    the id out of range (P.softmax_p, whose JVP is P.softmax_tangent_p)."""
    return P.softmax_p.bind(rows, *seg, **dict(params))


@_op
def segmented_logsumexp(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise log Σ exp x[i] over each segment, shifted by the segment's max: no
    overflow up to the float max.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F); -inf for an empty segment. Its gradient is `segmented_softmax`.

    Example::

        segmented_logsumexp(jnp.array([1000., 1000., 0.]), jnp.array([0, 0, 1]), 2)
        # [1000.6931, 0.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _logsumexp(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_softmax(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise softmax within each segment, shifted by the segment's max (stable).

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (N, *F): exp(x[i]) / Σ_{idx[j]=idx[i]} exp(x[j]); 0 for a row whose id is out of range
      and in a segment whose entries are all -inf.

    Example::

        segmented_softmax(jnp.array([0., 0., 5.]), jnp.array([0, 0, 1]), 2)  # [0.5, 0.5, 1.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _softmax(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(x.shape).astype(dtype)


@_op
def segmented_bincount(labels, idx, num_segments, length, *, indices_are_sorted=False):
    """How many rows of each segment carry each label (e.g. atomic numbers → composition).

    Args:
      labels: (N,) integers; labels outside [0, length) are dropped.
      {segment args}
      length: L, the number of labels, a static int.

    Returns:
      (M, L) int32: out[s, c] = #{i : idx[i] = s, labels[i] = c}. Not differentiable.

    Example::

        numbers = jnp.array([1, 1, 8, 6])  # H2O, then C
        segmented_bincount(numbers, jnp.array([0, 0, 0, 1]), 2, 119)[:, jnp.array([1, 6, 8])]
        # [[2, 0, 1], [0, 1, 0]]
    """
    if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.ndim != 1:
        raise TypeError(f"labels must be a 1-D integer array, got shape {labels.shape} and dtype "
                        f"{labels.dtype}")
    if labels.dtype not in (jnp.int32, jnp.int64):  # the kernels' two label types
        labels = _int32(labels, length)
    seg = _segments(idx, ("labels", labels.shape), num_segments)
    return P.bincount_p.bind(labels, *seg, **_params(num_segments, indices_are_sorted),
                             length=length)


@_op
def segmented_matvec(v, m, idx, num_segments):
    """Each row times its segment's matrix (e.g. scaled positions × cell = positions).

    Args:
      v: (N, 3) floats.
      m: (M, 3, 3) floats, one matrix per segment.
      {segment args}

    Returns:
      (N, 3): out[i] = m[idx[i]]ᵀ @ v[i]; 0 for a row whose id is out of range.

    Example::

        cell = 2 * jnp.eye(3)[None]
        segmented_matvec(jnp.array([[0.5, 0.5, 0.]]), cell, jnp.array([0]), 1)  # [[1., 1., 0.]]
    """
    v, seg, segments, dtype = _common("v", v, idx, num_segments)
    m, _ = _floats("m", m)
    if v.ndim != 2 or v.shape[1] != 3:
        raise ValueError(f"v must have shape (N, 3), got {v.shape}")
    if m.shape != (segments, 3, 3):
        raise ValueError(f"m must have shape (num_segments, 3, 3) = ({segments}, 3, 3), "
                         f"got {m.shape}")
    out = P.matvec_p.bind(v[:, None], m.astype(v.dtype)[:, None], *seg, **_params(segments, False),
                          transpose=False)
    return out[:, 0].astype(dtype)


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
