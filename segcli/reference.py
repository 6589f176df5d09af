"""A pure-JAX reference for every segment op (`segcli.registry.OPS`), independent of the
Warp kernels.

Built on `jax.ops.segment_sum`/`segment_max`/`segment_min` and `jax.numpy` only, with the
semantics of SPEC §1 and §1b: ids outside `[0, num_segments)` are dropped by reductions and
give 0 in gathers (and in softmax), empty segments give 0 (max and logsumexp -inf, min +inf),
`rms_norm`, `max_norm` and `std` have derivatives 0 (never NaN, at any order) where they are
0, and `max_norm`, `max` and `min` send their gradient to the first row attaining the
extreme. Every function supports forward and reverse mode to any order. Computes in the
input dtype; `gradcheck` runs it in float64. `mean` divides each row by its count, and
`rms_norm` and `max_norm` divide rows by a power of two above their largest entry before
squaring: their values and reverse-mode derivatives stay finite up to the float max (there,
forward-mode tangents, divided too, flush to 0).
"""

import jax
import jax.numpy as jnp


def _valid(idx, num_segments):
    return (idx >= 0) & (idx < num_segments)


def _take(values, index, found):
    """values[index] along the first axis where `found`, else 0 (also from an empty `values`)."""
    if values.shape[0] == 0:
        return jnp.zeros(index.shape + values.shape[index.ndim:], values.dtype)
    mask = found.reshape(found.shape + (1,) * (values.ndim - found.ndim))
    return jnp.where(mask, jnp.take(values, jnp.where(found, index, 0), axis=0), 0)


def _gather(values, idx, num_segments):
    """values[idx[i]] for each i, and 0 where idx[i] is out of range."""
    return _take(values, idx, _valid(idx, num_segments))


def _sum_trailing(x):
    return jnp.sum(x, axis=tuple(range(1, x.ndim)))


def _safe_sqrt(t):
    """sqrt(t) for t >= 0 (or NaN) whose derivatives of every order are 0 (not NaN) where
    t == 0."""
    zero = t == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, t)))


def _counts(idx, num_segments, dtype):
    return jax.ops.segment_sum(jnp.ones(idx.shape, dtype), idx, num_segments)


def _power_of_two_above(top):
    """2^e > top for top >= 0, held constant under differentiation, with e clamped so that
    2^e and 2^-e are normal numbers (XLA flushes subnormal ones to 0, and may divide by
    multiplying by the reciprocal): dividing by it is exact and brings every |x| <= top
    below 4, so that squares of values up to the float max do not overflow."""
    info = jnp.finfo(top.dtype)
    e = jnp.clip(jnp.frexp(jax.lax.stop_gradient(top))[1], info.minexp, info.maxexp - 2)
    return jnp.ldexp(jnp.ones_like(top), e)


def _per_row(values, x):
    """values (N,) broadcast against x (N, *F)."""
    return values.reshape(values.shape + (1,) * (x.ndim - 1))


def segmented_sum(x, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = Σ_{idx[i]=s} x[i], shape (M, *F)."""
    return jax.ops.segment_sum(x, idx, num_segments, indices_are_sorted=indices_are_sorted)


def segmented_mean(x, idx, num_segments, *, indices_are_sorted=False):
    """Sum over each segment of its rows divided by its count (no partial sum exceeds the
    largest |x|); an empty segment gives 0."""
    count = jnp.maximum(_gather(_counts(idx, num_segments, x.dtype), idx, num_segments), 1)
    return segmented_sum(x / _per_row(count, x), idx, num_segments,
                         indices_are_sorted=indices_are_sorted)


def segmented_dot(x, y, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = Σ_{idx[i]=s} <x[i], y[i]>, contracting all trailing axes; shape (M,)."""
    return segmented_sum(_sum_trailing(x * y), idx, num_segments,
                         indices_are_sorted=indices_are_sorted)


def segmented_mul(x, y, idx, num_segments):
    """out[i] = x[i] * y[idx[i]] for per-segment scalars y (M,); 0 for out-of-range ids."""
    scale = _gather(y, idx, num_segments)
    return x * scale.reshape(scale.shape + (1,) * (x.ndim - 1))


def segmented_rms_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = sqrt(Σ_{idx[i]=s} |x[i]|² / count); an empty segment gives 0; shape (M,).
    Each segment's rows are divided by a power of two above its largest |entry| first, so
    no square overflows."""
    top = jnp.maximum(jax.ops.segment_max(_largest(x), idx, num_segments,
                                          indices_are_sorted=indices_are_sorted), 0)
    scale = _power_of_two_above(top)
    scaled = x / _per_row(_power_of_two_above(_gather(top, idx, num_segments)), x)
    squares = segmented_dot(scaled, scaled, idx, num_segments,
                            indices_are_sorted=indices_are_sorted)
    count = jnp.maximum(_counts(idx, num_segments, x.dtype), 1)
    return scale * _safe_sqrt(squares / count)


def _largest(x):
    """max |x[i]| over each row's entries, (N,)."""
    return jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)), initial=0)


def _norms(x):
    """|x[i]| per row, (N,), each row divided by a power of two above its largest |entry|
    first (no square overflows)."""
    scale = _power_of_two_above(_largest(x))
    scaled = x / _per_row(scale, x)
    return scale * _safe_sqrt(_sum_trailing(scaled * scaled))


def segmented_max_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = max_{idx[i]=s} |x[i]|; an empty segment gives 0; shape (M,).

    The derivative flows through the first element attaining the maximum only.
    """
    norms = _norms(x)
    valid = _valid(idx, num_segments)
    largest = jax.ops.segment_max(jax.lax.stop_gradient(norms), idx, num_segments,
                                  indices_are_sorted=indices_are_sorted)
    attains = valid & (norms == _gather(largest, idx, num_segments))
    position = jnp.arange(x.shape[0])
    first = jax.ops.segment_min(jnp.where(attains, position, x.shape[0]), idx, num_segments,
                                indices_are_sorted=indices_are_sorted)
    return jnp.where(jnp.isnan(largest), largest, _take(norms, first, first < x.shape[0]))


def segmented_matvec(v, m, idx, num_segments):
    """out[i] = m[idx[i]]ᵀ @ v[i] for v (N, 3), m (M, 3, 3); 0 for out-of-range ids."""
    return jnp.einsum("nji,nj->ni", _gather(m, idx, num_segments), v)


def segmented_count(idx, num_segments, *, indices_are_sorted=False):
    """Atoms in each segment, int32, shape (M,)."""
    return _counts(idx, num_segments, jnp.int32)


def _rows_mask(valid, x):
    """valid (N,) broadcast against x (N, *F)."""
    return valid.reshape(valid.shape + (1,) * (x.ndim - 1))


def _first_attaining(x, idx, num_segments, segment_extreme, indices_are_sorted):
    """Componentwise segment_extreme of x, with each component's derivative taken from the
    first row attaining it (empty segments: segment_extreme's own value, -inf or +inf)."""
    best = segment_extreme(jax.lax.stop_gradient(x), idx, num_segments,
                           indices_are_sorted=indices_are_sorted)
    attains = _rows_mask(_valid(idx, num_segments), x) & (x == _gather(best, idx, num_segments))
    position = jnp.broadcast_to(jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1)),
                                x.shape)
    first = jax.ops.segment_min(jnp.where(attains, position, x.shape[0]), idx, num_segments,
                                indices_are_sorted=indices_are_sorted)
    found = first < x.shape[0]
    if x.shape[0] == 0:
        return best
    return jnp.where(found, jnp.take_along_axis(x, jnp.where(found, first, 0), axis=0), best)


def segmented_max(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise max over each segment, (M, *F); an empty segment gives -inf (integers:
    their smallest value)."""
    return _first_attaining(x, idx, num_segments, jax.ops.segment_max, indices_are_sorted)


def segmented_min(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise min over each segment, (M, *F); an empty segment gives +inf (integers:
    their largest value)."""
    return _first_attaining(x, idx, num_segments, jax.ops.segment_min, indices_are_sorted)


def segmented_var(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise population variance (the mean of squared deviations from the mean), (M,
    *F); an empty segment gives 0."""
    mean = segmented_mean(x, idx, num_segments, indices_are_sorted=indices_are_sorted)
    deviation = x - _gather(mean, idx, num_segments)
    return segmented_mean(deviation * deviation, idx, num_segments,
                          indices_are_sorted=indices_are_sorted)


def segmented_std(x, idx, num_segments, *, indices_are_sorted=False):
    """sqrt(segmented_var), with derivatives 0 where the variance is 0."""
    return _safe_sqrt(segmented_var(x, idx, num_segments, indices_are_sorted=indices_are_sorted))


def _shifted_exp(x, idx, num_segments, indices_are_sorted):
    """(exp(x - shift) per row, 0 for out-of-range ids; the shift per segment): the shift is
    the segment's max (0 if empty), held constant under differentiation."""
    top = jax.ops.segment_max(jax.lax.stop_gradient(x), idx, num_segments,
                              indices_are_sorted=indices_are_sorted)
    shift = jnp.where(jnp.isfinite(top), top, 0)
    valid = _rows_mask(_valid(idx, num_segments), x)
    return jnp.exp(jnp.where(valid, x - _gather(shift, idx, num_segments), -jnp.inf)), shift


def segmented_logsumexp(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise log Σ exp(x) over each segment, (M, *F), computed stably (shifted by the
    segment's max); an empty segment gives -inf."""
    scaled, shift = _shifted_exp(x, idx, num_segments, indices_are_sorted)
    total = jax.ops.segment_sum(scaled, idx, num_segments, indices_are_sorted=indices_are_sorted)
    positive = total > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, total, 1)) + shift, -jnp.inf)


def segmented_softmax(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise exp(x[i]) / Σ_{idx[j]=idx[i]} exp(x[j]), (N, *F), stable; 0 for rows with
    an out-of-range id."""
    scaled, _ = _shifted_exp(x, idx, num_segments, indices_are_sorted)
    total = jax.ops.segment_sum(scaled, idx, num_segments, indices_are_sorted=indices_are_sorted)
    below = _gather(total, idx, num_segments)
    return jnp.where(below > 0, scaled / jnp.where(below > 0, below, 1), 0)


def segmented_bincount(labels, idx, num_segments, length, *, indices_are_sorted=False):
    """How many rows of each segment have each label in [0, length), (M, length) int32; other
    labels are dropped."""
    one_hot = (labels.reshape(-1, 1) == jnp.arange(length, dtype=labels.dtype)[None]).astype(
        jnp.int32)
    return jax.ops.segment_sum(one_hot, idx, num_segments, indices_are_sorted=indices_are_sorted)
