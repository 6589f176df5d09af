"""Warp kernels for the segment primitives, and their JAX bindings.

Shapes (rows first, then a group axis G that vmap folds into, then features):

    layout   idx (N,)                          -> offsets (M+1,)   offsets[s] = first i with idx[i] >= s
    sum      x (N, K)                          -> (M, K)           out[s] = Σ_{idx[i]=s} x[i]
    count    idx (N,)                          -> (M,)             out[s] = #{i : idx[i]=s}
    dot      x, y (N, G, K)                    -> (M, G)           out[s,g] = Σ_{idx[i]=s} Σ_k x[i,g,k] y[i,g,k]
    outer    a (N, G, K), b (N, G, L)          -> (M, G, K, L)     out[s,g] = Σ_{idx[i]=s} a[i,g] ⊗ b[i,g]
    max_norm x (N, G, K)                       -> best (M, G), mask (N, G)
                                                  best[s,g] = max_{idx[i]=s} |x[i,g]|², mask 1 at the first i attaining it
    gather   y (R, K), idx (L,)                -> (L, K)           out[i] = y[idx[i]]
    scale    x (N, G, K), y (M, G)             -> (N, G, K)        out[i,g] = x[i,g] * y[idx[i],g]
    matvec   v (N, G, K), m (M, G, K, J)       -> (N, G, J)        out[i,g] = m[idx[i],g]ᵀ v[i,g]

Ids outside [0, M) are skipped by reductions and give 0 in gathers; no id reads or writes
outside an array. Reductions take `ordered`, a one-element flag computed from the ids: when it
is 1 (ids non-decreasing) each segment is reduced by one thread over its own CSR range in
index order, so results are bitwise repeatable; when it is 0 the kernel falls back to
float atomics over a grid-stride loop into a zero-initialised output.
"""

import functools
import inspect
from typing import Any

import warp as wp

wp.config.log_level = wp.LOG_ERROR

# Threads of the grid-stride loop of the unordered (atomic) fallback on a GPU.
_GPU_STRIDE_THREADS = 1 << 17

_FLOATS = {"float32": wp.float32, "float64": wp.float64}


@wp.func
def _segment_range(offsets: wp.array(dtype=wp.int32), s: int, n: int):
    lo = wp.clamp(offsets[s], 0, n)
    hi = wp.clamp(offsets[s + 1], lo, n)
    return lo, hi


@wp.kernel
def _layout_kernel(idx: wp.array(dtype=wp.int32), offsets: wp.array(dtype=wp.int32)):
    # Binary search for the first id >= s; meaningful only for non-decreasing ids, but always
    # within bounds, so unordered ids (whose offsets are never used) are harmless.
    s = wp.tid()
    lo = int(0)
    hi = idx.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if idx[mid] < s:
            lo = mid + 1
        else:
            hi = mid
    offsets[s] = lo


@wp.kernel
def _count_kernel(
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array(dtype=wp.int32),
):
    t = wp.tid()
    n = idx.shape[0]
    m = out.shape[0]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            out[t] = hi - lo
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                wp.atomic_add(out, s, 1)


@wp.kernel
def _sum_kernel(
    x: wp.array2d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array2d(dtype=Any),
):
    t, k = wp.tid()
    n = x.shape[0]
    m = out.shape[0]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            acc = out.dtype(0.0)
            for i in range(lo, hi):
                acc += x[i, k]
            out[t, k] = acc
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                wp.atomic_add(out, s, k, x[i, k])


@wp.kernel
def _dot_kernel(
    x: wp.array3d(dtype=Any),
    y: wp.array3d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array2d(dtype=Any),
):
    t, g = wp.tid()
    n = x.shape[0]
    m = out.shape[0]
    nk = x.shape[2]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            acc = out.dtype(0.0)
            for i in range(lo, hi):
                for k in range(nk):
                    acc += x[i, g, k] * y[i, g, k]
            out[t, g] = acc
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                acc = out.dtype(0.0)
                for k in range(nk):
                    acc += x[i, g, k] * y[i, g, k]
                wp.atomic_add(out, s, g, acc)


@wp.kernel
def _outer_kernel(
    a: wp.array3d(dtype=Any),
    b: wp.array3d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array4d(dtype=Any),
):
    t, g, k, l = wp.tid()
    n = a.shape[0]
    m = out.shape[0]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            acc = out.dtype(0.0)
            for i in range(lo, hi):
                acc += a[i, g, k] * b[i, g, l]
            out[t, g, k, l] = acc
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                wp.atomic_add(out, s, g, k, l, a[i, g, k] * b[i, g, l])


@wp.func
def _squared_norm(x: wp.array3d(dtype=Any), i: int, g: int):
    acc = x.dtype(0.0)
    for k in range(x.shape[2]):
        acc += x[i, g, k] * x[i, g, k]
    return acc


@wp.func
def _beats(candidate: Any, best: Any):
    # NaN beats any number, so a NaN row is chosen and its segment's result is NaN.
    return candidate > best or (wp.isnan(candidate) and not wp.isnan(best))


@wp.func
def _max_key(v: Any):
    # The unordered path compares keys with atomics: NaN maps to inf, the top key.
    if wp.isnan(v):
        return type(v)(wp.inf)
    return v


@wp.kernel
def _max_norm_ordered_kernel(
    x: wp.array3d(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    best: wp.array2d(dtype=Any),
    mask: wp.array2d(dtype=Any),
):
    s, g = wp.tid()
    if ordered[0] != 0:
        lo, hi = _segment_range(offsets, s, x.shape[0])
        best_i = int(-1)
        top = best.dtype(0.0)
        for i in range(lo, hi):
            v = _squared_norm(x, i, g)
            if best_i < 0 or _beats(v, top):
                best_i = i
                top = v
        best[s, g] = top
        if best_i >= 0:
            mask[best_i, g] = mask.dtype(1.0)


@wp.kernel
def _max_key_kernel(
    x: wp.array3d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    best: wp.array2d(dtype=Any),
):
    t, g = wp.tid()
    if ordered[0] == 0:
        for i in range(t, x.shape[0], stride):
            s = idx[i]
            if s >= 0 and s < best.shape[0]:
                wp.atomic_max(best, s, g, _max_key(_squared_norm(x, i, g)))


@wp.kernel
def _first_attaining_kernel(
    x: wp.array3d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    best: wp.array2d(dtype=Any),
    first: wp.array2d(dtype=wp.int32),
):
    t, g = wp.tid()
    if ordered[0] == 0:
        for i in range(t, x.shape[0], stride):
            s = idx[i]
            if s >= 0 and s < best.shape[0]:
                if _max_key(_squared_norm(x, i, g)) == best[s, g]:
                    wp.atomic_min(first, s, g, i)


@wp.kernel
def _mark_first_kernel(
    x: wp.array3d(dtype=Any),
    ordered: wp.array(dtype=wp.int32),
    first: wp.array2d(dtype=wp.int32),
    best: wp.array2d(dtype=Any),
    mask: wp.array2d(dtype=Any),
):
    s, g = wp.tid()
    if ordered[0] == 0:
        i = first[s, g]
        if i < x.shape[0]:
            best[s, g] = _squared_norm(x, i, g)
            mask[i, g] = mask.dtype(1.0)
        else:
            best[s, g] = best.dtype(0.0)


@wp.kernel
def _gather_kernel(y: wp.array2d(dtype=Any), idx: wp.array(dtype=wp.int32), out: wp.array2d(dtype=Any)):
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < y.shape[0]
    for k in range(out.shape[1]):
        if valid:
            out[i, k] = y[s, k]
        else:
            out[i, k] = out.dtype(0.0)


@wp.kernel
def _scale_kernel(
    x: wp.array3d(dtype=Any),
    y: wp.array2d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    out: wp.array3d(dtype=Any),
):
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < y.shape[0]
    for g in range(x.shape[1]):
        factor = out.dtype(0.0)
        if valid:
            factor = y[s, g]
        for k in range(x.shape[2]):
            out[i, g, k] = x[i, g, k] * factor


@wp.kernel
def _matvec_kernel(
    v: wp.array3d(dtype=Any),
    m: wp.array4d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    out: wp.array3d(dtype=Any),
):
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < m.shape[0]
    for g in range(v.shape[1]):
        for j in range(out.shape[2]):
            acc = out.dtype(0.0)
            if valid:
                for k in range(v.shape[2]):
                    acc += v[i, g, k] * m[s, g, k, j]
            out[i, g, j] = acc


def _declare_overloads():
    """Instantiate every generic kernel for float32 and float64 up front, so the module is
    compiled (and cached in ~/.cache/warp) once rather than once per new overload."""
    for kernel in (
        _sum_kernel, _dot_kernel, _outer_kernel, _max_norm_ordered_kernel, _max_key_kernel,
        _first_attaining_kernel, _mark_first_kernel, _gather_kernel, _scale_kernel, _matvec_kernel,
    ):
        for dtype in _FLOATS.values():
            wp.overload(
                kernel,
                {a.label: wp.array(dtype=dtype, ndim=a.type.ndim) for a in kernel.adj.args if getattr(a.type, "dtype", None) is Any},
            )


_declare_overloads()


def _stride(device, n):
    """Threads of the unordered fallback's grid-stride loop: one on a CPU, many on a GPU."""
    return 1 if device.is_cpu else max(1, min(n, _GPU_STRIDE_THREADS))


def _launch(kernel, dim, inputs, device):
    wp.launch(kernel, dim=dim, inputs=inputs, device=device)


def _reduce_launcher(kernel):
    """Launch a reduction over max(M, stride) rows; extra dims are the output's other axes."""

    def launch(*arrays):
        *ins, idx, offsets, ordered, out = arrays
        stride = _stride(out.device, idx.shape[0])
        rows = max(out.shape[0], stride)
        _launch(kernel, (rows, *out.shape[1:]), [*ins, idx, offsets, ordered, stride, out], out.device)

    return launch


def _count(idx, offsets, ordered, out):
    stride = _stride(out.device, idx.shape[0])
    _launch(_count_kernel, max(out.shape[0], stride), [idx, offsets, ordered, stride, out], out.device)


def _layout(idx, offsets):
    _launch(_layout_kernel, offsets.shape[0], [idx, offsets], offsets.device)


def _max_norm(x, idx, offsets, ordered, best, first, mask):
    # best starts at -1 (below every key), first at N and mask at 0; the caller sets them.
    m, groups = best.shape
    stride = _stride(best.device, x.shape[0])
    _launch(_max_norm_ordered_kernel, (m, groups), [x, offsets, ordered, best, mask], best.device)
    _launch(_max_key_kernel, (stride, groups), [x, idx, ordered, stride, best], best.device)
    _launch(_first_attaining_kernel, (stride, groups), [x, idx, ordered, stride, best, first], best.device)
    _launch(_mark_first_kernel, (m, groups), [x, ordered, first, best, mask], best.device)


def _elementwise_launcher(kernel):
    def launch(*arrays):
        out = arrays[-1]
        _launch(kernel, out.shape[0], list(arrays), out.device)

    return launch


def _array(ndim, dtype):
    return wp.array(dtype=dtype, ndim=ndim)


# name -> (launcher, argument signature, names of in-out arguments); in the signature "f<d>"
# is a float array of d dimensions in the call's dtype, "i<d>" an int32 array ("i": a vector),
# Arguments are named a0, a1, ..., and the last one "out".
_SIGNATURES = {
    "layout": (_layout, ("i", "i"), ()),
    "count": (_count, ("i", "i", "i", "i"), ("out",)),
    "sum": (_reduce_launcher(_sum_kernel), ("f2", "i", "i", "i", "f2"), ("out",)),
    "dot": (_reduce_launcher(_dot_kernel), ("f3", "f3", "i", "i", "i", "f2"), ("out",)),
    "outer": (_reduce_launcher(_outer_kernel), ("f3", "f3", "i", "i", "i", "f4"), ("out",)),
    "max_norm": (_max_norm, ("f3", "i", "i", "i", "f2", "i2", "f2"), ("a4", "a5", "out")),
    "gather": (_elementwise_launcher(_gather_kernel), ("f2", "i", "f2"), ()),
    "scale": (_elementwise_launcher(_scale_kernel), ("f3", "f2", "i", "f3"), ()),
    "matvec": (_elementwise_launcher(_matvec_kernel), ("f3", "f4", "i", "f3"), ()),
}


@functools.lru_cache(maxsize=None)
def callable_for(name, dtype="float32"):
    """The `warp.jax_callable` running kernel `name` on arrays of `dtype` (cached per pair)."""
    launcher, signature, in_out = _SIGNATURES[name]
    float_type = _FLOATS[dtype]

    def annotation(code):
        if code[0] == "i":
            return _array(int(code[1:] or 1), wp.int32)
        return _array(int(code[1]), float_type)

    names = [f"a{j}" for j in range(len(signature) - 1)] + ["out"]

    def function(*arrays):
        launcher(*arrays)

    function.__name__ = function.__qualname__ = f"segcli_{name}_{dtype}"
    function.__signature__ = inspect.Signature(
        [inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in names]
    )
    function.__annotations__ = {a: annotation(c) for a, c in zip(names, signature)} | {"return": None}
    num_outputs = len(in_out) + ("out" not in in_out)
    call = wp.jax_callable(
        function,
        num_outputs=num_outputs,
        graph_mode=wp.JaxCallableGraphMode.NONE,
        vmap_method="sequential",
        in_out_argnames=list(in_out),
    )
    return call if num_outputs > 1 else lambda *args, **kwargs: call(*args, **kwargs)[0]
