"""JAX primitives over the Warp kernels: each impl and shape rule beside its primitive, and
one table of differentiation rules.

The float primitives are linear or bilinear in their float operands, so the JVP of each is
the sum of the primitive applied with one operand replaced by its tangent, and its transpose
with respect to each operand is another primitive of the set:

    sum(x)         x ↦ gather(ct)                     (segment sum ↔ broadcast back)
    mean(x)        x ↦ gather(ct / count)
    gather(y)      y ↦ sum(ct)
    dot(x, y)      x ↦ scale(y, ct)      y ↦ scale(x, ct)
    scale(x, y)    x ↦ scale(ct, y)      y ↦ dot(ct, x)
    matvec(v, m)   v ↦ matvecᵀ(ct, m)    m ↦ outer(v, ct)   (matvec: v @ m per row; matvecᵀ: v @ mᵀ)
    matvecᵀ(v, m)  v ↦ matvec(ct, m)     m ↦ outer(ct, v)
    outer(a, b)    a ↦ matvecᵀ(b, ct)    b ↦ matvec(a, ct)
    rescale(x, y, z)     x ↦ rescale(ct, y, z)    y, z ↦ scaled_dot(x, ct, ·)   (x·y·z per row)
    rescale2(x, b, y, z, w)   x·y·z + b·y·w per row in one kernel, each product as rescale's
    variance_tangent(x, y)     x ↦ variance_cotangent(y, ct)   y ↦ variance_cotangent(x, ct)
    variance_cotangent(x, c)   x ↦ variance_cotangent(ct, c)   c ↦ variance_tangent(x, ct)
                               (2 Σ (x - mean) y / count; (x - mean) · 2 c / count per row)
    std_tangent(x; y)          y ↦ std_cotangent(x; ct)      (x ↦ by its formula)
    std_cotangent(x; c)        c ↦ std_tangent(x; ct)        (x ↦ std_curvature(x; dx, c))
    std_curvature(x; a, c)     a ↦ std_curvature(x; ct, c)   c ↦ sum(ct · std_curvature(x; a, 1))
                               (linear in the operands after x; their JVP in x as in brackets)

JAX derives every higher derivative, forward or reverse, from these rules. `rms_norm` (the
RMS norm of each segment, in one pass over the rows) has no rule: segcli.ops differentiates
it through a custom JVP built of the others, whose tangent map and that map's derivative are
`custom_transposed` primitives, composites of the others with a transpose of their own (so
that a second derivative adds its two rescales of the rows in one rescale2 kernel).
`reductions` gives several of sum, mean, rms_norm and max_norm of one array (on CPUs by one
kernel); segcli.ops differentiates each through its own primitive. `moments` (each segment's
mean and variance) and `exp_sums` (its largest value and sum of shifted exponentials) take
both passes over a segment in one kernel and have no rule either: segcli.ops differentiates
var by variance_tangent (whose derivatives are then one kernel each), std by `std_tangent`
(a custom_transposed primitive transposed into `std_cotangent`, whose JVP in x is
`std_curvature`, std's weighted second derivative), logsumexp through a custom JVP built of
sum and softmax. `softmax` has its JVP beside it: `softmax_tangent`, a custom_transposed
primitive that is its own transpose, and whose JVP in x is `softmax_curvature` (softmax's
second derivative, bilinear, its own transpose in each operand). On GPUs each of var's,
std's and softmax's derivatives is one kernel where the ids are ordered. The other
primitives give integers, so no derivative: `extreme` (the first row attaining each
segment's max, min or max norm, through which the ops differentiate), `count` and
`bincount`. Batching folds a vmapped axis into axis 1 of every float operand (the feature or
group axis), which keeps the segment ids and their order; vmapped ids fall back to a loop
over the batch.

Operands are the data arrays followed by int32 ids and int32 offsets: the segments' CSR
offsets (M+1,) when the caller has them (the ids then non-decreasing), else an empty array and
the reductions find them; parameters are `num_segments` (the length of the segment axis) and
`indices_are_sorted`, and matvec's `transpose` (matvecᵀ above), extreme's `kind` and
bincount's `length`.
"""

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from segcli.ops import kernels
from segcli.ops.kernels import (
    ANY,
    BINCOUNT_LANES,
    MAX_NORM_LANES,
    PACKED_RUN,
    PLAIN_SQUARES,
    REDUCE_BITS,
    cpu_available,
    lane_grid,
    launch,
    pick,
    stride,
)


def _device(gpu):
    """The device a kernel table names: "gpu" or "cpu"."""
    return "gpu" if gpu else "cpu"


@functools.partial(jax.jit, static_argnames=("num_segments", "indices_are_sorted", "gpu"))
def _layout(idx, offsets, num_segments, indices_are_sorted, gpu):
    """CSR offsets of the ids (`offsets` if given) and a one-element flag saying whether they
    are non-decreasing. Jitted, so that it is traced once per shapes and parameters: the
    primitives of one program over the same ids then hold the same kernel launch, which XLA
    merges into one."""
    if offsets.shape[0]:
        return offsets, jnp.ones((1,), jnp.int32)
    threads = num_segments + 1 if gpu else max(1, -(-idx.shape[0] // 4))  # (see the kernels)
    offsets = launch(pick(kernels.LAYOUT, "offsets", device=_device(gpu)), idx, dims=(threads,),
                     out=(num_segments + 1,))
    if indices_are_sorted or idx.shape[0] < 2:
        return offsets, jnp.ones((1,), jnp.int32)
    return offsets, jnp.all(idx[1:] >= idx[:-1]).astype(jnp.int32).reshape(1)


def segment_ids_of(offsets, rows):
    """Ids (rows,) int32 of the segments of non-decreasing CSR `offsets` (M+1,): s for rows
    [offsets[s], offsets[s+1]), -1 ahead of offsets[0], M from offsets[M] on. On CPUs a thread
    per segment writes its rows (XLA's cumulative sum there takes 10 times as long as
    NumPy's repeat on the host); elsewhere a cumulative sum of the segments starting at each
    row."""
    def by_sum(offsets):
        return jnp.cumsum(jnp.zeros(rows, jnp.int32).at[offsets].add(1, mode="drop")) - 1

    def by_runs(offsets):
        kernel = pick(kernels.LAYOUT, "ids", device="cpu")
        return launch(kernel, offsets, dims=(offsets.shape[0] + 1,), out=(rows,))

    if not cpu_available():
        return by_sum(offsets)
    return jax.lax.platform_dependent(offsets, cpu=by_runs, default=by_sum)


def ids_known_sorted(offsets, indices_are_sorted):
    """Whether the ids are known, at trace time, to be in order: promised, or given offsets."""
    return bool(indices_are_sorted) or offsets.shape[0] > 0


def _reduce(kernel, a, b, idx, layout, shape, dtype, gpu, known_sorted, vector=()):
    """Reduction `kernel` (a table's Variant) of rows a (N, ·) and b into (M, P) = `shape`
    elements of `dtype` (each of shape `vector` for the vec3 kernels), over M × P threads where
    the ids are known sorted, else max(M, stride) × P: a segment per thread for ordered ids
    (each writing its own result, so the output is filled first only where the order is found
    at run time), else atomics into zeros; `layout` is `_layout`'s. Ids known sorted are not
    passed (that path reads none), so that XLA drops their making."""
    threads = stride(gpu, idx.shape[0])
    dims = (_segment_threads(shape[0], threads, known_sorted), *shape[1:])
    args = (kernel, a, b, idx[:0] if known_sorted else idx, *layout, threads)
    if known_sorted:
        return launch(*args, dims=dims, out=shape, dtype=a.dtype)
    zeros = jnp.zeros((*shape, *vector), dtype)
    return launch(*args, zeros, dims=dims, in_out=("out",), dtype=a.dtype)


def _segment_threads(m, stride_threads, known_sorted):
    """Threads of a reduction over m segments: one a segment where the ids are known sorted,
    else also the fallback's `stride_threads` (see kernels.stride) where they are more."""
    return m if known_sorted else max(m, stride_threads)


def _row_counts(idx, layout, known_sorted, gpu):
    """Rows per segment (M,) int32: the differences of the offsets where the ids are known to
    be sorted (no kernel), else the count kernel."""
    if known_sorted:
        return jnp.diff(layout[0])
    rows = idx.reshape(-1, 1)
    shape = (layout[0].shape[0] - 1, 1)
    kernel = pick(kernels.REDUCTIONS, "count")
    return _reduce(kernel, rows, rows, idx, layout, shape, jnp.int32, gpu, False)[:, 0]


def _is_float_vec3(x):
    """Rows of one group of 3 float features, which CPUs reduce faster as vec3."""
    return x.shape[1:] in ((3,), (1, 3)) and jnp.issubdtype(x.dtype, jnp.floating)


def _rows3(op, *args, idx, offsets, segments, gpu):
    """The (N,) vec3 output of GATHERS' kernel for `op` over the N rows of 3 of the ids `idx`
    (among `args`): a row a thread, or on CPUs given the offsets its variant of a segment (of
    `segments`) a thread, which reads each segment's factors once (faster there:
    benchmarks/RESULTS.md) and no id (passed none, so that XLA drops their making)."""
    kernel = pick(kernels.GATHERS, op, device=_device(gpu),
                  ordering="offsets" if offsets.shape[0] else "ids", size=3)
    by_segment = kernel.ordering == "offsets"
    if by_segment:
        args = tuple(idx[:0] if a is idx else a for a in args)
    return launch(kernel, *args, dims=(segments if by_segment else idx.shape[0],),
                  out=(idx.shape[0],))


@dataclass(frozen=True)
class _Rule:
    """A primitive: its impl(*operands, num_segments, indices_are_sorted, gpu, **params), its
    output shape(*operand avals, num_segments, **params), its output dtype (None: the first
    operand's), its `arity` float operands that are differentiated and batched by folding, and
    if linear `transposes[j]`, mapping a cotangent, the other float operands, the ids and the
    parameters to operand j's cotangent. With `batch_first`, a batched output has its batch
    axis first (else second, where folding leaves it): that of the JVP built of other
    primitives that segcli.ops gives it, as JAX takes a custom JVP's primal batch axes for
    its JVP's outputs under jit. A multilinear primitive that is a sum of products gives its
    `slots`: the groups of operands that each product holds one of (default: each operand a
    group of its own, one product)."""

    name: str
    impl: object
    shape: object
    arity: int = 0
    dtype: object = None
    transposes: tuple = ()
    batch_first: bool = False
    slots: tuple = ()


def _fold_batch(args, dims, arity):
    """Move each float operand's batch axis into axis 1 (broadcasting unbatched ones)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args[:arity], dims[:arity]):
        a = (jnp.moveaxis(a, d, 1) if d is not None
             else jnp.broadcast_to(a[:, None], (a.shape[0], size, *a.shape[1:])))
        folded.append(a.reshape(a.shape[0], size * a.shape[2], *a.shape[3:]))
    return folded, size


def _unfold(out, size):
    return out.reshape(out.shape[0], size, out.shape[1] // size, *out.shape[2:])


def _loop_batch(prim, args, dims, params):
    """Vmapped ids or offsets: run the primitive once per batch element."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
             for a, d in zip(args, dims)]
    out = jax.lax.map(lambda xs: prim.bind(*xs, **params), moved)
    return out, 0


_IMPLS = {}  # primitive -> impl, for `lower_cpu_as_gpu`


def _lower(prim, platform, gpu):
    impl = functools.partial(_IMPLS[prim], gpu=gpu)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=prim.multiple_results),
                           platform=platform)


def lower_cpu_as_gpu(enabled):
    """Lower the primitives on the CPU with their GPU code paths (many-thread atomics, the kernels
    a GPU uses), so that a machine without one tests them; clears JAX's caches."""
    for prim in _IMPLS:
        _lower(prim, "cpu", gpu=enabled)
    jax.clear_caches()


@functools.cache
def _jitted_bind(prim, params):
    """`prim.bind` with `params` (sorted items) under jax.jit, built once per primitive and
    parameters, so that an eager call reuses JAX's compiled program."""
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def _register(rule):
    prim = Primitive(f"segcli_{rule.name}")
    prim.def_impl(lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args))
    _IMPLS[prim] = rule.impl
    for platform, gpu in (("cpu", False), ("cuda", True)):
        _lower(prim, platform, gpu)

    def abstract(*avals, **params):
        return jax.core.ShapedArray(rule.shape(*avals, **params), rule.dtype or avals[0].dtype)

    def batch(args, dims, **params):
        if any(d is not None for d in dims[rule.arity:]):
            return _loop_batch(prim, args, dims, params)
        folded, size = _fold_batch(args, dims, rule.arity)
        out = _unfold(prim.bind(*folded, *args[rule.arity:], **params), size)
        return (jnp.moveaxis(out, 1, 0), 0) if rule.batch_first else (out, 1)

    prim.def_abstract_eval(abstract)
    batching.primitive_batchers[prim] = batch
    return prim


def _symbolic_zero(value):
    return ad.Zero(jax.typeof(value).to_tangent_aval())


def _sum_terms(terms, like):
    """The sum of `terms`, or a symbolic zero tangent of `like` if there are none."""
    if not terms:
        return _symbolic_zero(like)
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _multilinear(rule):
    """Register a primitive linear in each float operand (in each slot, see _Rule), with its JVP
    and transposes."""
    prim = _register(rule)
    slots = rule.slots or tuple((j,) for j in range(rule.arity))

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        terms = []
        for slot in slots:
            if all(type(tangents[j]) is ad.Zero for j in slot):
                continue
            operands = list(primals)
            for j in slot:
                operands[j] = ad.instantiate_zeros(tangents[j])
            terms.append(prim.bind(*operands, **params))
        return out, _sum_terms(terms, out)

    def transpose(ct, *operands, **params):
        *floats, idx, offsets = operands
        cotangents = [None] * len(operands)
        for j, f in enumerate(floats):  # (several only in different products of a sum)
            if not ad.is_undefined_primal(f):
                continue
            if type(ct) is ad.Zero:
                cotangents[j] = ad.Zero(f.aval)
            else:
                others = [g for k, g in enumerate(floats) if k != j]
                cotangents[j] = rule.transposes[j](ct, *others, (idx, offsets), params)
        return cotangents

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    return prim


def _integral(rule):
    """Register a primitive giving integers: piecewise constant, its derivative zero."""
    prim = _register(rule)

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        return out, _symbolic_zero(out)

    ad.primitive_jvps[prim] = jvp
    return prim


def custom_transposed(name, function, linear, like, transpose, impl=None, multilinear=False,
                      moving_jvp=None):
    """A primitive computing `function(*operands, **params)` from other primitives, linear in
    the operands numbered in `linear` (jointly, or with `multilinear` in each of them apart),
    whose transpose is `transpose(ct, *operands, **params)` (a cotangent for each operand, None
    for the others; the linear ones to find are ad.UndefinedPrimal) rather than that of the
    function's parts: one that shares their work, or fuses the terms JAX would add. Its result
    has the aval of operand `like`, or `like(*avals, **params)` if a function. Its JVP keeps the
    linear operands' tangents in the primitive (so that transposing it stays custom) and
    differentiates `function` for the others, or gives their term as `moving_jvp(primals,
    tangents, **params)` if given; it is batched as `function`, and lowered as it, or as
    `impl(*operands, gpu, **params)` (a kernel of its own where one applies) if given."""
    prim = Primitive(f"segcli_{name}")
    prim.def_impl(lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args))
    prim.def_abstract_eval(lambda *avals, **params: avals[like] if isinstance(like, int)
                           else like(*avals, **params))
    if impl is None:
        mlir.register_lowering(prim, mlir.lower_fun(function, multiple_results=False))
    else:
        _IMPLS[prim] = impl
        for platform, gpu in (("cpu", False), ("cuda", True)):
            _lower(prim, platform, gpu)

    def along_linear(primals, tangents, slot, params):
        return prim.bind(*(ad.instantiate_zeros(t) if j in slot else p
                           for j, (p, t) in enumerate(zip(primals, tangents))), **params)

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        slots = [(j,) for j in linear] if multilinear else [linear]
        terms = [along_linear(primals, tangents, slot, params) for slot in slots
                 if any(type(tangents[j]) is not ad.Zero for j in slot)]
        moving = [j for j, t in enumerate(tangents) if j not in linear and type(t) is not ad.Zero
                  and jnp.issubdtype(primals[j].dtype, jnp.inexact)]
        if moving and moving_jvp is not None:
            terms.append(moving_jvp(primals, tangents, **params))
        elif moving:
            def along(*values):
                operands = list(primals)
                for j, value in zip(moving, values):
                    operands[j] = value
                return function(*operands, **params)

            terms.append(jax.jvp(along, [primals[j] for j in moving],
                                 [tangents[j] for j in moving])[1])
        return out, _sum_terms(terms, out)

    def transposed(ct, *operands, **params):
        if type(ct) is ad.Zero:
            return [ad.Zero(o.aval) if ad.is_undefined_primal(o) else None for o in operands]
        return transpose(ct, *operands, **params)

    def batch(args, dims, **params):
        return jax.vmap(functools.partial(function, **params), in_axes=dims)(*args), 0

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transposed
    batching.primitive_batchers[prim] = batch
    return prim


def _segments(p):
    """The parameters every primitive takes (matvec's `transpose` dropped)."""
    return {"num_segments": p["num_segments"], "indices_are_sorted": p["indices_are_sorted"]}


def _empty(shape, *operands):
    """Zeros of the output when it or an operand has no entries (no kernel to launch)."""
    return any(0 in tuple(a.shape) for a in operands) or 0 in shape


# --- The float primitives, each with its impl and shape; the lambdas of the table of
# transposes refer to primitives defined further down.


def _reduce_rows(op, x, b, idx, layout, num_segments, gpu, known_sorted):
    """Reduction `op` of the rows x (N, K) with its second operand `b` (None: x itself), by
    its variant over rows of vec3 where the table has one (a CPU reduces rows of 3 floats
    faster so)."""
    kernel = pick(kernels.REDUCTIONS, op, device=_device(gpu),
                  size=3 if _is_float_vec3(x) else ANY)
    if kernel.size == 3:
        rows = x.reshape(x.shape[0], 1, 3)
        out = _reduce(kernel, rows, rows if b is None else b, idx, layout, (num_segments, 1),
                      x.dtype, gpu, known_sorted, vector=(3,))
        return out.reshape(num_segments, 3)
    return _reduce(kernel, x, x if b is None else b, idx, layout, (num_segments, x.shape[1]),
                   x.dtype, gpu, known_sorted)


def _sum(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (num_segments, x.shape[1])
    if _empty(shape, x):
        return jnp.zeros(shape, x.dtype)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    return _reduce_rows("sum", x, None, idx, layout, num_segments, gpu,
                        ids_known_sorted(offsets, indices_are_sorted))


sum_p = _multilinear(_Rule(
    "sum", _sum, lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 1,
    transposes=(lambda ct, seg, p: gather_p.bind(ct, *seg, **p),)))


def at_rows(values, idx):
    """values[idx[i]] per row, 0 where idx[i] is out of range (negative ones too, which JAX's
    indexing would wrap), by XLA's gather, which XLA fuses into the work that uses it."""
    m = values.shape[0]
    if m == 0:
        return jnp.zeros((idx.shape[0], *values.shape[1:]), values.dtype)
    valid = ((idx >= 0) & (idx < m)).reshape(-1, *(1,) * (values.ndim - 1))
    return jnp.where(valid, values[jnp.clip(idx, 0, m - 1)], 0)


def _in_rows(rows, idx, num_segments):
    """rows, 0 in rows of no segment."""
    return jnp.where(((idx >= 0) & (idx < num_segments))[:, None], rows, 0)


XLA_GATHER_ROWS = 1 << 20
"""Rows up to which gather_p of float64 is XLA's gather on GPUs (float32: at any size), which
XLA fuses into the work that uses the rows. On an H100 at N = 10⁷, float32: the gradients of
var, std, logsumexp and softmax 1.2–1.6 times as fast (var 390 → 243 µs), their second
orders 1.3–2 times, sum's as fast, mean's slower (81 → 96 µs: its gather alone); float64
gathered alone (grad sum) took twice the kernel's time (118 → 236 µs), so from 2²⁰ rows on
float64 is the kernel's (benchmarks/RESULTS.md)."""


def _gather(y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (idx.shape[0], y.shape[1])
    if _empty(shape, y):
        return jnp.zeros(shape, y.dtype)
    if gpu and (y.dtype != jnp.float64 or idx.shape[0] < XLA_GATHER_ROWS):
        return at_rows(y, idx)  # fused into the work that uses the rows
    if _is_float_vec3(y):
        return _rows3("gather", y, idx, offsets, idx=idx, offsets=offsets,
                      segments=y.shape[0], gpu=gpu).reshape(shape)
    return launch(pick(kernels.GATHERS, "gather"), y, idx, dims=(idx.shape[0],), out=shape)


def _mean(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (num_segments, x.shape[1])
    if _empty(shape, x):
        return jnp.zeros(shape, x.dtype)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    out = _reduce_rows("mean", x, None, idx, layout, num_segments, gpu, known_sorted)
    if known_sorted:
        return out
    # Ids found ordered at run time: `out` holds the means. Otherwise it holds the sums (by
    # atomics), each divided by its count by mean_of_sums; the segments whose sum is not
    # finite are summed again as Σ x[i] · (1/count) by a kernel that returns at once (its flag
    # 0) where none is.
    ordered = layout[1]
    counts = _row_counts(idx, layout, False, gpu)
    rescue = ((ordered[0] == 0) & ~jnp.all(jnp.isfinite(out))).astype(jnp.int32).reshape(1)
    n, k = x.shape
    threads = stride(gpu, n)
    weights = jnp.broadcast_to(1 / jnp.maximum(counts, 1).astype(x.dtype)[:, None], shape)
    kernel = pick(kernels.REDUCTIONS, "mean", "rescued")
    rescued = launch(kernel, x.reshape(n, k, 1), idx, rescue, threads, out, weights,
                     jnp.zeros(shape, x.dtype), dims=(threads, k), in_out=("out",))
    kernel = pick(kernels.REDUCTIONS, "mean", "of_sums")
    return launch(kernel, out, counts, ordered, rescued, dims=shape, out=shape)


mean_p = _multilinear(_Rule(
    "mean", _mean, lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 1,
    transposes=(lambda ct, seg, p: gather_p.bind(
        ct / jnp.maximum(count(*seg, **p), 1).astype(ct.dtype)[:, None], *seg, **p),)))
"""Σ x[i] / count over each segment of x (N, K): the sum divided by the count (rounded once),
or where that sum is not finite Σ x[i] · (1/count) (no partial sum exceeds the largest
|x[i]|); 0 for an empty segment."""


gather_p = _multilinear(_Rule(
    "gather", _gather, lambda y, idx, offsets, **_: (idx.shape[0], y.shape[1]), 1,
    transposes=(lambda ct, seg, p: sum_p.bind(ct, *seg, **p),)))


def _dot(x, y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False, w=None):
    shape = (num_segments, x.shape[1])
    if _empty(shape, x, y):
        return jnp.zeros(shape, x.dtype)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    # the rows' products summed by lanes per segment (ordered ids), else by atomics
    factors = jnp.zeros((0, x.shape[1]), x.dtype) if w is None else w
    lanes, dims = lane_grid(shape[0] * shape[1], gpu)
    kernel = pick(kernels.REDUCTIONS, "dot", "span")
    out = launch(kernel, x, x.reshape(-1), y.reshape(-1), factors, *layout, lanes,
                 dims=dims, out=shape)
    if known_sorted:
        return out
    threads = stride(gpu, idx.shape[0])
    kernel = pick(kernels.REDUCTIONS, "dot", "atomic")
    return launch(kernel, x, y, factors, idx, layout[1], threads, out,
                  dims=(threads, shape[1]), in_out=("out",))


dot_p = _multilinear(_Rule(
    "dot", _dot, lambda x, y, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 2,
    transposes=(lambda ct, y, seg, p: scale_p.bind(y, ct, *seg, **p),
                lambda ct, x, seg, p: scale_p.bind(x, ct, *seg, **p))))


def _scale(x, y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    return _rescale(x, y, jnp.zeros((0, *y.shape[1:]), y.dtype), idx, offsets, gpu=gpu)


def _rescale(x, y, z, idx, offsets, *, gpu=False, **_):
    return _scaled_rows("scale", x, y, z, x[:0], y[:0], idx, offsets, gpu)


def _rescale2(x, b, y, z, w, idx, offsets, *, gpu=False, **_):
    return _scaled_rows("scale_pair", x, y, z, b, w, idx, offsets, gpu)


def _scaled_rows(op, x, y, z, b, w, idx, offsets, gpu):
    """x[i] · y[s] · z[s] (z empty: 1) by GATHERS' "scale", or that + b[i] · y[s] · w[s] by
    "scale_pair" (each as its vec3 variant for rows of 3 floats, see _rows3)."""
    if _empty(x.shape, x, y):
        return jnp.zeros(x.shape, x.dtype)
    if _is_float_vec3(x):
        def vec3(a):
            return a.reshape(a.shape[0], 3)

        return _rows3(op, vec3(x), y, z, vec3(b), w, idx, offsets, idx=idx,
                      offsets=offsets, segments=y.shape[0], gpu=gpu).reshape(x.shape)
    kernel = pick(kernels.GATHERS, op)
    return launch(kernel, x, y, z, b, w, idx, dims=(idx.shape[0],), out=x.shape)


scale_p = _multilinear(_Rule(
    "scale", _scale, lambda x, y, idx, offsets, **_: x.shape, 2,
    transposes=(lambda ct, y, seg, p: scale_p.bind(ct, y, *seg, **p),
                lambda ct, x, seg, p: dot_p.bind(ct, x, *seg, **p))))


rescale_p = _multilinear(_Rule(
    "rescale", _rescale, lambda x, y, z, idx, offsets, **_: x.shape, 3,
    transposes=(lambda ct, y, z, seg, p: rescale_p.bind(ct, y, z, *seg, **p),
                lambda ct, x, z, seg, p: scaled_dot_p.bind(x, ct, z, *seg, **p),
                lambda ct, x, y, seg, p: scaled_dot_p.bind(x, ct, y, *seg, **p))))
"""(x[i] · y[s]) · z[s] over the rows i of each segment s, by one kernel: x scaled by two
factors of its segment, such as a power of two near 1/|x| and a cotangent, whose product
alone could underflow where this does not."""


rescale2_p = _multilinear(_Rule(
    "rescale2", _rescale2, lambda x, b, y, z, w, idx, offsets, **_: x.shape, 5,
    slots=((0, 1), (2,), (3, 4)),
    transposes=(lambda ct, b, y, z, w, seg, p: rescale_p.bind(ct, y, z, *seg, **p),
                lambda ct, x, y, z, w, seg, p: rescale_p.bind(ct, y, w, *seg, **p),
                lambda ct, x, b, z, w, seg, p: (scaled_dot_p.bind(x, ct, z, *seg, **p)
                                                + scaled_dot_p.bind(b, ct, w, *seg, **p)),
                lambda ct, x, b, y, w, seg, p: scaled_dot_p.bind(x, ct, y, *seg, **p),
                lambda ct, x, b, y, z, seg, p: scaled_dot_p.bind(b, ct, y, *seg, **p))))
"""(x[i] · y[s]) · z[s] + (b[i] · y[s]) · w[s]: two rescales of a segment's rows that share a
factor, added by the one kernel (a sum of two products: linear in (x, b), in y and in (z, w))."""


def _scaled_dot(x, y, w, idx, offsets, **params):
    return _dot(x, y, idx, offsets, w=w, **params)


scaled_dot_p = _multilinear(_Rule(
    "scaled_dot", _scaled_dot,
    lambda x, y, w, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 3,
    transposes=(lambda ct, y, w, seg, p: rescale_p.bind(y, w, ct, *seg, **p),
                lambda ct, x, w, seg, p: rescale_p.bind(x, w, ct, *seg, **p),
                lambda ct, x, y, seg, p: ct * dot_p.bind(x, y, *seg, **p))))
"""Σ <x[i] · w[s], y[i]> over each segment s (x, y (N, G, K), w (M, G)): a dot of rows scaled
per segment, such as by a power of two near 1/|x| so that nothing overflows. Its transpose for
x or y is one rescale kernel, where that of a dot of scaled rows would scale them first."""


def _matvec(v, m, idx, offsets, *, num_segments, indices_are_sorted, transpose, gpu=False):
    if _empty(v.shape, v, m):
        return jnp.zeros(v.shape, v.dtype)
    if _is_float_vec3(v) and m.shape[1:] == (1, 3, 3):
        return _rows3("matvec", v.reshape(-1, 3), m.reshape(-1, 3, 3), idx, offsets,
                      int(transpose), idx=idx, offsets=offsets, segments=m.shape[0],
                      gpu=gpu).reshape(v.shape)
    kernel = pick(kernels.GATHERS, "matvec")
    return launch(kernel, v, m, idx, int(transpose), dims=(idx.shape[0],), out=v.shape)


matvec_p = _multilinear(_Rule(
    "matvec", _matvec, lambda v, m, idx, offsets, **_: v.shape, 2,  # square matrices
    transposes=(
        lambda ct, m, seg, p: matvec_p.bind(ct, m, *seg, **{**p, "transpose": not p["transpose"]}),
        lambda ct, v, seg, p: outer_p.bind(*((ct, v) if p["transpose"] else (v, ct)), *seg,
                                           **_segments(p)))))


def _outer(a, b, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    (n, groups, k), l = a.shape, b.shape[2]  # noqa: E741  (a is (N, G, K), b is (N, G, L))
    shape = (num_segments, groups, k, l)
    if _empty(shape, a, b):
        return jnp.zeros(shape, a.dtype)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    kernel = pick(kernels.REDUCTIONS, "outer")
    out = _reduce(kernel, a.reshape(n, groups * k), b.reshape(n, groups * l), idx, layout,
                  (num_segments, groups * k * l), a.dtype, gpu,
                  ids_known_sorted(offsets, indices_are_sorted))
    return out.reshape(shape)


outer_p = _multilinear(_Rule(
    "outer", _outer,
    lambda a, b, idx, offsets, *, num_segments, **_: (num_segments, *a.shape[1:], b.shape[2]), 2,
    transposes=(lambda ct, b, seg, p: matvec_p.bind(b, ct, *seg, **p, transpose=True),
                lambda ct, a, seg, p: matvec_p.bind(a, ct, *seg, **p, transpose=False))))


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
segcli.ops._norm_terms takes them), in one pass over g and rows: the JVP of
rms_norm_cotangent along (rows, dc), and for dc = 0 its transpose for the rows. No derivative
rule of its own (segcli.ops gives it one)."""


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


def scaled_norms(rows):
    """|rows[s]| of rows (M, K), each row scaled by a power of two near its largest entry (so
    no square overflows or underflows)."""
    scale, inverse = power_of_two(jnp.max(jnp.abs(rows), axis=1, initial=0))
    scaled = rows * inverse[:, None]
    return scale * jnp.sqrt(jnp.sum(scaled * scaled, axis=1))


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


def _launch_two_passes(table, op, start, found, x, idx, offsets, num_segments,
                       indices_are_sorted, gpu):
    """(M, K, 2) of x (N, K) by `table`'s kernel for `op` (see kernels._common._two_passes):
    where the ids are ordered, both passes over each segment in one thread; where the ids are
    not known sorted, also its "atomic" step (the first's output filled with `start` before),
    and `found`(first, second) where the order is not found at run time."""
    shape = (num_segments, x.shape[1], 2)
    if _empty(shape, x):
        return jnp.zeros(shape, x.dtype)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    offsets, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    threads = stride(gpu, idx.shape[0])
    dims = (_segment_threads(num_segments, threads, known_sorted), x.shape[1])
    kernel, after = pick(table, op, device=_device(gpu)), pick(table, op, "atomic")
    if known_sorted:  # (ids not passed, so that XLA drops their making)
        return launch(kernel, x, idx[:0], offsets, ordered, threads, dims=dims, out=shape)
    first = launch(kernel, x, idx, offsets, ordered, threads, jnp.full(shape, start, x.dtype),
                   dims=dims, in_out=("out",))
    second = launch(after, x, first, idx, ordered, threads, jnp.zeros(shape[:2], x.dtype),
                    dims=dims, in_out=("out",))
    return jnp.where(ordered[0] != 0, first, found(first, second))


def _moments(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    def found(sums, squares):  # (Σ x, count) and Σ (x - mean)²
        counts = jnp.maximum(sums[..., 1], 1)
        return jnp.stack([sums[..., 0] / counts, squares / counts], axis=-1)

    return _launch_two_passes(kernels.MOMENTS, "moments", 0, found, x, idx, offsets,
                              num_segments, indices_are_sorted, gpu)


moments_p = _register(_Rule(
    "moments", _moments,
    lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1], 2), 1,
    batch_first=True))
"""(mean, Σ (x[i] - mean)² / count) (M, K, 2) over each segment of x (N, K), (0, 0) for an
empty one: where the ids are ordered, both passes of the variance in one kernel, in index
order (the same bits whether the order is promised or found); otherwise atomic sums and
counts, then the squares about their means. No derivative rule of its own (segcli.ops gives
it one)."""


def _by_segment_groups(kernel, operands, dims, shape, formula, idx, offsets, num_segments,
                        indices_are_sorted, gpu):
    """Kernel `kernel` (a group of lane_grid threads per segment and feature, given their
    number) over `operands`, `dims` groups, into `shape`, on GPUs where the ids are ordered (see
    _ordered_or); formula() elsewhere, and where an operand or the result has no entries. On an
    H100 these kernels beat XLA's fusions around a reduction's kernels (_deviations; softmax's
    exp_sums and sums) at N = 10⁴–10⁵, where a call waits on its launches, and, their rows read
    by lanes side by side, at 10⁷ in float32 too (softmax's second derivative 656 against 1168
    µs); on CPUs those fusions are faster (benchmarks/RESULTS.md)."""
    if not gpu or _empty(shape, *operands):
        return formula()
    lanes, flat = lane_grid(math.prod(dims), gpu)
    return _ordered_or(kernel, operands, flat, shape, formula, idx, offsets, num_segments,
                       indices_are_sorted, gpu, (lanes,))


def _deviations(x, idx, offsets, num_segments, indices_are_sorted, gpu):
    """(x[i] - mean of its segment, 0 in rows of no segment; 2 / count (M, 1), empty segments
    counted as 1) of x (N, K): the mean's kernel, then XLA's gather, which it fuses into the
    work that uses the rows. var's derivatives by them, not by variance_tangent's kernels, on
    CPUs: 1.6–3 times as fast there at 2 Mi rows (benchmarks/RESULTS.md)."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted, "gpu": gpu}
    mean = _mean(x, idx, offsets, **params)
    counts = jnp.maximum(_count(idx, offsets, **params), 1).astype(x.dtype)[:, None]
    return _in_rows(x - at_rows(mean, idx), idx, num_segments), 2 / counts


def _variance_tangent(x, y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (num_segments, x.shape[1])

    def formula():
        deviations, twice_inverse = _deviations(x, idx, offsets, num_segments,
                                                indices_are_sorted, gpu)
        return _sum(deviations * y, idx, offsets, num_segments=num_segments,
                    indices_are_sorted=indices_are_sorted, gpu=gpu) * twice_inverse

    kernel = pick(kernels.MOMENTS, "var", "tangent")
    return _by_segment_groups(kernel, (x, y, y), shape, shape, formula, idx,
                               offsets, num_segments, indices_are_sorted, gpu)


def _variance_cotangent(x, c, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):

    def formula():
        deviations, twice_inverse = _deviations(x, idx, offsets, num_segments,
                                                indices_are_sorted, gpu)
        return deviations * at_rows(c * twice_inverse, idx)

    kernel = pick(kernels.MOMENTS, "var", "cotangent")
    return _by_segment_groups(kernel, (x, c, c), (num_segments + 1, x.shape[1]),
                               x.shape, formula, idx, offsets, num_segments,
                               indices_are_sorted, gpu)


variance_tangent_p = _multilinear(_Rule(
    "variance_tangent", _variance_tangent,
    lambda x, y, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 2,
    transposes=(lambda ct, y, seg, p: variance_cotangent_p.bind(y, ct, *seg, **p),
                lambda ct, x, seg, p: variance_cotangent_p.bind(x, ct, *seg, **p))))
"""2 Σ (x[i] - mean) y[i] / count over each segment of x and y (N, K), the mean x's: var's
tangent at x along y, symmetric in x and y; 0 for an empty segment. On GPUs, where the ids
are ordered, one kernel (the mean as moments takes it, then the sum); elsewhere the mean's
kernel, XLA's fused gather and a sum (see _deviations)."""


variance_cotangent_p = _multilinear(_Rule(
    "variance_cotangent", _variance_cotangent, lambda x, c, idx, offsets, **_: x.shape, 2,
    transposes=(lambda ct, c, seg, p: variance_cotangent_p.bind(ct, c, *seg, **p),
                lambda ct, x, seg, p: variance_tangent_p.bind(x, ct, *seg, **p))))
"""(x[i] - mean) · 2 c[s] / count over the rows i of each segment s of x (N, K), for c (M, K):
var's cotangent at x (variance_tangent's transpose along y), 0 in rows of no segment. On GPUs,
where the ids are ordered, one kernel (a thread per segment and feature: the mean, then the
rows); elsewhere the mean's kernel and XLA's fused gathers (see _deviations)."""


def _std_parts(x, idx, offsets, params, fused):
    """(mean, x - mean (N, K), 0 in rows of no segment, 1 / (count · std), 1 / var) of x
    (N, K), the two scales (M, K) 0 where var is 0 (and so each of their derivatives, never
    NaN), and gather(*values): (M, K) values taken to the rows, several in one gather. The
    mean and variance by moments_p and the gathers by XLA (fused into the work that uses the
    rows) if `fused` (in an impl, where no derivative rule is needed), else by mean_p and
    gather_p (differentiable)."""
    if fused:
        def gather(*values):
            rows = at_rows(jnp.stack(values, axis=-1), idx)
            return tuple(rows[..., j] for j in range(len(values)))

        mean, var = jnp.moveaxis(moments_p.bind(x, idx, offsets, **params), -1, 0)
    else:
        def gather(*values):
            rows = gather_p.bind(jnp.concatenate(values, axis=1), idx, offsets, **params)
            return tuple(jnp.split(rows, len(values), axis=1))

        mean = mean_p.bind(x, idx, offsets, **params)
    deviations = _in_rows(x - gather(mean)[0], idx, params["num_segments"])
    if not fused:
        var = mean_p.bind(deviations * deviations, idx, offsets, **params)
    counts = jnp.maximum(count(idx, offsets, **params), 1).astype(x.dtype)[:, None]
    zero = var == 0
    var = jnp.where(zero, 1, var)
    return (mean, deviations, jnp.where(zero, 0, 1 / (counts * jnp.sqrt(var))),
            jnp.where(zero, 0, 1 / var), gather)


def _std_tangent(x, y, idx, offsets, fused=False, **params):
    """Σ (x[i] - mean) y[i] / (count · std) over each segment of x and y (N, K): std's tangent
    at x along y (M, K), linear in y; 0 where std is 0."""
    _, deviations, scale, _, _ = _std_parts(x, idx, offsets, params, fused)
    return sum_p.bind(deviations * y, idx, offsets, **params) * scale


def _std_cotangent(x, c, idx, offsets, fused=False, **params):
    """(x[i] - mean) c[s] / (count · std) over the rows i of each segment s of x (N, K), for c
    (M, K): std's cotangent at x, _std_tangent's transpose along y; 0 where std is 0 and in rows
    of no segment. The mean is gathered with its weight, in one gather (faster on CPUs than
    the deviations' own gather and a second)."""
    mean, _, scale, _, gather = _std_parts(x, idx, offsets, params, fused)
    centre, weight = gather(mean, scale * c)
    return _in_rows((x - centre) * weight, idx, params["num_segments"])


def _std_curvature(x, a, c, idx, offsets, fused=False, **params):
    """c[s] ((a[i] - mean a) - d[i] Σ d a / (count · var)) / (count · std) over the rows i of
    each segment s, d = x - mean: std's second derivative along a weighted by c (N, K), the
    JVP in x along a of _std_cotangent; bilinear, and its own transpose in a (a Hessian); 0
    where std is 0 and in rows of no segment."""
    _, deviations, scale, inverse_var, gather = _std_parts(x, idx, offsets, params, fused)
    k = x.shape[1]
    means = mean_p.bind(jnp.concatenate([a, deviations * a], axis=1), idx, offsets, **params)
    weight, mean_a, ratio = gather(scale * c, means[:, :k], means[:, k:] * inverse_var)
    return _in_rows(weight * (a - mean_a - deviations * ratio), idx, params["num_segments"])


def _std_impl(kernel, formula, rows):
    """The impl of formula (x, a[, b]): on GPUs, where the ids are ordered, kernel `kernel` (a
    group of lanes per segment and feature: the mean, the variance, then the sum or the rows;
    see _by_segment_groups), into x's shape if `rows` else (M, K); elsewhere formula's
    moments_p and XLA's fused gathers."""

    def impl(x, *operands, num_segments, indices_are_sorted, gpu=False):
        *floats, idx, offsets = operands
        params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}
        shape = x.shape if rows else (num_segments, x.shape[1])
        return _by_segment_groups(
            kernel, (x, floats[0], floats[-1]), (num_segments + rows, x.shape[1]), shape,
            lambda: formula(x, *floats, idx, offsets, fused=True, **params), idx, offsets,
            gpu=gpu, **params)

    return impl


std_tangent_p = custom_transposed(
    "std_tangent", _std_tangent, linear=(1,),
    like=lambda x, y, idx, offsets, *, num_segments, **_: x.update(shape=(num_segments,
                                                                           x.shape[1])),
    transpose=lambda ct, x, y, idx, offsets, **params: [
        None, std_cotangent_p.bind(x, ct, idx, offsets, **params), None, None],
    impl=_std_impl(pick(kernels.MOMENTS, "std", "tangent"), _std_tangent, rows=False))
"""std's tangent map along y (see _std_tangent), transposed into std_cotangent; its JVP in x
differentiates _std_tangent."""


std_cotangent_p = custom_transposed(
    "std_cotangent", _std_cotangent, linear=(1,), like=0,
    transpose=lambda ct, x, c, idx, offsets, **params: [
        None, std_tangent_p.bind(x, ct, idx, offsets, **params), None, None],
    impl=_std_impl(pick(kernels.MOMENTS, "std", "cotangent"), _std_cotangent, rows=True),
    moving_jvp=lambda primals, tangents, **params: std_curvature_p.bind(
        primals[0], ad.instantiate_zeros(tangents[0]), *primals[1:], **params))
"""std's cotangent at x (see _std_cotangent), transposed into std_tangent; its JVP in x is
std_curvature."""


def _std_curvature_transpose(ct, x, a, c, idx, offsets, **params):
    if ad.is_undefined_primal(a):
        return [None, std_curvature_p.bind(x, ct, c, idx, offsets, **params), None, None, None]
    ones = jnp.ones(c.aval.shape, c.aval.dtype)  # linear in c: c[s] times its weight-1 rows
    return [None, None, sum_p.bind(ct * std_curvature_p.bind(x, a, ones, idx, offsets, **params),
                                   idx, offsets, **params), None, None]


std_curvature_p = custom_transposed(
    "std_curvature", _std_curvature, linear=(1, 2), like=0, multilinear=True,
    transpose=_std_curvature_transpose,
    impl=_std_impl(pick(kernels.MOMENTS, "std", "curvature"), _std_curvature, rows=True))
"""std's weighted second derivative (see _std_curvature), bilinear; its JVP in x
differentiates _std_curvature."""


def _exp_sums(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    def found(tops, totals):  # the largest values and Σ exp(x - shift)
        return jnp.stack([jnp.where(jnp.isfinite(tops[..., 0]), tops[..., 0], 0), totals],
                         axis=-1)

    return _launch_two_passes(kernels.SOFTMAX, "exp_sums", -jnp.inf, found, x, idx,
                              offsets, num_segments, indices_are_sorted, gpu)


exp_sums_p = _register(_Rule(
    "exp_sums", _exp_sums,
    lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1], 2), 1,
    batch_first=True))
"""(shift, Σ exp(x[i] - shift)) (M, K, 2) over each segment of x (N, K), shift its largest
value where finite, else 0; (0, 0) for an empty one: where the ids are ordered, both passes
in one kernel, in index order (the same bits whether the order is promised or found);
otherwise the largest values by atomic max, then the sums. No derivative rule of its own
(segcli.ops gives logsumexp and softmax theirs)."""


def _by_rows3(kernel, operands, formula, x, idx, offsets, num_segments, indices_are_sorted,
              gpu):
    """formula(), an (N, K) result of x (N, K); or on CPUs, for rows of 3 where the ids are
    ordered, kernel `kernel` over operands (x, dx; see kernels.softmax._rows3_or_zeros), the
    same bits whether the order is promised or found."""
    if gpu or x.shape[1] != 3 or _empty(x.shape, x):
        return formula()
    return _ordered_or(kernel, operands, (num_segments + 1,), x.shape, formula, idx, offsets,
                       num_segments, indices_are_sorted, gpu)


def _ordered_or(kernel, operands, dims, shape, formula, idx, offsets, num_segments,
                indices_are_sorted, gpu, trailing=()):
    """Kernel `kernel` over `operands`, the layout and `trailing`, `dims` threads, into
    `shape`, where the ids are ordered; formula() where they are not known sorted and not found
    ordered at run time: the same bits whether the order is promised or found."""
    layout, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    found = launch(kernel, *operands, layout, ordered, *trailing, dims=dims, out=shape)
    if ids_known_sorted(offsets, indices_are_sorted):
        return found
    return jnp.where(ordered[0] != 0, found, formula())


def _softmax(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}

    def gathered():
        if _empty(x.shape, x):
            return jnp.zeros(x.shape, x.dtype)
        exps, totals = _exp_terms(x, idx, offsets, params)
        some = totals != 0  # (NaN stays NaN)
        return jnp.where(some, exps / jnp.where(some, totals, 1), 0)

    kernel = pick(kernels.SOFTMAX, "softmax", device="cpu", size=3)
    return _by_rows3(kernel, (x, x), gathered, x, idx, offsets, gpu=gpu, **params)


def _exp_terms(x, idx, offsets, params):
    """(exp(x[i] - shift), Σ of its segment) per row of x (N, K), each segment's shift and sum
    (exp_sums_p) taken to its rows by an XLA gather; 0 and 0 for rows whose id is out of
    range."""
    at = at_rows(exp_sums_p.bind(x, idx, offsets, **params), idx)
    return _in_rows(jnp.exp(x - at[..., 0]), idx, params["num_segments"]), at[..., 1]


softmax_p = _register(_Rule(
    "softmax", _softmax, lambda x, idx, offsets, **_: x.shape, 1, batch_first=True))
"""exp(x[i] - shift) / Σ of its segment per row of x (N, K) (see exp_sums_p), 0 where that
sum is 0 or the id out of range: on CPUs, rows of 3 with ordered ids, by one kernel
(softmax3: a thread per segment writing its rows; the same bits whether the order is
promised or found); elsewhere exp_sums_p's shifts and sums gathered to the rows by XLA. Its
JVP is softmax_tangent_p (below)."""


def _softmax_tangent(x, dx, idx, offsets, **params):
    """s (dx - Σ s dx) over each segment, s = softmax(x): softmax's tangent along dx (N, K),
    linear in dx, whose Jacobian is symmetric (its own transpose)."""
    s = softmax_p.bind(x, idx, offsets, **params)
    return s * (dx - gather_p.bind(sum_p.bind(s * dx, idx, offsets, **params), idx, offsets,
                                   **params))


def _softmax_tangent_rows(x, dx, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    """_softmax_tangent where the ids are ordered by one kernel: on CPUs for rows of 3
    (softmax3_tangent: all in each segment's rows), on GPUs by softmax_tangent (a group of
    lanes per segment and feature, see _by_segment_groups)."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}

    def formula():
        return _softmax_tangent(x, dx, idx, offsets, **params)

    if not gpu:
        kernel = pick(kernels.SOFTMAX, "softmax", "tangent", device="cpu", size=3)
        return _by_rows3(kernel, (x, dx), formula, x, idx, offsets, gpu=gpu, **params)
    kernel = pick(kernels.SOFTMAX, "softmax", "tangent")
    return _by_segment_groups(kernel, (x, dx, dx), (num_segments + 1, x.shape[1]),
                               x.shape, formula, idx, offsets, gpu=gpu, **params)


softmax_tangent_p = custom_transposed(
    "softmax_tangent", _softmax_tangent, linear=(1,), like=1,
    transpose=lambda ct, x, dx, idx, offsets, **params: [
        None, softmax_tangent_p.bind(x, ct, idx, offsets, **params), None, None],
    impl=_softmax_tangent_rows,
    moving_jvp=lambda primals, tangents, **params: softmax_curvature_p.bind(
        primals[0], primals[1], ad.instantiate_zeros(tangents[0]), *primals[2:], **params))
"""softmax's tangent map along dx (see _softmax_tangent), transposed into itself; its JVP in x
is softmax_curvature."""


def _softmax_curvature(x, a, b, idx, offsets, **params):
    """s (q - Σ s q) over each segment, q = (a - Σ s a)(b - Σ s b), s = softmax(x): softmax's
    second derivative along a and b (N, K), the JVP in x along b of its tangent along a;
    symmetric bilinear in a and b, and its own transpose in each."""
    s = softmax_p.bind(x, idx, offsets, **params)

    def centred(y):
        return y - gather_p.bind(sum_p.bind(s * y, idx, offsets, **params), idx, offsets,
                                 **params)

    return softmax_tangent_p.bind(x, centred(a) * centred(b), idx, offsets, **params)


def _softmax_curvature_rows(x, a, b, idx, offsets, *, num_segments, indices_are_sorted,
                            gpu=False):
    """_softmax_curvature, on GPUs where the ids are ordered by one kernel (softmax_curvature:
    a group of lanes per segment and feature, see _by_segment_groups)."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}

    def formula():
        return _softmax_curvature(x, a, b, idx, offsets, **params)

    kernel = pick(kernels.SOFTMAX, "softmax", "curvature")
    return _by_segment_groups(kernel, (x, a, b), (num_segments + 1, x.shape[1]),
                               x.shape, formula, idx, offsets, gpu=gpu, **params)


def _softmax_curvature_transpose(ct, x, a, b, idx, offsets, **params):
    if ad.is_undefined_primal(a):
        return [None, softmax_curvature_p.bind(x, ct, b, idx, offsets, **params), None, None,
                None]
    return [None, None, softmax_curvature_p.bind(x, a, ct, idx, offsets, **params), None, None]


softmax_curvature_p = custom_transposed(
    "softmax_curvature", _softmax_curvature, linear=(1, 2), like=1, multilinear=True,
    transpose=_softmax_curvature_transpose, impl=_softmax_curvature_rows)
"""softmax's second derivative along a and b (see _softmax_curvature), bilinear, transposed
into itself; its JVP in x differentiates _softmax_curvature."""


def _softmax_jvp(primals, tangents, **params):
    x, idx, offsets = primals
    return (softmax_p.bind(x, idx, offsets, **params),
            softmax_tangent_p.bind(x, ad.instantiate_zeros(tangents[0]), idx, offsets, **params))


ad.primitive_jvps[softmax_p] = _softmax_jvp


def _count(idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    if idx.shape[0] == 0 or num_segments == 0:
        return jnp.zeros((num_segments,), jnp.int32)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    layout = _layout(idx, offsets, num_segments, known_sorted, gpu)
    return _row_counts(idx, layout, known_sorted, gpu)


count_p = _integral(_Rule("count", _count,
                          lambda idx, offsets, *, num_segments, **_: (num_segments,),
                          dtype=jnp.int32))


def count(idx, offsets, num_segments, indices_are_sorted):
    """Ids per segment, int32 (not differentiable)."""
    return count_p.bind(idx, offsets, num_segments=num_segments,
                        indices_are_sorted=bool(indices_are_sorted))


def _bincount(labels, idx, offsets, *, num_segments, indices_are_sorted, length, gpu=False):
    shape = (num_segments, length)
    if _empty(shape, labels):
        return jnp.zeros(shape, jnp.int32)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    offsets, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    # on GPUs a warp per segment zeroes its row and adds its rows; with one lane (CPUs) a
    # thread per segment adds them into zeros (faster there than zeroing its row)
    lanes, dims = lane_grid(num_segments, gpu, BINCOUNT_LANES)
    args = (pick(kernels.REDUCTIONS, "bincount"), labels, offsets, ordered, lanes)
    out = (launch(*args, dims=dims, out=shape, dtype=labels.dtype) if lanes > 1 else
           launch(*args, jnp.zeros(shape, jnp.int32), dims=dims, in_out=("out",),
                  dtype=labels.dtype))
    if known_sorted:
        return out
    threads = stride(gpu, idx.shape[0])
    kernel = pick(kernels.REDUCTIONS, "bincount", "atomic")
    return launch(kernel, labels, idx, ordered, threads, out, dims=(threads,),
                  in_out=("out",), dtype=labels.dtype)


bincount_p = _integral(_Rule(
    "bincount", _bincount,
    lambda labels, idx, offsets, *, num_segments, length, **_: (num_segments, length),
    dtype=jnp.int32))
"""Rows per segment with each label in [0, length) of int32 or int64 labels (N,): (M, length)
int32."""


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
