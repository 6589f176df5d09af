"""segcli: per-structure segment reductions and their derivatives on Warp kernels through JAX."""

__version__ = "0.1.0"
