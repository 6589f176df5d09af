"""Registers and local memory of every compiled segcli kernel in Warp's kernel cache, as the CUDA
driver reports them (run on a GPU machine after the kernels have been built, e.g. by
benchmarks/ops.py):

    python benchmarks/kernel_registers.py
"""

import ctypes
import glob
import os

import warp as wp

NUM_REGS, LOCAL_SIZE_BYTES = 4, 3  # CUfunction_attribute


def main():
    wp.init()
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    cuda.cuInit(0)
    cuda.cuDeviceGet(ctypes.byref(device), 0)
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    cuda.cuCtxSetCurrent(context)
    rows = set()
    for path in glob.glob(os.path.join(wp.config.kernel_cache_dir, "*segcli_*", "*")):
        module = ctypes.c_void_p()
        if not path.endswith((".ptx", ".cubin")) or cuda.cuModuleLoad(ctypes.byref(module),
                                                                      path.encode()):
            continue
        count = ctypes.c_uint()
        cuda.cuModuleGetFunctionCount(ctypes.byref(count), module)
        functions = (ctypes.c_void_p * count.value)()
        cuda.cuModuleEnumerateFunctions(functions, count, module)
        for function in functions:
            name, registers, local = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int()
            cuda.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(function))
            cuda.cuFuncGetAttribute(ctypes.byref(registers), NUM_REGS, ctypes.c_void_p(function))
            cuda.cuFuncGetAttribute(ctypes.byref(local), LOCAL_SIZE_BYTES,
                                    ctypes.c_void_p(function))
            if "forward" in name.value.decode():
                rows.add((registers.value, local.value, name.value.decode()))
    for registers, local, name in sorted(rows):
        print(f"{registers:4d} registers {local:6d} B local  {name}")


if __name__ == "__main__":
    main()
