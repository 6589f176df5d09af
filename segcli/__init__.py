"""segcli: per-structure segment reductions and their derivatives on Warp kernels through JAX."""

__version__ = "0.1.0"


def cache_directory():
    """segcli's directory of kept files (compiled programs, the launch handler):
    $XDG_CACHE_HOME/segcli, that is ~/.cache/segcli by default."""
    import os

    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "segcli")
