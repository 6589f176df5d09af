"""What the public segment ops share: checking and converting their arguments (static
num_segments, ids, floats), `Segments`, and `_op`, which makes each op one jitted dispatch."""

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from segcli.ops import _primitives as P

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
