"""segcli: per-structure segment reductions and their derivatives on Warp kernels through JAX."""

__version__ = "0.1.0"

_LAZY = {
    "reduce": "segcli.api",
    "grad": "segcli.api",
    "neighbors": "segcli.api",
    "Results": "segcli.api",
    "stats": "segcli.api",
    "fit_e0": "segcli.api",
    "select": "segcli.api",
    "Statistics": "segcli.api",
    "convert": "segcli.api",
    "merge": "segcli.api",
    "open": "segcli.api",
    "Batch": "segcli.api",
    "check_ops": "segcli.api",
    "OpsCheck": "segcli.api",
    "DataError": "segcli.errors",
    "ArgumentError": "segcli.errors",
}
"""The names `segcli.NAME` gives, each imported from its module when first asked for, so that
`import segcli` (and the command line's start) stays light."""


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'segcli' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])


def cache_directory():
    """segcli's directory of kept files (JAX's compiled programs):
    $XDG_CACHE_HOME/segcli, that is ~/.cache/segcli by default."""
    import os

    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "segcli")


def keep_freed_buffers():
    """Have glibc's malloc keep freed blocks of up to 256 MiB for reuse, rather than unmap
    them: XLA's CPU client allocates every output afresh, and on a VM the page faults of a
    fresh 48 MiB block cost about 35 ms a chunk, five times the kernel (benchmarks/RESULTS.md).
    Process-wide, so for the segcli program and its local clusters' workers only (see
    cli.common.as_program and cluster.dask_setup), not for library users; nothing without
    glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return
    mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
