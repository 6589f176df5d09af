"""rms_norm in one pass, its cotangent and curvature rows, and the scaled norms of rows."""


import jax
import jax.numpy as jnp

from segcli.ops import kernels
from segcli.ops._primitives._common import (
    _empty,
    _layout,
    _reduce,
    _register,
    _row_counts,
    _Rule,
    ids_known_sorted,
)
from segcli.ops.kernels import (
    PLAIN_SQUARES,
    lane_grid,
    launch,
    pick,
    stride,
)


def power_of_two(top):
    """(2^e, 2^-e) with 2^e <= top < 2^(e+1) for top >= 0, e clamped so that both are normal
    numbers (XLA and the kernels flush subnormal ones to 0), and e = -1 where top is 0, inf
    or NaN: dividing by a power of two is exact, so scaling by it keeps every digit. Read
    from and built as the floats' exponent bits (jnp.frexp and jnp.ldexp take float powers,
    which cost more than the norms around them on CPUs)."""
    info = jnp.finfo(top.dtype)
    bits = jnp.dtype(f"uint{info.bits}")
    field = (1 << (info.bits - 1 - info.nmant)) - 1  # the exponent's bits, all set: inf, NaN
    bias = info.maxexp - 1
    raw = jax.lax.bitcast_convert_type(top, bits) & ((1 << (info.bits - 1)) - 1)  # no sign
    stored = (raw >> info.nmant).astype(jnp.int32)
    e = jnp.where((raw == 0) | (stored == field), -1,  # (== 0 would take subnormals for 0)
                  jnp.clip(stored - bias, info.minexp, info.maxexp - 3))

    def power(exponent):
        return jax.lax.bitcast_convert_type((exponent + bias).astype(bits) << info.nmant,
                                            top.dtype)

    return power(e), power(-e)


SQUARES_ROWS = 1 << 20
"""Rows from which a GPU takes float32 norms over ids known sorted in two kernels (the sums of
squares per feature, then the norms) rather than rms_norm_span's one: the pair is faster at
N = 10⁷, and below this the launch it adds is taken to cost more than the pass it saves (an
estimate; benchmarks/rms_norm_paths.py measures the crossover)."""


def _rms_norm(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    n, groups, k = x.shape
    shape = (num_segments, groups)
    if _empty(shape, x):
        return jnp.zeros(shape, x.dtype)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    if gpu and x.dtype == jnp.float32 and not known_sorted:
        return _wide_rms_norm(x, idx, layout, num_segments)
    if gpu and x.dtype == jnp.float32 and n >= SQUARES_ROWS:
        # Σ x² per segment and feature by a thread each, then a thread per segment and group
        # adds its K sums (and sums again, scaled, where that overflowed or underflowed): 66 µs
        # on an H200 at N = 10⁷, where rms_norm_span takes 78 (benchmarks/RESULTS.md)
        kernel = pick(kernels.NORMS, "rms_norm", "feature_squares", device="gpu")
        features = _reduce(kernel, x.reshape(n, groups * k), x.reshape(n, groups * k),
                           idx, layout, (num_segments, groups * k), x.dtype, gpu, True)
        kernel = pick(kernels.NORMS, "rms_norm", "of_squares", device="gpu")
        return launch(kernel, x, *layout, features, dims=shape, out=shape)
    # the norms by lanes per segment where the ids are ordered, else Σ|x|² by atomics
    lanes, dims = lane_grid(num_segments * groups, gpu)
    entries = x.reshape(-1)
    kernel = pick(kernels.NORMS, "rms_norm", "span")
    out = launch(kernel, x, entries, entries, jnp.zeros((0, groups), x.dtype), *layout,
                 lanes, dims=dims, out=shape)
    if known_sorted:
        return out
    threads = stride(gpu, n)
    zeros = jnp.zeros(shape, x.dtype)
    rows = x.reshape(n, groups * k)
    kernel = pick(kernels.NORMS, "rms_norm", "squares")
    squares = _reduce(kernel, rows, rows, idx, layout, shape, x.dtype, gpu, False)
    # Unordered ids: Σ|x|² came by atomics; the segments of rows where it overflowed or
    # underflowed are summed again, scaled by a power of two near their largest entry, by
    # kernels that return at once (their one-element flag 0) where none did.
    ordered = layout[1][0] != 0
    counts = _row_counts(idx, layout, False, gpu)[:, None]
    plain = (squares >= PLAIN_SQUARES[jnp.dtype(x.dtype).name]) & ~jnp.isinf(squares)
    overflowed = (~ordered & jnp.any(~plain & (counts > 0))).astype(jnp.int32).reshape(1)
    kernel = pick(kernels.NORMS, "rms_norm", "top")
    top = launch(kernel, x, idx, overflowed, threads, squares, squares, zeros,
                 dims=(threads, groups), in_out=("out",))
    scale, inverse = power_of_two(top)
    kernel = pick(kernels.NORMS, "rms_norm", "rescaled")
    rescaled = launch(kernel, x, idx, overflowed, threads, squares, inverse, zeros,
                      dims=(threads, groups), in_out=("out",))
    counts = jnp.maximum(counts, 1).astype(x.dtype)
    unordered = jnp.where(plain, jnp.sqrt(squares / counts), scale * jnp.sqrt(rescaled / counts))
    return jnp.where(ordered, out, unordered)


def _wide_rms_norm(x, idx, layout, num_segments):
    """rms_norm of float32 on GPUs with ids not promised sorted: Σ x² per segment and feature
    in float64 (a thread each where the ids turn out ordered, else atomics, which count the
    rows too), then a thread per segment and group adds its K sums and takes the root of
    their mean. In float64 no float32 square or sum overflows or underflows, so nothing is
    summed again: two launches after the layout, where the float32 sums need a rescue."""
    n, groups, k = x.shape
    threads = stride(True, n)
    kernel = pick(kernels.NORMS, "rms_norm", "wide_squares", device="gpu")
    counts, squares = launch(kernel, x.reshape(n, groups * k), idx, *layout, threads,
                             jnp.zeros((num_segments,), jnp.int32),
                             jnp.zeros((num_segments, groups * k, 2), jnp.uint32),
                             dims=(max(num_segments, threads), groups * k),
                             in_out=("counts", "out"))
    shape = (num_segments, groups)
    kernel = pick(kernels.NORMS, "rms_norm", "of_wide_squares", device="gpu")
    return launch(kernel, *layout, n, counts, squares, dims=shape,
                  out=shape, dtype=jnp.float32)


rms_norm_p = _register(_Rule(
    "rms_norm", _rms_norm,
    lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 1))
"""sqrt(Σ |x[i, g]|² / count) over each segment and group of x (N, G, K), 0 for an empty
segment, in one pass over the rows on the ordered path (one kernel; on a GPU in float32 Σ x²
per feature, then the norms); finite wherever the true value is. No derivative
rule of its own (segcli.ops gives it one)."""


def _rms_norm_rows(g, c, idx, offsets, *, num_segments, indices_are_sorted, gpu=False,
                   rows=None, dc=None):
    """rms_norm's cotangent (kernel rms_norm_cotangent_span), or given `rows` and `dc` its
    curvature (rms_norm_curvature_span), for ids known sorted."""
    if _empty(g.shape, g) or num_segments == 0:
        return jnp.zeros(g.shape, g.dtype)
    offsets, _ = _layout(idx, offsets, num_segments, True, gpu)
    entries, c = g.reshape(-1), c.astype(g.dtype)
    kernel = pick(kernels.NORMS, "rms_norm", "cotangent" if rows is None else "curvature",
                  ordering="offsets")
    rows, dc = (entries, c) if rows is None else (rows.reshape(-1), dc)  # (the former unread)
    lanes, dims = lane_grid(num_segments * g.shape[1], gpu)
    out = launch(kernel, g, entries, rows, dc, c, offsets, lanes, dims=dims, out=(g.size,))
    return out.reshape(g.shape)


rms_norm_cotangent_p = _register(_Rule(
    "rms_norm_cotangent", _rms_norm_rows, lambda g, c, idx, offsets, **_: g.shape, 2))
"""g[i] · c[s] / (count · rms_norm(g)[s]) over the rows i of each segment s and group of g (N,
G, K), for ids known sorted (promised, or offsets given): rms_norm's cotangent, its norms
summed in the same kernel as rms_norm sums them (one pass over g, not two), 0 where the norm
is 0 and in rows of no segment. No derivative rule of its own (segcli.ops gives it one)."""


def _rms_norm_curvature_rows(g, rows, dc, c, idx, offsets, **params):
    return _rms_norm_rows(g, c, idx, offsets, rows=rows, dc=dc, **params)


rms_norm_curvature_rows_p = _register(_Rule(
    "rms_norm_curvature_rows", _rms_norm_curvature_rows,
    lambda g, rows, dc, c, idx, offsets, **_: g.shape, 4))
"""rms_norm's curvature for ids known sorted: rows[i] · c[s] / (count · norm) + g[i] · (dc /
δ - c · count · ι · S / δ³)[s] · ι, S = Σ <g[i] · ι, rows[i]>, norm = rms_norm(g) (ι, δ as
segcli.ops._norms._norm_terms takes them), in one pass over g and rows: the JVP of
rms_norm_cotangent along (rows, dc), and for dc = 0 its transpose for the rows. No derivative
rule of its own (segcli.ops gives it one)."""


def scaled_norms(rows):
    """|rows[s]| of rows (M, K), each row scaled by a power of two near its largest entry (so
    no square overflows or underflows)."""
    scale, inverse = power_of_two(jnp.max(jnp.abs(rows), axis=1, initial=0))
    scaled = rows * inverse[:, None]
    return scale * jnp.sqrt(jnp.sum(scaled * scaled, axis=1))
