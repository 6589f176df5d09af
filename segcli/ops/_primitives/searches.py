"""The first row of each segment's max, min or max norm (extreme), max_norm built on it, and
several reductions of one array in one pass (reductions_p: sum, mean, rms_norm, max_norm)."""


import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from segcli.ops import kernels
from segcli.ops._primitives._common import (
    _IMPLS,
    _device,
    _empty,
    _integral,
    _is_float_vec3,
    _jitted_bind,
    _layout,
    _lower,
    _register,
    _Rule,
    ids_known_sorted,
)
from segcli.ops._primitives.norms import rms_norm_p, scaled_norms
from segcli.ops._primitives.reductions import mean_p, sum_p
from segcli.ops.kernels import (
    MAX_NORM_LANES,
    PACKED_RUN,
    REDUCE_BITS,
    lane_grid,
    launch,
    pick,
    stride,
)

# --- The integer primitives.


def _worst_and_nan_keys(kind, dtype):
    """The key every other beats (to start the atomic search from) and the key NaN takes there
    (one no other beats)."""
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return (info.max, info.min) if kind == "min" else (info.min, info.max)
    return (np.inf, -np.inf) if kind == "min" else (-np.inf, np.inf)


def _extreme(x, idx, offsets, *, num_segments, indices_are_sorted, kind, gpu=False):
    return _search(x, idx, offsets, num_segments, indices_are_sorted, kind, gpu)[0]


def _search(x, idx, offsets, num_segments, indices_are_sorted, kind, gpu, norms=False):
    """(first, None), or with `norms` (max_norm, GPUs) (first, |x[first]|): norms the lanes
    search writes beside its rows where the ids are ordered (one launch for a known sorted
    max_norm), else XLA's of the rows found. float32 max_norm on GPUs with ids not known sorted
    takes its packed keys' rows instead (no norms)."""
    n, groups = x.shape[:2]
    first = jnp.full((num_segments, groups), n, jnp.int32)
    if _empty(first.shape, x):
        return first, jnp.zeros(first.shape, x.dtype) if norms else None
    if kind == "max_norm" and _by_packed_keys(x, offsets, indices_are_sorted, gpu):
        return _first_of_packed_keys(x, idx, num_segments), None
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    offsets, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    # Ordered ids: one pass per segment (max_norm's on GPUs by a group of MAX_NORM_LANES
    # threads), which writes every segment's row (N where empty): ids known sorted need no
    # `first` filled first. Otherwise: the atomic best of the keys, then the atomic min of the
    # rows attaining it. Each kernel returns at once when the flag says the other path applies.
    search = (pick(kernels.SEARCHES, kind, "ordered", device=_device(gpu)), x, offsets, ordered)
    lanes = gpu and kind == "max_norm"
    if lanes:
        width, dims = lane_grid(first.size, gpu, MAX_NORM_LANES[jnp.dtype(x.dtype).name])
        search += (width,)
    elif gpu:
        dims = first.shape
    else:  # max and min: a thread per segment
        dims = first.shape if kind == "max_norm" else first.shape[:1]
    if lanes and norms and known_sorted:  # the search writes every norm
        written, first = launch(*search, dims=dims, dtype=x.dtype,
                                out={"norms": first.shape, "out": first.shape})
        return first, written
    if lanes:  # norms written where the ids are ordered, or none (no rows)
        written = jnp.zeros(first.shape if norms else (0, groups), x.dtype)
        search += (written,)
    in_out = ("norms",) if lanes and norms else ()
    if known_sorted:
        return launch(*search, dims=dims, out=first.shape, dtype=x.dtype), None
    found = launch(*search, first, dims=dims, in_out=in_out + ("out",), dtype=x.dtype)
    written, first = found if in_out else (None, found)
    worst, nan_key = (jnp.full(shape, key, x.dtype) for shape, key in
                      zip((first.shape, (1,)), _worst_and_nan_keys(kind, x.dtype)))
    threads = stride(gpu, n)
    kernel = pick(kernels.SEARCHES, kind, "best")
    best = launch(kernel, x, idx, ordered, threads, nan_key, worst, dims=(threads, groups),
                  in_out=("best",), dtype=x.dtype)
    kernel = pick(kernels.SEARCHES, kind, "first")
    first = launch(kernel, x, idx, ordered, threads, nan_key, best, first,
                   dims=(threads, groups), in_out=("first",), dtype=x.dtype)
    if not norms:
        return first, None
    return first, jnp.where(ordered[0] != 0, written, _norms_of(x, first))


def _by_packed_keys(x, offsets, indices_are_sorted, gpu):
    """Whether max_norm searches by packed keys: float32 on GPUs with ids not known sorted
    (known sorted, the lanes search is faster and writes the norms too)."""
    return gpu and x.dtype == jnp.float32 and not ids_known_sorted(offsets, indices_are_sorted)


def _packed_keys(x, idx, num_segments):
    """max_norm's keys (M, G, 2) uint32 for float32 on GPUs, in any order of the ids (no
    layout): the integer atomic max of each segment's packed keys (the norm's bits, then the
    row, see the kernel; 0 for an empty segment), taken by a thread per run of PACKED_RUN
    rows. Ties and NaN go to the first row as on the other paths, and integer atomics give
    the same result in any order."""
    keys = jnp.zeros((num_segments, x.shape[1], 2), jnp.uint32)
    runs = -(-x.shape[0] // PACKED_RUN)
    kernel = pick(kernels.SEARCHES, "max_norm", "packed", device="gpu")
    return launch(kernel, x, idx, keys, dims=(runs, x.shape[1]), in_out=("keys",))


def _first_of_packed_keys(x, idx, num_segments):
    """max_norm's `first` for float32 on GPUs: the row in each key's lower word."""
    keys = _packed_keys(x, idx, num_segments)
    low, high = keys[..., 0], keys[..., 1]
    return jnp.where((low | high) == 0, x.shape[0], (~low).astype(jnp.int32))


extreme_p = _integral(_Rule(
    "extreme", _extreme, lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]),
    1, jnp.int32))
"""The first row attaining each segment's and group's extreme of x (N, G, K), or N: with
kind "max" or "min" the largest or smallest x[i, g, 0], with "max_norm" the largest |x[i, g]|."""


def _max_norm(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    groups = x.shape[1]
    if _empty((num_segments, groups), x):
        return jnp.zeros((num_segments, groups), x.dtype)
    if _by_packed_keys(x, offsets, indices_are_sorted, gpu):  # the norm in each key's upper word
        return jax.lax.bitcast_convert_type(_packed_keys(x, idx, num_segments)[..., 1],
                                            jnp.float32)
    if _in_one_pass(x, offsets, num_segments, indices_are_sorted, gpu):  # search and norm
        return _reductions(x, idx, offsets, num_segments=num_segments,
                           indices_are_sorted=indices_are_sorted, names=("max_norm",))[0]
    first, norms = _search(x, idx, offsets, num_segments, indices_are_sorted, "max_norm", gpu,
                           norms=gpu)
    return _norms_of(x, first) if norms is None else norms


def _norms_of(x, first):
    """|x[first[s, g], g]| (M, G) of x (N, G, K), 0 where first is N: the rows a max_norm search
    chose."""
    _, groups, k = x.shape
    if groups == 1:  # one index a row: no (M, K, 2) index array for XLA to build
        winners = x[:, 0].at[first[:, 0]].get(mode="fill", fill_value=0)
    else:  # each group's chosen row
        winners = x.at[first, jnp.arange(groups)].get(mode="fill", fill_value=0)
    return scaled_norms(winners.reshape(-1, k)).reshape(first.shape)


max_norm_p = _register(_Rule(
    "max_norm", _max_norm, lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]),
    1, batch_first=True))
"""max_i |x[i, g]| over each segment and group of x (N, G, K), 0 for an empty segment: the
norms of the rows `extreme` (kind "max_norm") chooses, on CPUs for rows of 3 with ids known
sorted the search and the norm in one kernel (reductions3); on GPUs those its lanes search
wrote where the ids are ordered, or in float32 with ids not known sorted the norms its packed
search compared.
No derivative rule of its own (segcli.ops gives it one)."""


# --- Several reductions of one array at once.

REDUCTIONS = tuple(REDUCE_BITS)
"""The reductions `reductions_p` computes together: sum, mean, rms_norm, max_norm."""


def _alone(name, x, idx, offsets, params):
    """Reduction `name` of x (N, G, K) by its own primitive: sum and mean (M, G·K), rms_norm and
    max_norm (M, G)."""
    if name in ("sum", "mean"):
        rows = x.reshape(x.shape[0], x.shape[1] * x.shape[2])
        return (sum_p if name == "sum" else mean_p).bind(rows, idx, offsets, **params)
    return (rms_norm_p if name == "rms_norm" else max_norm_p).bind(x, idx, offsets, **params)


def _in_one_pass(x, offsets, num_segments, indices_are_sorted, gpu):
    """Whether reductions3 reduces x (N, G, K): on CPUs, rows of 3 floats, ids known sorted,
    rows and segments to reduce."""
    return (not gpu and ids_known_sorted(offsets, indices_are_sorted) and _is_float_vec3(x)
            and not _empty((num_segments,), x))


def _reductions(x, idx, offsets, *, num_segments, indices_are_sorted, names, gpu=False):
    """[each reduction `names` holds, of x (N, G, K)], as the primitives of those names give
    it: on CPUs, for rows of 3 floats (G = 1) with ids known sorted, one kernel reading each
    segment's rows once for all of them (reductions3); elsewhere each its own primitive."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}
    if not _in_one_pass(x, offsets, num_segments, indices_are_sorted, gpu):
        return [_alone(name, x, idx, offsets, params) for name in names]
    offsets, _ = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    rows = (num_segments, 1)
    given = {"sums": jnp.zeros(rows + (3,), x.dtype), "means": jnp.zeros(rows + (3,), x.dtype),
             "rms": jnp.zeros(rows, x.dtype), "largest": jnp.zeros(rows, x.dtype)}
    for name, label in zip(REDUCTIONS, given):
        if name not in names:  # not written: no rows
            given[label] = given[label][:0]
    want = sum(REDUCE_BITS[name] for name in set(names))
    kernel = pick(kernels.REDUCTIONS, "reductions", device="cpu", ordering="offsets", size=3)
    sums, means, rms, largest = launch(kernel, x, offsets, want, *given.values(),
                                       dims=(num_segments,), in_out=tuple(given), dtype=x.dtype)
    out = {"sum": lambda: sums.reshape(num_segments, 3),
           "mean": lambda: means.reshape(num_segments, 3),
           "rms_norm": lambda: rms, "max_norm": lambda: largest}
    return [out[name]() for name in names]


def _reduction_shape(name, x, num_segments):
    return (num_segments, x.shape[1] * x.shape[2] if name in ("sum", "mean") else x.shape[1])


reductions_p = Primitive("segcli_reductions")
"""[sum, mean, rms_norm or max_norm of x (N, G, K), each named in `names`]: the primitives of
those names, each of x's rows read once for all of them on CPUs (rows of 3 floats, ids known
sorted). Not differentiated (segcli.ops gives the tangents of the primitives alone); batched
as they are."""
reductions_p.multiple_results = True
reductions_p.def_impl(lambda *args, **params: _jitted_bind(
    reductions_p, tuple(sorted(params.items())))(*args))
reductions_p.def_abstract_eval(lambda x, idx, offsets, *, names, num_segments, **_: [
    jax.core.ShapedArray(_reduction_shape(name, x, num_segments), x.dtype) for name in names])
_IMPLS[reductions_p] = _reductions
for _platform, _gpu in (("cpu", False), ("cuda", True)):
    _lower(reductions_p, _platform, _gpu)


def _reductions_batch(args, dims, *, names, **params):
    """Batched as each reduction's own primitive is."""
    return (jax.vmap(lambda *a: [_alone(name, *a, params) for name in names], in_axes=dims)(*args),
            [0] * len(names))


batching.primitive_batchers[reductions_p] = _reductions_batch
