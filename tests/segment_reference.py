"""An independent pure-JAX reference of the segment ops, built on jax.ops.segment_sum/max.

Used only by the tests: it never imports segcli, so it checks segcli.ops from outside.
"""

import math

import jax
import jax.numpy as jnp


def _valid(idx, m):
    return (idx >= 0) & (idx < m)


def _safe_sqrt(s):
    zero = s == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, s)))


def _rowwise(x):
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def count(idx, m):
    return jax.ops.segment_sum(jnp.ones(idx.shape, jnp.int32), idx, m)


def segment_sum(x, idx, m):
    return jax.ops.segment_sum(x, idx, m)


def mean(x, idx, m):
    c = jnp.maximum(count(idx, m), 1).astype(x.dtype)
    return segment_sum(x, idx, m) / c.reshape(-1, *([1] * (x.ndim - 1)))


def dot(x, y, idx, m):
    return jax.ops.segment_sum(jnp.sum(_rowwise(x * y), axis=1), idx, m)


def mul(x, y, idx, m):
    scale = jnp.where(_valid(idx, m), y[jnp.clip(idx, 0, max(m - 1, 0))], 0) if m else jnp.zeros(idx.shape, x.dtype)
    return x * scale.reshape(-1, *([1] * (x.ndim - 1)))


def rms_norm(x, idx, m):
    c = jnp.maximum(count(idx, m), 1).astype(x.dtype)
    return _safe_sqrt(dot(x, x, idx, m) / c)


def max_norm(x, idx, m):
    squares = jnp.sum(_rowwise(x * x), axis=1)
    top = jax.ops.segment_max(squares, idx, m)
    return _safe_sqrt(jnp.where(count(idx, m) > 0, top, 0))


def matvec(v, mat, idx, m):
    if m == 0:
        return jnp.zeros_like(v)
    rows = mat[jnp.clip(idx, 0, m - 1)]
    return jnp.where(_valid(idx, m)[:, None], jnp.einsum("ik,ikj->ij", v, rows), 0)
