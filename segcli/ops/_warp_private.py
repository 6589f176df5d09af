"""Every use of Warp's private API (`warp._src`), in one place: what the launch handler
(segcli.ops._native) needs of how Warp lays out a launch's parameters, builds a kernel's FFI
module and launches it on a GPU.

PRIVATE lists each name taken from `warp._src`, with its kind and the parameters (or ctypes
fields) it is used with; `changed()` says which of them the installed Warp lacks or has
changed. tests/ops/test_warp_adapter.py fails on any; at run time the launches then go through
Warp's public `jax_kernel` instead (segcli.ops._native). pyproject.toml pins the Warp
versions that were checked.

    if not changed(): bounds = launch_bounds(dims, kernel, block_dim)
"""

import ctypes
import functools
import importlib
import inspect

PRIVATE = {
    "warp._src.context._build_kernel_launch_bounds": ("function", ("dim", "kernel", "block_dim")),
    "warp._src.context.Module.get_module_hash": ("function", ("self", "block_dim")),
    "warp._src.context.Module.get_kernel_hooks": ("function", ("self", "kernel", "device")),
    "warp._src.context.KernelHooks": ("class", ("forward", "backward", "forward_smem_bytes",
                                                "backward_smem_bytes", "cluster_dim")),
    "warp._src.context.runtime": ("object", ()),
    "warp._src.jax.ffi.FfiArg": ("class", ("name", "type", "in_out")),
    "warp._src.jax.ffi._get_ffi_block_dim": ("function", ("device", "block_dim")),
    "warp._src.jax.ffi._load_ffi_module": ("function", ("module", "device", "block_dim")),
    "warp._src.jax.ffi.get_jax_output_type": ("function", ("arg", "dims")),
    "warp._src.types.array_t": ("structure", ("data", "grad", "shape", "strides", "ndim")),
    "warp._src.types.strides_from_shape": ("function", ("shape", "dtype")),
    "warp._src.types.type_to_warp": ("function", ("dtype",)),
}
"""Each private name used: (its kind: function, class (its constructor's parameters),
structure (a ctypes Structure: its first fields) or object, the leading parameters)."""


@functools.cache
def _find(path):
    """The object at dotted `path` (a module, then attributes); AttributeError or ImportError
    where there is none."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)


def _leading(kind, found):
    """The leading parameters (or fields) of `found`, a `kind` of PRIVATE; None where it is
    not of that kind."""
    if kind == "object":
        return ()
    if kind == "structure":
        if not (inspect.isclass(found) and issubclass(found, ctypes.Structure)):
            return None
        return tuple(name for name, *_ in found._fields_)
    if kind == "class":
        if not inspect.isclass(found):
            return None
        return tuple(inspect.signature(found.__init__).parameters)[1:]
    return tuple(inspect.signature(found).parameters) if inspect.isfunction(found) else None


@functools.cache
def changed():
    """What the installed Warp lacks or changed of PRIVATE: a line per name, none if all is
    as expected."""
    return check(PRIVATE)


def check(expected):
    """What the installed Warp lacks or changed of `expected` (as PRIVATE): a line per name.

    >>> check({"warp._src.types.no_such_name": ("function", ())})
    ['warp._src.types.no_such_name is missing']
    """
    problems = []
    for path, (kind, parameters) in expected.items():
        try:
            found = _find(path)
        except (ImportError, AttributeError):
            problems.append(f"{path} is missing")
            continue
        leading = _leading(kind, found)
        if leading is None:
            problems.append(f"{path} is no longer a {kind}")
        elif leading[:len(parameters)] != parameters:
            problems.append(f"{path} takes {leading}, not {parameters} first")
    return problems


def launch_bounds(dims, kernel, block_dim):
    """Warp's launch bounds (a ctypes Structure) of `kernel` over `dims` threads."""
    return _find("warp._src.context._build_kernel_launch_bounds")(dims, kernel, block_dim)


def ffi_arg(name, type_, in_out):
    """Warp's description of a kernel argument in an FFI call (is_array, warp_ndim, ...)."""
    return _find("warp._src.jax.ffi.FfiArg")(name, type_, in_out)


def output_type(arg, shape):
    """The jax.ShapeDtypeStruct of a pure output `arg` (ffi_arg) of `shape`."""
    return _find("warp._src.jax.ffi.get_jax_output_type")(arg, shape)


def array_struct():
    """Warp's array_t: an array argument as a kernel's parameters hold it."""
    return _find("warp._src.types.array_t")


def strides(shape, dtype):
    """The strides of a contiguous Warp array of `shape` and `dtype`."""
    return _find("warp._src.types.strides_from_shape")(shape, dtype)


def scalar_type(type_):
    """The ctypes type of a Warp scalar argument's `type_`."""
    return _find("warp._src.types.type_to_warp")(type_)._type_


def ffi_module(module, device, block_dim):
    """`module` (a kernel's Warp module) loaded on `device` for FFI calls of `block_dim`."""
    block = _find("warp._src.jax.ffi._get_ffi_block_dim")(device, block_dim)
    return _find("warp._src.jax.ffi._load_ffi_module")(module, device, block)


def cuda_launch_address():
    """The address of Warp's C function that launches a kernel on a CUDA stream."""
    core = _find("warp._src.context.runtime").core
    return ctypes.cast(core.wp_cuda_launch_kernel, ctypes.c_void_p).value
