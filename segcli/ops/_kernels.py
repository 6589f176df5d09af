"""Warp kernels for the segment primitives, and their JAX bindings.

Shapes (rows first, then a group axis G that vmap folds into, then features):

    layout   idx (N,)                          -> offsets (M+1,)   offsets[s] = first i with idx[i] >= s
                                                  (a binary search per segment on GPUs, one pass on CPUs)
    sum      x (N, K)                          -> (M, K)           out[s] = Σ_{idx[i]=s} x[i]
    count    idx (N,)                          -> (M,)             out[s] = #{i : idx[i]=s}
    row_dot  x, y (N, G, K)                    -> (N, G)           out[i,g] = <x[i,g], y[i,g]>   (dot = sum of row_dot)
    outer    a (N, G, K), b (N, G, L)          -> (M, G, K, L)     out[s,g] = Σ_{idx[i]=s} a[i,g] ⊗ b[i,g]
    max_norm x (N, G, K)                       -> best (M, G), first (M, G) int32
                                                  best[s,g] = max_{idx[i]=s} |x[i,g]|², first[s,g] the first i
                                                  attaining it (N for an empty segment)
    gather   y (R, K), idx (L,)                -> (L, K)           out[i] = y[idx[i]]
    scale    x (N, G, K), y (M, G)             -> (N, G, K)        out[i,g] = x[i,g] * y[idx[i],g]
    matvec   v (N, G, K), m (M, G, K, K)       -> (N, G, K)        out[i,g] = v[i,g] @ m[idx[i],g]  (@ m[idx[i],g]ᵀ
                                                                  with `transpose`)
    gather3, scale3, matvec3                                      the same for G = 1, K = 3
    sum3, dot3                                                    sum and dot for G = 1, K = 3, on CPUs (a GPU
                                                                  keeps more rows in flight with a thread
                                                                  per feature, and reads rows coalesced)

Ids outside [0, M) are skipped by reductions and give 0 in gathers; no id reads or writes
outside an array. Reductions take `ordered`, a one-element flag computed from the ids: when it
is 1 (ids non-decreasing) each segment is reduced by one thread over its own CSR range in
index order, so results are bitwise repeatable; when it is 0 the kernel falls back to
float atomics over a grid-stride loop into a zero-initialised output.
"""

import functools
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

wp.config.log_level = wp.LOG_ERROR


def _init_warp():
    """Initialise Warp; where JAX runs on the CPU, without the native warning that no CUDA
    driver was found (irrelevant there, and noise on every command's stderr)."""
    if jax.default_backend() != "cpu":
        wp.init()
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            wp.init()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_init_warp()


def pinned_bytes(size):
    """A NumPy uint8 array of `size` bytes, in page-locked host memory (which GPUs copy from
    at full speed, held as long as the array is) where Warp sees a CUDA device."""
    if not wp.is_cuda_available():
        return np.empty(size, np.uint8)
    return wp.empty(size, dtype=wp.uint8, device="cpu", pinned=True).numpy()


def cpu_available():
    """Whether this Warp build can run kernels on the CPU (it needs Warp's LLVM backend)."""
    return wp.is_cpu_available()

# Threads per block on a GPU: 128 runs the gathers up to 16 % faster than 256 on an H200 and
# the other kernels as fast (benchmarks/RESULTS.md).
_BLOCK_DIM = 128

# Threads of the grid-stride loop of the unordered (atomic) fallback on a GPU.
_GPU_STRIDE_THREADS = 1 << 17

_FLOATS = {"float32": wp.float32, "float64": wp.float64}

_SOURCES = {}  # kernel name -> its Python function (see _kernels)


def _deferred(function):
    """Register the kernel `_NAME_kernel` under NAME, to become a Warp kernel on first use."""
    _SOURCES[function.__name__.removeprefix("_").removesuffix("_kernel")] = function
    return function


@wp.func
def _segment_range(offsets: wp.array(dtype=wp.int32), s: int, n: int):
    lo = wp.clamp(offsets[s], 0, n)
    hi = wp.clamp(offsets[s + 1], lo, n)
    return lo, hi


@_deferred
def _layout_kernel(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # One thread per segment: binary search for the first id >= s. (On a GPU this beats a
    # thread per row writing the offsets at each boundary: 17 µs against 39 at N = 10⁷.)
    s = wp.tid()
    lo = int(0)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    hi = idx.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if idx[mid] < s:
            lo = mid + 1
        else:
            hi = mid
    out[s] = lo


@_deferred
def _layout_serial_kernel(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # One thread walking the ids in order, for CPUs (which run a kernel on one thread anyway):
    # a stream over the ids instead of M searches that each miss the cache (2 Mi ids: 3.3 ms
    # against 4.8). Meaningful for ids non-decreasing once clamped to [-1, M], the only case
    # that uses the offsets.
    m = out.shape[0] - 1
    s = int(0)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    for i in range(idx.shape[0]):
        top = wp.clamp(idx[i], -1, m)
        while s <= top:
            out[s] = i
            s += 1
    while s <= m:
        out[s] = idx.shape[0]
        s += 1


@_deferred
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


@_deferred
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


@_deferred
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


@_deferred
def _max_norm_ordered_kernel(
    x: wp.array3d(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    best: wp.array2d(dtype=Any),
    first: wp.array2d(dtype=wp.int32),
):
    s, g = wp.tid()
    if ordered[0] != 0:
        lo, hi = _segment_range(offsets, s, x.shape[0])
        best_i = int(-1)  # noqa: UP018, RUF046  (a Warp variable: it changes)
        top = best.dtype(0.0)
        for i in range(lo, hi):
            v = _squared_norm(x, i, g)
            if best_i < 0 or _beats(v, top):
                best_i = i
                top = v
        best[s, g] = top
        if best_i >= 0:
            first[s, g] = best_i


@_deferred
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


@_deferred
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
            if s >= 0 and s < best.shape[0]:  # noqa: SIM102  (best[s, g] only in range)
                if _max_key(_squared_norm(x, i, g)) == best[s, g]:
                    wp.atomic_min(first, s, g, i)


@_deferred
def _norm_of_first_kernel(
    x: wp.array3d(dtype=Any),
    ordered: wp.array(dtype=wp.int32),
    first: wp.array2d(dtype=wp.int32),
    best: wp.array2d(dtype=Any),
):
    # The squared norm of the row found (NaN where the key was a NaN's inf), or 0 if none.
    s, g = wp.tid()
    if ordered[0] == 0:
        i = first[s, g]
        if i < x.shape[0]:
            best[s, g] = _squared_norm(x, i, g)
        else:
            best[s, g] = best.dtype(0.0)


@_deferred
def _gather_kernel(y: wp.array2d(dtype=Any), idx: wp.array(dtype=wp.int32), out: wp.array2d(dtype=Any)):
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < y.shape[0]
    for k in range(out.shape[1]):
        if valid:
            out[i, k] = y[s, k]
        else:
            out[i, k] = out.dtype(0.0)


@_deferred
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


@_deferred
def _row_dot_kernel(x: wp.array3d(dtype=Any), y: wp.array3d(dtype=Any), out: wp.array2d(dtype=Any)):
    # Read row by row (coalesced on a GPU); `sum` then adds the rows of each segment.
    i = wp.tid()
    for g in range(x.shape[1]):
        acc = out.dtype(0.0)
        for k in range(x.shape[2]):
            acc += x[i, g, k] * y[i, g, k]
        out[i, g] = acc


@_deferred
def _matvec_kernel(
    v: wp.array3d(dtype=Any),
    m: wp.array4d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    transpose: int,
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
                    if transpose != 0:
                        acc += v[i, g, k] * m[s, g, j, k]
                    else:
                        acc += v[i, g, k] * m[s, g, k, j]
            out[i, g, j] = acc


# The common case of one group of 3 features, with whole vectors and matrices per thread.


@_deferred
def _gather3_kernel(y: wp.array(dtype=Any), idx: wp.array(dtype=wp.int32), out: wp.array(dtype=Any)):
    i = wp.tid()
    s = idx[i]
    if s >= 0 and s < y.shape[0]:
        out[i] = y[s]
    else:
        out[i] = type(out[i])()


@_deferred
def _scale3_kernel(
    x: wp.array(dtype=Any),
    y: wp.array(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    out: wp.array(dtype=Any),
):
    i = wp.tid()
    s = idx[i]
    factor = y.dtype(0.0)
    if s >= 0 and s < y.shape[0]:
        factor = y[s]
    out[i] = x[i] * factor


@_deferred
def _matvec3_kernel(
    v: wp.array(dtype=Any),
    m: wp.array(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    transpose: int,
    out: wp.array(dtype=Any),
):
    i = wp.tid()
    s = idx[i]
    if s >= 0 and s < m.shape[0]:
        if transpose != 0:
            out[i] = m[s] @ v[i]
        else:
            out[i] = wp.transpose(m[s]) @ v[i]
    else:
        out[i] = type(out[i])()


@_deferred
def _sum3_kernel(
    x: wp.array(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array(dtype=Any),
):
    t = wp.tid()
    n = x.shape[0]
    m = out.shape[0]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            acc = type(out[t])()
            for i in range(lo, hi):
                acc += x[i]
            out[t] = acc
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                wp.atomic_add(out, s, x[i])


@_deferred
def _dot3_kernel(
    x: wp.array(dtype=Any),
    y: wp.array(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array(dtype=Any),
):
    t = wp.tid()
    n = x.shape[0]
    m = out.shape[0]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            acc = out.dtype(0.0)
            for i in range(lo, hi):
                acc += wp.dot(x[i], y[i])
            out[t] = acc
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                wp.atomic_add(out, s, wp.dot(x[i], y[i]))


# Element types of the vec3 kernels' arguments (the others are plain float arrays).
_VEC3_TYPES = {
    "gather3": {"y": "vec3", "out": "vec3"},
    "scale3": {"x": "vec3", "y": "scalar", "out": "vec3"},
    "matvec3": {"v": "vec3", "m": "mat33", "out": "vec3"},
    "sum3": {"x": "vec3", "out": "vec3"},
    "dot3": {"x": "vec3", "y": "vec3", "out": "scalar"},
}


def _overload(name, kernel, dtype):
    element = {"scalar": dtype, "vec3": wp.types.vector(3, dtype), "mat33": wp.types.matrix((3, 3), dtype)}
    kinds = _VEC3_TYPES.get(name, {})
    concrete = {
        a.label: wp.array(dtype=element[kinds.get(a.label, "scalar")], ndim=a.type.ndim)
        for a in kernel.adj.args
        if getattr(a.type, "dtype", None) is Any
    }
    return wp.overload(kernel, concrete)


_MADE = {}  # kernel name -> {dtype name: Warp kernel}, the kernels made so far
_MAKING = threading.Lock()


def _kernels(name):
    """Kernel `name` as {dtype name: Warp kernel}, made on its first launch (once, whatever
    the threads) in a Warp module of its own, with the overloads of both float types if
    generic (so that its module compiles once, into Warp's kernel cache, not once per overload
    seen) and without the adjoint code Warp would generate for its own autodiff (JAX
    differentiates the primitives): a process hashes, loads and compiles only the kernels its
    ops launch."""
    with _MAKING:
        if name not in _MADE:
            kernel = wp.kernel(_SOURCES[name], enable_backward=False, module=f"segcli_{name}")
            _MADE[name] = (dict.fromkeys(_FLOATS, kernel) if not kernel.is_generic else
                           {dtype: _overload(name, kernel, t) for dtype, t in _FLOATS.items()})
        return _MADE[name]


@functools.cache
def _ffi(name, dtype, in_out):
    kernel = _kernels(name)[dtype]
    outputs = len(in_out) + sum(1 for a in kernel.adj.args
                                if a.label == "out" and "out" not in in_out)
    return wp.jax_kernel(kernel, num_outputs=outputs, in_out_argnames=list(in_out),
                         vmap_method="sequential", block_dim=_BLOCK_DIM)


def launch(name, *args, dims, in_out=(), out=None):
    """Launch kernel `name` over `dims` threads from JAX; returns its outputs (a list if several).

    The in-out arguments are updated copies of the arrays passed for them; `out`, if given,
    is the shape of a pure output named "out". One FFI call is one kernel launch, so JAX
    can capture it into its own CUDA graph."""
    float_args = [a for a in args if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    dtype = jnp.dtype(float_args[0].dtype).name if float_args else "float32"
    call = _ffi(name, dtype, tuple(in_out))
    result = call(*args, launch_dims=dims, output_dims=None if out is None else {"out": out})
    return result[0] if len(result) == 1 else result


def stride(gpu, n):
    """Threads of the unordered fallback's grid-stride loop: one on a CPU, many on a GPU."""
    return max(1, min(n, _GPU_STRIDE_THREADS)) if gpu else 1
