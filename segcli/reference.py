"""A pure-JAX reference for the eight segment ops, independent of the Warp kernels.

Built on `jax.ops.segment_sum`/`segment_max`/`segment_min` and `jax.numpy` only, with the
semantics of SPEC §1: ids outside `[0, num_segments)` are dropped by reductions and give 0
in gathers, empty segments give 0, `rms_norm` and `max_norm` have derivatives 0 (never NaN,
at any order) where the norm is 0, and `max_norm` sends its gradient to the first element
attaining the maximum. Every function supports forward and reverse mode to any order.
Computes in the input dtype; `gradcheck` runs it in float64.
"""

import jax
import jax.numpy as jnp


def _valid(idx, num_segments):
    return (idx >= 0) & (idx < num_segments)


def _gather(values, idx, num_segments):
    """values[idx[i]] for each i, and 0 where idx[i] is out of range."""
    valid = _valid(idx, num_segments)
    gathered = jnp.take(values, jnp.where(valid, idx, 0), axis=0)
    mask = valid.reshape(valid.shape + (1,) * (values.ndim - 1))
    return jnp.where(mask, gathered, 0)


def _sum_trailing(x):
    return jnp.sum(x, axis=tuple(range(1, x.ndim)))


def _safe_sqrt(t):
    """sqrt(t) for t >= 0 whose derivatives of every order are 0 (not NaN) where t == 0."""
    positive = t > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, t, 1)), 0)


def _counts(idx, num_segments, dtype):
    return jax.ops.segment_sum(jnp.ones(idx.shape, dtype), idx, num_segments)


def segmented_sum(x, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = Σ_{idx[i]=s} x[i], shape (M, *F)."""
    return jax.ops.segment_sum(x, idx, num_segments, indices_are_sorted=indices_are_sorted)


def segmented_mean(x, idx, num_segments, *, indices_are_sorted=False):
    """Sum over each segment divided by its count; an empty segment gives 0."""
    total = segmented_sum(x, idx, num_segments, indices_are_sorted=indices_are_sorted)
    count = jnp.maximum(_counts(idx, num_segments, x.dtype), 1)
    return total / count.reshape(count.shape + (1,) * (x.ndim - 1))


def segmented_dot(x, y, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = Σ_{idx[i]=s} <x[i], y[i]>, contracting all trailing axes; shape (M,)."""
    return segmented_sum(_sum_trailing(x * y), idx, num_segments, indices_are_sorted=indices_are_sorted)


def segmented_mul(x, y, idx, num_segments):
    """out[i] = x[i] * y[idx[i]] for per-segment scalars y (M,); 0 for out-of-range ids."""
    scale = _gather(y, idx, num_segments)
    return x * scale.reshape(scale.shape + (1,) * (x.ndim - 1))


def segmented_rms_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = sqrt(Σ_{idx[i]=s} |x[i]|² / count); an empty segment gives 0; shape (M,)."""
    squares = segmented_dot(x, x, idx, num_segments, indices_are_sorted=indices_are_sorted)
    count = jnp.maximum(_counts(idx, num_segments, x.dtype), 1)
    return _safe_sqrt(squares / count)


def segmented_max_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """out[s] = max_{idx[i]=s} |x[i]|; an empty segment gives 0; shape (M,).

    The derivative flows through the first element attaining the maximum only.
    """
    norms = _safe_sqrt(_sum_trailing(x * x))
    valid = _valid(idx, num_segments)
    largest = jax.ops.segment_max(jax.lax.stop_gradient(norms), idx, num_segments,
                                  indices_are_sorted=indices_are_sorted)
    attains = valid & (norms == _gather(largest, idx, num_segments))
    position = jnp.arange(x.shape[0])
    first = jax.ops.segment_min(jnp.where(attains, position, x.shape[0]), idx, num_segments,
                                indices_are_sorted=indices_are_sorted)
    found = first < x.shape[0]
    return jnp.where(found, jnp.take(norms, jnp.where(found, first, 0)), 0)


def segmented_matvec(v, m, idx, num_segments):
    """out[i] = m[idx[i]]ᵀ @ v[i] for v (N, 3), m (M, 3, 3); 0 for out-of-range ids."""
    return jnp.einsum("nji,nj->ni", _gather(m, idx, num_segments), v)


def segmented_count(idx, num_segments):
    """Atoms in each segment, int32, shape (M,)."""
    return _counts(idx, num_segments, jnp.int32)
