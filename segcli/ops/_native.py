"""Warp kernel launches as XLA FFI calls that XLA executes in C, with no Python on the call.

Warp's own `jax_kernel` runs a Python callback each time XLA executes a launch (0.13–0.16 ms
on a 2-core VM), unless XLA captured the launch into a CUDA graph, which by default it does
only in programs of five kernels or more. Here each distinct launch becomes a plan,
made once at trace time: the kernel's parameter block, complete but for its arrays' addresses
(see `_launch.c`). The C handler is built with the package (`segcli.native`); where it was not
built, or the installed Warp changed the private API it needs (`_warp_private`), `available()`
is false, `unavailable()` says why, and the kernels go through Warp's `jax_kernel`, as they do
with SEGCLI_NATIVE_LAUNCH=0: the same kernels, the same bits.
"""

import ctypes
import functools
import threading

import jax
import numpy as np
import warp as wp

from segcli.native import LAUNCH, Unavailable, announce, load
from segcli.ops import _warp_private as private

_TARGET = "segcli_launch"
_CPU_ORDINAL = -1


def _load():
    """The handler library, loaded, with its FFI targets registered."""
    lib = load(LAUNCH)
    changed = private.changed()
    if changed:
        why = f"Warp {wp.__version__} changed its private API: {changed[0]}"
        announce(LAUNCH, why)
        raise Unavailable(why)
    lib.segcli_add_plan.restype = ctypes.c_int64
    lib.segcli_add_plan.argtypes = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_char_p,
                                    ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                                    ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32]
    lib.segcli_set_entry.restype = ctypes.c_int32
    lib.segcli_set_entry.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                     ctypes.c_int32]
    if wp.is_cuda_available():
        lib.segcli_set_cuda_launch(ctypes.c_void_p(private.cuda_launch_address()))
    for platform, handler in (("cpu", lib.segcli_launch_cpu), ("CUDA", lib.segcli_launch_cuda)):
        address = ctypes.cast(handler, ctypes.c_void_p).value
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(address), platform=platform)
    return lib


@functools.cache
def _library():
    """(the handler library, None), or (None, why it cannot be had)."""
    try:
        return _load(), None
    except Unavailable as err:
        return None, str(err)


def available():
    """Whether launches go through the C handler."""
    return _library()[0] is not None


def unavailable():
    """Why launches go through Warp's `jax_kernel` instead (None where they do not)."""
    return _library()[1]


class _Plan:
    """One kernel launch: its parameter block, complete but for its arrays' addresses, and
    the FFI call's result types and aliases (in-out arrays first, then the pure outputs)."""

    def __init__(self, kernel, operands, dims, in_out, out, block_dim):
        self.dims = (dims,) if isinstance(dims, int) else tuple(dims)
        self.kernel, self.block_dim = kernel, block_dim
        array_t = private.array_struct()
        args = [private.ffi_arg(a.label, a.type, a.label in in_out) for a in kernel.adj.args]
        shapes = out if isinstance(out, dict) else {"out": out}
        pure = [arg for arg in args if arg.name in shapes and not arg.in_out]
        inputs = iter(operands)
        self.arrays, self.results, self.aliases = [], [], {}
        fields, values, sources = [], {}, {}
        for arg in args:
            if arg in pure:
                values[arg.name] = private.output_type(arg, shapes[arg.name])
                fields.append((arg.name, array_t))
                continue
            value = next(inputs)
            if not arg.is_array:
                values[arg.name] = private.scalar_type(arg.type)(value)
                fields.append((arg.name, type(values[arg.name])))
                continue
            if arg.in_out:
                self.aliases[len(self.arrays)] = len(self.results)
                self.results.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
            sources[arg.name], values[arg.name] = (0, len(self.arrays)), value
            self.arrays.append(value)
            fields.append((arg.name, array_t))
        for arg in pure:  # pure outputs follow the in-out ones
            sources[arg.name] = (1, len(self.results))
            self.results.append(values[arg.name])

        kernel.module.get_module_hash(block_dim)  # analyses the kernel (its tid() dimensions)
        bounds = private.launch_bounds(self.dims, kernel, block_dim)
        args_struct = type("Args", (ctypes.Structure,), {"_fields_": fields})
        block_struct = type("Block", (ctypes.Structure,),
                            {"_fields_": [("bounds", type(bounds)), ("args", args_struct)]})
        block = block_struct(bounds=bounds)
        self.args_offset = block_struct.args.offset
        self.holes, self.params, self.size = [], [block_struct.bounds.offset], bounds.size
        for arg in args:
            offset = self.args_offset + getattr(args_struct, arg.name).offset
            self.params.append(offset)
            if arg.name in sources:
                shape = values[arg.name].shape[: arg.warp_ndim]
                setattr(block.args, arg.name, array_t(0, 0, arg.warp_ndim, shape,
                                                      private.strides(shape, arg.type.dtype)))
                self.holes.extend((offset + array_t.data.offset, *sources[arg.name]))
            else:
                setattr(block.args, arg.name, values[arg.name])
        self.block = bytes(block)

    def key(self):
        return self.kernel, self.block_dim, self.block, tuple(self.holes)


class _Registry:
    """The plans registered in the library, by content; each kernel's entry points are loaded
    on the default backend's devices as its plan is registered, on others when XLA first
    launches it there."""

    def __init__(self, lib):
        self.lib, self.ids, self.kernels, self.lock = lib, {}, {}, threading.RLock()
        self.resolver = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int32)(
            self._resolve)  # kept alive with the registry
        lib.segcli_set_resolve(ctypes.cast(self.resolver, ctypes.c_void_p))

    def plan_id(self, plan):
        key = plan.key()
        with self.lock:
            if key not in self.ids:
                holes = np.asarray(plan.holes, np.int32)
                params = np.asarray(plan.params, np.int32)
                plan_id = self.lib.segcli_add_plan(
                    plan.size, int(plan.kernel.grid_stride), plan.block, len(plan.block),
                    plan.args_offset, holes.ctypes.data, len(holes) // 3, params.ctypes.data,
                    len(params))
                if plan_id < 0:
                    raise RuntimeError(f"cannot plan a launch of {plan.kernel.key}: 2^20 plans "
                                       f"made, or a parameter block of {len(plan.block)} bytes "
                                       "(the handler holds 4096 bytes)")
                self.ids[key], self.kernels[plan_id] = plan_id, (plan.kernel, plan.block_dim)
                for device in _default_devices():
                    self._set_entry(plan_id, device)
            return self.ids[key]

    def _set_entry(self, plan_id, device):
        kernel, block_dim = self.kernels[plan_id]
        module = private.ffi_module(kernel.module, device, block_dim)
        hooks = module.get_kernel_hooks(kernel)
        function = ctypes.cast(hooks.forward, ctypes.c_void_p)
        if device.is_cpu:
            self.lib.segcli_set_entry(plan_id, _CPU_ORDINAL, None, function, 1, 0, 0)
        else:
            self.lib.segcli_set_entry(plan_id, device.ordinal, device.context, function,
                                      module.block_dim, hooks.cluster_dim,
                                      hooks.forward_smem_bytes)

    def _resolve(self, plan_id, ordinal):
        try:
            with self.lock:
                device = (wp.get_device("cpu") if ordinal == _CPU_ORDINAL
                          else wp.get_cuda_device(ordinal))
                self._set_entry(plan_id, device)
        except Exception:  # noqa: BLE001 - the handler reports the kernel missing
            return -1
        return 0


@functools.cache
def _default_devices():
    """The Warp devices of JAX's default backend (a CPU without Warp's CPU backend: none)."""
    if jax.default_backend() == "cpu":
        return (wp.get_device("cpu"),) if wp.is_cpu_available() else ()
    return tuple(wp.get_cuda_device(d.local_hardware_id) for d in jax.local_devices())


@functools.cache
def _registry():
    return _Registry(_library()[0])


def launch(kernel, operands, dims, in_out, out, block_dim):
    """kernel(*operands) over `dims` threads (`block_dim` a block on a GPU) as one FFI call:
    a list of the in-out arrays' updated copies, then the pure outputs: "out" shaped `out`, or
    those `out` names {name: shape}."""
    plan = _Plan(kernel, operands, dims, in_out, out, block_dim)
    call = jax.ffi.ffi_call(_TARGET, plan.results, input_output_aliases=plan.aliases,
                            vmap_method="sequential")
    return call(*plan.arrays, plan=np.int64(_registry().plan_id(plan)))
