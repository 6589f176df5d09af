"""The kernels by name, made into Warp kernels at their first launch, the variant tables the
primitives pick them from, and their launch from JAX."""

import functools
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from segcli.ops import _native

wp.config.log_level = wp.LOG_ERROR


def _init_warp():
    """Initialise Warp; where JAX runs on the CPU, without the native warning that no CUDA
    driver was found (irrelevant there, and noise on every command's stderr). An OSError
    names the kernel cache Warp could not make."""
    try:
        _start_warp()
    except OSError as err:
        raise OSError(err.errno, f"cannot hold Warp's kernel cache ({err.strerror}); set "
                                 "WARP_CACHE_PATH or XDG_CACHE_HOME to a writable directory",
                      err.filename) from err


def _start_warp():
    if jax.default_backend() != "cpu":
        wp.init()
        return
    if sys.stderr is not None:
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
    at full speed, held as long as the array is) where Warp sees a CUDA device.

    >>> pinned_bytes(16).shape
    (16,)
    """
    if not wp.is_cuda_available():
        return np.empty(size, np.uint8)
    return wp.empty(size, dtype=wp.uint8, device="cpu", pinned=True).numpy()


def cpu_available():
    """Whether this Warp build can run kernels on the CPU (it needs Warp's LLVM backend)."""
    return wp.is_cpu_available()


# Threads per block on a GPU: 128 runs the gathers up to 16 % faster than 256 on an H200 and
# the other kernels as fast (benchmarks/RESULTS.md).
BLOCK_DIM = 128

# Threads of the grid-stride loop of the unordered (atomic) fallback on a GPU.
_GPU_STRIDE_THREADS = 1 << 17


def stride(gpu, n):
    """Threads of the unordered fallback's grid-stride loop: one on a CPU, many on a GPU.

    >>> stride(False, 10**6), stride(True, 10**6)
    (1, 131072)
    """
    return max(1, min(n, _GPU_STRIDE_THREADS)) if gpu else 1


FLOATS = ("float32", "float64")
INTEGERS = ("int32", "int64")
_WARP_DTYPES = {"float32": wp.float32, "float64": wp.float64, "int32": wp.int32,
                "int64": wp.int64}


@dataclass(frozen=True, eq=False)
class Kernel:
    """A kernel: its `name` (its Warp module is segcli_NAME), the Python function Warp makes it
    of (generic over its arrays of `Any`), the dtypes it is made for, the element of each
    argument that is not an array of the dtype (`elements`: "int32", "vec3" or "mat33") and
    Warp's options beside its source."""

    name: str
    source: Callable = field(repr=False)
    dtypes: tuple[str, ...] = FLOATS
    elements: Mapping[str, str] = field(default_factory=dict, repr=False)
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)


KERNELS: dict[str, Kernel] = {}
"""Every kernel, by name."""


def kernel(name, source, **spec):
    """Kernel `name` of the Python function `source` (renamed _NAME_kernel, Warp's key of it),
    registered in KERNELS; `spec` as Kernel takes it."""
    source.__name__ = source.__qualname__ = f"_{name}_kernel"
    made = KERNELS[name] = Kernel(name, source, **spec)
    return made


ANY = "any"
"""A table's entry for a field that any request matches."""


@dataclass(frozen=True)
class Variant:
    """A row of a family's table: the kernel that computes `op` (its `step`, where the op takes
    several kernels) on `device` ("cpu", "gpu"), for ids given as `ordering` ("offsets": a
    Segments' offsets, or ids known sorted; "ids") and rows of `size` entries (3: rows of 3
    floats as vectors), ANY where it does not depend on one."""

    op: str
    step: str
    device: str
    ordering: str
    size: Any
    kernel: Kernel


def variants(*rows):
    """A family's table: Variant rows (op, step, device, ordering, size, kernel)."""
    return tuple(Variant(*row) for row in rows)


def pick(table, op, step="", *, device=ANY, ordering=ANY, size=ANY, dtype=None):
    """The first row of `table` for `op` and `step` whose device, ordering and size are ANY
    or those asked (a table lists its specific rows first) and whose kernel is made for
    `dtype`, if given.

    >>> from segcli.ops.kernels import GATHERS
    >>> pick(GATHERS, "gather", device="cpu", ordering="offsets", size=3).kernel.name
    'gather3_ordered'
    >>> pick(GATHERS, "gather", device="cpu", ordering="ids", size=3).kernel.name
    'gather3'
    """
    for row in table:
        if (row.op == op and row.step == step
                and all(mine in (ANY, asked) for mine, asked in
                        ((row.device, device), (row.ordering, ordering), (row.size, size)))):
            if dtype is not None and jnp.dtype(dtype).name not in row.kernel.dtypes:
                continue
            return row
    raise LookupError(f"no kernel for {op} {step} on {device}, {ordering}, size {size}, "
                      f"{dtype}")


def _overload(spec, made, dtype):
    warp_type = _WARP_DTYPES[dtype]
    element = {"scalar": warp_type, "int32": wp.int32, "vec3": wp.types.vector(3, warp_type),
               "mat33": wp.types.matrix((3, 3), warp_type)}
    concrete = {
        a.label: wp.array(dtype=element[spec.elements.get(a.label, "scalar")], ndim=a.type.ndim)
        for a in made.adj.args
        if getattr(a.type, "dtype", None) is Any
    }
    return wp.overload(made, concrete)


_MADE = {}  # kernel name -> {dtype name: Warp kernel}, the kernels made so far
_MAKING = threading.Lock()


def warp_kernels(spec):
    """Kernel `spec` as {dtype name: Warp kernel}, made on its first launch (once, whatever
    the threads) in a Warp module of its own, with the overloads of all its dtypes if
    generic (so that its module compiles once, into Warp's kernel cache, not once per overload
    seen) and without the adjoint code Warp would generate for its own autodiff (JAX
    differentiates the primitives): a process hashes, loads and compiles only the kernels its
    ops launch."""
    with _MAKING:
        if spec.name not in _MADE:
            made = wp.kernel(spec.source, enable_backward=False, module=f"segcli_{spec.name}",
                             **spec.options)
            _MADE[spec.name] = (dict.fromkeys(spec.dtypes, made) if not made.is_generic else
                                {dtype: _overload(spec, made, dtype) for dtype in spec.dtypes})
        return _MADE[spec.name]


@functools.cache
def _ffi(spec, dtype, in_out, pure):
    made = warp_kernels(spec)[dtype]
    outputs = len(in_out) + sum(1 for a in made.adj.args
                                if a.label in pure and a.label not in in_out)
    return wp.jax_kernel(made, num_outputs=outputs, in_out_argnames=list(in_out),
                         vmap_method="sequential", block_dim=BLOCK_DIM)


def launch(spec, *args, dims, in_out=(), out=None, dtype=None):
    """Launch `spec`, a Kernel or a table's Variant of one, over `dims` threads from JAX;
    returns its outputs (a list if several).

    `dtype` picks the overload (default: the first float argument's dtype, else the kernel's
    first). The in-out arguments are updated copies of the arrays passed for them; `out`, if
    given, is the shape of a pure output named "out", or {name: shape} of pure outputs (the
    kernel's last arguments). One FFI call is one kernel launch, so JAX can capture it into
    its own CUDA graph."""
    spec = spec.kernel if isinstance(spec, Variant) else spec
    if dtype is None:
        floats = [a for a in args if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
        dtype = jnp.dtype(floats[0].dtype).name if floats else spec.dtypes[0]
    dtype = jnp.dtype(dtype).name
    if _native.available():
        result = _native.launch(warp_kernels(spec)[dtype], args, dims, in_out, out, BLOCK_DIM)
    else:
        shapes = out if isinstance(out, dict) else {"out": out}
        call = _ffi(spec, dtype, tuple(in_out), tuple(shapes))
        result = call(*args, launch_dims=dims,
                      output_dims={k: v for k, v in shapes.items() if v is not None} or None)
    return result[0] if len(result) == 1 else result
