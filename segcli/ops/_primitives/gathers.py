"""The values at the rows a search chose (take) and its transpose (put)."""


import jax.numpy as jnp

from segcli.ops import kernels
from segcli.ops._primitives._common import _empty, _multilinear, _Rule
from segcli.ops.kernels import (
    launch,
    pick,
)


def _take(rows, first, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (first.shape[0], *rows.shape[1:])
    if _empty(shape, rows):
        return jnp.zeros(shape, rows.dtype)
    return _flat_rows(rows).at[_flat_index(first, rows.shape[0])].get(mode="fill", fill_value=0)


take_p = _multilinear(_Rule(
    "take", _take, lambda rows, first, idx, offsets, **_: (first.shape[0], *rows.shape[1:]), 2,
    transposes=(lambda ct, first, seg, p: put_p.bind(ct, first, *seg, **p),)))
"""rows[first[s, g], g] (K,) for rows (N, G, K) and first (M, G), the rows an `extreme` search
chose; 0 where first is N (an empty segment). Linear in the rows; `first` (int32) is batched
as they are and not differentiated."""


def _put(ct, first, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (idx.shape[0], *ct.shape[1:])
    if _empty(shape, ct):
        return jnp.zeros(shape, ct.dtype)
    if gpu and ct.dtype == jnp.float64:  # each row written once (rows of 3 as whole vectors)
        n = idx.shape[0]
        if ct.shape[1] * ct.shape[2] == 3:
            put3 = pick(kernels.GATHERS, "put", device="gpu", size=3, dtype=ct.dtype)
            return launch(put3, ct.reshape(-1, 3), first, idx, dims=(n,), out=(n,)).reshape(shape)
        kernel = pick(kernels.GATHERS, "put", device="gpu")
        return launch(kernel, ct, first, idx, dims=(n,), out=shape)
    # zeros, then the M chosen rows
    chosen = _flat_rows(jnp.zeros(shape, ct.dtype)).at[_flat_index(first, shape[0])].add(
        ct, mode="drop")
    return chosen.reshape(shape)


def _flat_rows(rows):
    """rows (N, G, K) as (N·G, K), row i of group g at i·G + g: XLA's gathers and scatters by
    one index a row take a third of the time of those by (row, group) pairs on a CPU."""
    return rows.reshape(rows.shape[0] * rows.shape[1], *rows.shape[2:])


def _flat_index(first, n):
    """The rows of _flat_rows (of n rows) that first (M, G) names: past its end where first
    is n (int64 where n·G does not fit int32)."""
    groups = first.shape[1]
    dtype = jnp.int32 if n * groups < 2**31 else jnp.int64
    return first.astype(dtype) * groups + jnp.arange(groups, dtype=dtype)[None]


put_p = _multilinear(_Rule(
    "put", _put, lambda ct, first, idx, offsets, **_: (idx.shape[0], *ct.shape[1:]), 2,
    transposes=(lambda ct, first, seg, p: take_p.bind(ct, first, *seg, **p),)))
"""take's transpose: ct[s, g] at row first[s, g], 0 elsewhere, for ct (M, G, K): XLA's scatter
into zeros, or for float64 on GPUs a kernel writing each row once (a row of 3 entries, one
group of 3 features or 3 of one, as one vector: put3), which there beats it (float32 and
CPUs: not; benchmarks/RESULTS.md)."""
