"""What the segment primitives share: the layout of the ids (offsets, whether known sorted),
kernel launches over segments or rows of 3, the table of rules (`_Rule`) and the registration
of a primitive with its impl, lowering, JVP, transposes and batching, and the impls of sum, mean
and count that other families build on."""

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from segcli.ops import kernels
from segcli.ops.kernels import (
    ANY,
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


def _count(idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    if idx.shape[0] == 0 or num_segments == 0:
        return jnp.zeros((num_segments,), jnp.int32)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    layout = _layout(idx, offsets, num_segments, known_sorted, gpu)
    return _row_counts(idx, layout, known_sorted, gpu)
