"""The JAX device a run computes on, chosen as --device says, and the process settings that
JAX needs before it starts."""

import contextlib
import gc
import os

from segcli import cache_directory
from segcli.errors import ArgumentError, DataError


class _Process:
    program = False
    """Whether this process is the segcli program, which exits after one command (see
    mark_program), rather than a caller of segcli such as a notebook or a test runner."""


def mark_program():
    """Mark this process as the segcli program: it then keeps compiled programs across runs,
    gives XLA a CPU device per thread (see `device`), and keeps what it imports out of the
    garbage collector's way (see _loading)."""
    _Process.program = True


@contextlib.contextmanager
def _loading():
    """In the program, no cyclic garbage collection while the block imports, and what it made
    kept out of later collections: the modules of JAX and Warp stay for the whole run, and
    full collections traversing their objects take 0.1 s of start-up."""
    if not _Process.program:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _use_compilation_cache(jax):
    """Keep every compiled program, however small, in $SEGCLI_COMPILATION_CACHE (by default
    $XDG_CACHE_HOME/segcli/jax, that is ~/.cache/segcli/jax; `off`: nowhere), so that a later
    run skips XLA's compilation; unless JAX was given a cache of its own
    (JAX_COMPILATION_CACHE_DIR), and silently not where the directory cannot be written."""
    path = os.environ.get("SEGCLI_COMPILATION_CACHE") or os.path.join(cache_directory(), "jax")
    if path == "off" or jax.config.jax_compilation_cache_dir is not None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return
    if os.access(path, os.W_OK | os.X_OK):
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _start_gpu_backend(jax):
    """Start JAX's GPU backend (where there is one) while Warp imports: the backend's start
    waits on the CUDA driver, not on Python, so the two overlap (on an H200 VM, 0.5 s and
    1.0 s, which took 1.5 s one after the other)."""
    import threading

    def start():
        with contextlib.suppress(Exception):  # no GPU: the caller asks again and is told
            jax.devices("gpu")

    starting = threading.Thread(target=start, name="segcli-gpu-start", daemon=True)
    starting.start()
    with _loading():
        import warp  # noqa: F401  (what the kernels need next)
    starting.join()


BACKEND_ADDRESS_SPACE = 1_800_000_000
"""Bytes of address space that JAX and Warp take as they start (1.65 GB on a 2-core CPU
machine): under a tighter limit (ulimit -v) XLA aborts the process when it cannot create its
threads, rather than raise."""


def _check_address_space():
    """DataError when the limit on address space leaves too little for JAX and Warp."""
    from segcli.memory import address_space_left

    left = address_space_left()
    if left is not None and left < BACKEND_ADDRESS_SPACE:
        raise DataError(f"out of memory: JAX and Warp need about {BACKEND_ADDRESS_SPACE} bytes "
                        f"of address space, and the limit on memory (ulimit -v) leaves {left}")


def device(choice):
    """The JAX device for `choice`, auto|cpu|gpu (auto: a GPU when JAX sees one);
    ArgumentError naming `device` when there is none such.

    Called before JAX starts, it leaves GPU memory to Warp's own allocations (no
    preallocation) and lets XLA capture even a small program, such as one chunk's kernels,
    into one CUDA graph; in the program (see `mark_program`), compiled programs are kept across
    runs, and XLA has a CPU device for each thread segcli uses (threads.count(): the cores,
    or SEGCLI_THREADS; up to engine.HOST_DEVICES), which a run's chunks take turns at."""
    from segcli import threads
    from segcli.engine.program import HOST_DEVICES, runs_on

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_graph_min_graph_size" not in flags:
        flags = f"{flags} --xla_gpu_graph_min_graph_size=1"
    if _Process.program and "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={min(threads.count(), HOST_DEVICES)}"
    os.environ["XLA_FLAGS"] = flags.strip()
    _check_address_space()
    with _loading():
        import jax
    if _Process.program:
        _use_compilation_cache(jax)
    if choice != "cpu":
        _start_gpu_backend(jax)
    if choice == "cpu":
        target = jax.devices("cpu")[0]
    else:
        try:
            target = jax.devices("gpu")[0]
        except RuntimeError:
            if choice == "gpu":
                raise ArgumentError("{0}: no GPU is visible to JAX", "device") from None
            target = jax.devices("cpu")[0]
    if not runs_on(target):
        raise ArgumentError("{0}: this Warp installation has no CPU backend (warp-clang), so "
                            "its kernels run on a GPU only; choose gpu", "device")
    return target


def device_label(device):
    """How every command names a JAX device, in --device's words: `cpu`, or e.g.
    `gpu:0 (NVIDIA H200)`."""
    if device.platform == "cpu":
        return "cpu"
    return f"{device.platform}:{device.id} ({device.device_kind})"
