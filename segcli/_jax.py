"""The parts of JAX's API that differ between the releases segcli runs on: from JAX 0.6 (the
last for Python 3.10) to the newest."""

import jax

try:
    enable_x64 = jax.enable_x64
except AttributeError:  # JAX < 0.7
    from jax.experimental import enable_x64

__all__ = ["enable_x64"]
