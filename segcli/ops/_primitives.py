"""JAX primitives over the Warp kernels, with one table of differentiation rules.

Every primitive is linear or bilinear in its float operands, so its JVP is the sum of the
primitive applied with one operand replaced by its tangent, and its transpose with respect
to each operand is another primitive of the set:

    sum(x)         x ↦ gather(ct)                     (segment sum ↔ broadcast back)
    gather(y)      y ↦ sum(ct)
    dot(x, y)      x ↦ scale(y, ct)      y ↦ scale(x, ct)
    scale(x, y)    x ↦ scale(ct, y)      y ↦ dot(ct, x)
    matvec(v, m)   v ↦ matvecᵀ(ct, m)    m ↦ outer(v, ct)   (matvec: v @ m per row; matvecᵀ: v @ mᵀ)
    matvecᵀ(v, m)  v ↦ matvec(ct, m)     m ↦ outer(ct, v)
    outer(a, b)    a ↦ matvecᵀ(b, ct)    b ↦ matvec(a, ct)

JAX derives every higher derivative, forward or reverse, from these rules. Two more
primitives have no derivative of their own: `max_norm` (the largest squared norm per segment
and the first row attaining it, piecewise constant in x) and `count`. Batching folds a
vmapped axis into axis 1 of every float operand (the feature or group axis), which keeps the
segment ids and their order; vmapped ids fall back to a loop over the batch.

Operands are float arrays followed by int32 ids and int32 offsets: the segments' CSR
offsets (M+1,) when the caller has them (the ids then non-decreasing), else an empty array and
the reductions find them; parameters are `num_segments` (the length of the segment axis) and
`indices_are_sorted`, and for matvec `transpose` (matvecᵀ above).
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from segcli.ops._kernels import launch, stride


def _layout(idx, offsets, num_segments, indices_are_sorted, gpu):
    """CSR offsets of the ids (`offsets` if given) and a one-element flag saying whether they
    are non-decreasing."""
    if offsets.shape[0]:
        return offsets, jnp.ones((1,), jnp.int32)
    kernel, threads = ("layout", num_segments + 1) if gpu else ("layout_serial", 1)
    offsets = launch(kernel, idx, dims=(threads,), out=(num_segments + 1,))
    if indices_are_sorted or idx.shape[0] < 2:
        return offsets, jnp.ones((1,), jnp.int32)
    return offsets, jnp.all(idx[1:] >= idx[:-1]).astype(jnp.int32).reshape(1)


def _reduce(name, floats, idx, offsets, zeros, grid, num_segments, indices_are_sorted, gpu):
    """A reduction kernel into `zeros`, over max(M, stride) rows × `grid` threads: ordered ids
    a segment per row, else atomics."""
    offsets, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    threads = stride(gpu, idx.shape[0])
    dims = (max(num_segments, threads), *grid)
    return launch(name, *floats, idx, offsets, ordered, threads, zeros, dims=dims, in_out=("out",))


def _impl(name):
    """The impl of primitive `name`: zeros for empty inputs, else its kernel(s)."""

    def impl(*operands, num_segments, indices_are_sorted, gpu=False, transpose=False):
        *floats, idx, offsets = operands
        shape, dtype = _output_shape(name, floats, idx, num_segments), floats[0].dtype
        if name == "max_norm":
            return _max_norm(floats[0], idx, offsets, shape, num_segments, indices_are_sorted,
                             gpu)
        if 0 in shape or any(0 in f.shape for f in floats):
            return jnp.zeros(shape, dtype)
        ordering = (num_segments, indices_are_sorted, gpu)
        if name in ("sum", "dot") and not gpu and _is_vec3(name, floats):
            vectors = [f.reshape(f.shape[0], 3) for f in floats]
            zeros = jnp.zeros((num_segments, 3) if name == "sum" else (num_segments,), dtype)
            return _reduce(name + "3", vectors, idx, offsets, zeros, (), *ordering).reshape(shape)
        if name == "dot":  # products per row, then their segment sums
            rows = launch("row_dot", *floats, dims=(idx.shape[0],), out=floats[0].shape[:2])
            return _reduce("sum", [rows], idx, offsets, jnp.zeros(shape, dtype), shape[1:],
                           *ordering)
        if name in _REDUCTIONS:
            return _reduce(name, floats, idx, offsets, jnp.zeros(shape, dtype), shape[1:],
                           *ordering)
        scalars = (int(transpose),) if name == "matvec" else ()
        if _is_vec3(name, floats):
            # drop the group axis of 1 (gather has none): rows of vectors, scalars or matrices
            flat = floats if name == "gather" else [f.reshape(f.shape[0], *f.shape[2:]) for f in floats]
            out = launch(name + "3", *flat, idx, *scalars, dims=(idx.shape[0],), out=(idx.shape[0],))
            return out.reshape(shape)
        return launch(name, *floats, idx, *scalars, dims=(idx.shape[0],), out=shape)

    return impl


def _max_norm(x, idx, offsets, shapes, num_segments, indices_are_sorted, gpu):
    (shape, _), n = shapes, x.shape[0]
    if 0 in x.shape or num_segments == 0:
        return [jnp.zeros(shape, x.dtype), jnp.full(shape, n, jnp.int32)]
    given = offsets.shape[0] > 0
    offsets, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    threads = stride(gpu, n)
    groups = shape[1]
    # Ordered ids: one pass per segment. Otherwise: atomic max of the key, atomic min of
    # the first row attaining it, then that row's norm. Each kernel returns at once when
    # the flag says the other path applies; promised-sorted ids skip the other path.
    best, first = launch(
        "max_norm_ordered",
        x,
        offsets,
        ordered,
        jnp.full(shape, -1, x.dtype),
        jnp.full(shape, n, jnp.int32),
        dims=shape,
        in_out=("best", "first"),
    )
    if indices_are_sorted or given:
        return [best, first]
    best = launch("max_key", x, idx, ordered, threads, best, dims=(threads, groups), in_out=("best",))
    first = launch("first_attaining", x, idx, ordered, threads, best, first, dims=(threads, groups), in_out=("first",))
    best = launch("norm_of_first", x, ordered, first, best, dims=shape, in_out=("best",))
    return [best, first]


_REDUCTIONS = ("sum", "outer")


def _is_vec3(name, floats):
    """Whether a primitive has one group of 3 features (and 3x3 matrices): the vec3 kernels'
    case (for sum and dot, used on CPUs only)."""
    if name in ("gather", "sum"):
        return floats[0].shape[1:] == (3,)
    return floats[0].shape[1:] == (1, 3) and (name != "matvec" or floats[1].shape[1:] == (1, 3, 3))


# Output shape(s) of each primitive from its float operands' shapes s, M and the ids' length n.
_SHAPES = {
    "sum": lambda s, m, n: (m, s[0][1]),
    "dot": lambda s, m, n: (m, s[0][1]),
    "outer": lambda s, m, n: (m, s[0][1], s[0][2], s[1][2]),
    "max_norm": lambda s, m, n: [(m, s[0][1]), (m, s[0][1])],
    "gather": lambda s, m, n: (n, s[0][1]),
    "scale": lambda s, m, n: s[0],
    "matvec": lambda s, m, n: s[0],  # square matrices
    "count": lambda s, m, n: (m,),
}


def _output_shape(name, floats, idx, num_segments):
    return _SHAPES[name]([tuple(f.shape) for f in floats], num_segments, idx.shape[0])


@dataclass(frozen=True)
class _Rule:
    """A primitive over `arity` float operands and the ids; `transposes[j]` (if linear) maps a
    cotangent, the other float operands, the ids and the parameters to operand j's cotangent."""

    name: str
    impl: object
    arity: int
    transposes: tuple = ()


def _fold_batch(args, dims, arity):
    """Move each float operand's batch axis into axis 1 (broadcasting unbatched ones)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args[:arity], dims[:arity]):
        a = jnp.moveaxis(a, d, 1) if d is not None else jnp.broadcast_to(a[:, None], (a.shape[0], size, *a.shape[1:]))
        folded.append(a.reshape(a.shape[0], size * a.shape[2], *a.shape[3:]))
    return folded, size


def _unfold(out, size):
    return out.reshape(out.shape[0], size, out.shape[1] // size, *out.shape[2:])


def _loop_batch(prim, args, dims, params):
    """Vmapped ids or offsets: run the primitive once per batch element."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape)) for a, d in zip(args, dims)]
    out = jax.lax.map(lambda xs: prim.bind(*xs, **params), moved)
    return out, [0] * len(out) if prim.multiple_results else 0


_IMPLS = {}  # primitive -> impl, for `lower_cpu_as_gpu`


def _lower(prim, platform, gpu):
    impl = functools.partial(_IMPLS[prim], gpu=gpu)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=prim.multiple_results), platform=platform)


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
    prim.multiple_results = rule.name == "max_norm"
    prim.def_impl(lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args))
    _IMPLS[prim] = rule.impl
    for platform, gpu in (("cpu", False), ("cuda", True)):
        _lower(prim, platform, gpu)

    def abstract(*avals, num_segments, indices_are_sorted, **_):
        shapes = _output_shape(rule.name, avals[: rule.arity], avals[rule.arity], num_segments)
        dtype = avals[0].dtype
        if prim.multiple_results:  # max_norm: the norms, and the rows attaining them
            return [jax.core.ShapedArray(shapes[0], dtype), jax.core.ShapedArray(shapes[1], jnp.int32)]
        return jax.core.ShapedArray(shapes, dtype)

    def batch(args, dims, **params):
        if any(d is not None for d in dims[rule.arity:]):
            return _loop_batch(prim, args, dims, params)
        folded, size = _fold_batch(args, dims, rule.arity)
        out = prim.bind(*folded, *args[rule.arity:], **params)
        if prim.multiple_results:
            return [_unfold(o, size) for o in out], [1] * len(out)
        return _unfold(out, size), 1

    prim.def_abstract_eval(abstract)
    batching.primitive_batchers[prim] = batch
    return prim


def _symbolic_zero(value):
    return ad.Zero(jax.typeof(value).to_tangent_aval())


def _multilinear(rule):
    """Register a primitive linear in each float operand, with its JVP and transposes."""
    prim = _register(rule)

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        terms = [
            prim.bind(*primals[:j], t, *primals[j + 1 :], **params)
            for j, t in enumerate(tangents[: rule.arity])
            if type(t) is not ad.Zero
        ]
        if not terms:
            return out, _symbolic_zero(out)
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return out, total

    def transpose(ct, *operands, **params):
        *floats, idx, offsets = operands
        j = next(k for k, f in enumerate(floats) if ad.is_undefined_primal(f))
        if type(ct) is ad.Zero:
            cotangent = ad.Zero(floats[j].aval)
        else:
            others = [f for k, f in enumerate(floats) if k != j]
            cotangent = rule.transposes[j](ct, *others, (idx, offsets), params)
        return [None] * j + [cotangent] + [None] * (len(operands) - j - 1)

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    return prim


def _segments(p):
    """The parameters every primitive takes (matvec's `transpose` dropped)."""
    return {"num_segments": p["num_segments"], "indices_are_sorted": p["indices_are_sorted"]}


# The table of transposes; the lambdas refer to primitives defined further down.
sum_p = _multilinear(_Rule("sum", _impl("sum"), 1, (lambda ct, seg, p: gather_p.bind(ct, *seg, **p),)))
gather_p = _multilinear(_Rule("gather", _impl("gather"), 1, (lambda ct, seg, p: sum_p.bind(ct, *seg, **p),)))
dot_p = _multilinear(
    _Rule(
        "dot",
        _impl("dot"),
        2,
        (
            lambda ct, y, seg, p: scale_p.bind(y, ct, *seg, **p),
            lambda ct, x, seg, p: scale_p.bind(x, ct, *seg, **p),
        ),
    )
)
scale_p = _multilinear(
    _Rule(
        "scale",
        _impl("scale"),
        2,
        (
            lambda ct, y, seg, p: scale_p.bind(ct, y, *seg, **p),
            lambda ct, x, seg, p: dot_p.bind(ct, x, *seg, **p),
        ),
    )
)
matvec_p = _multilinear(
    _Rule(
        "matvec",
        _impl("matvec"),
        2,
        (
            lambda ct, m, seg, p: matvec_p.bind(ct, m, *seg, **{**p, "transpose": not p["transpose"]}),
            lambda ct, v, seg, p: outer_p.bind(*((ct, v) if p["transpose"] else (v, ct)), *seg, **_segments(p)),
        ),
    )
)
outer_p = _multilinear(
    _Rule(
        "outer",
        _impl("outer"),
        2,
        (
            lambda ct, b, seg, p: matvec_p.bind(b, ct, *seg, **p, transpose=True),
            lambda ct, a, seg, p: matvec_p.bind(a, ct, *seg, **p, transpose=False),
        ),
    )
)

# Largest squared norm per segment and group, and the first row attaining it. Piecewise
# constant in x: its derivative is zero (max_norm differentiates through the rows it picks).
max_norm_p = _register(_Rule("max_norm", _impl("max_norm"), 1))


def _max_norm_jvp(primals, tangents, **params):
    out = max_norm_p.bind(*primals, **params)
    return out, [_symbolic_zero(o) for o in out]


ad.primitive_jvps[max_norm_p] = _max_norm_jvp


def count(idx, offsets, num_segments, indices_are_sorted):
    """Ids per segment, int32 (not differentiable)."""
    if idx.shape[0] == 0 or num_segments == 0:
        return jnp.zeros((num_segments,), jnp.int32)
    return count_p.bind(idx, offsets, num_segments=num_segments,
                        indices_are_sorted=bool(indices_are_sorted))


def _count_impl(idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    if indices_are_sorted or offsets.shape[0]:  # differences of the offsets: no count kernel
        return jnp.diff(_layout(idx, offsets, num_segments, True, gpu)[0])
    zeros = jnp.zeros((num_segments,), jnp.int32)
    return _reduce("count", [], idx, offsets, zeros, (), num_segments, indices_are_sorted, gpu)


count_p = _register(_Rule("count", _count_impl, 0))
