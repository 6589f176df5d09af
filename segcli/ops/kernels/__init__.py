"""Warp kernels for the segment primitives, in families, each with one table of its variants.

Shapes: rows first, then a group axis G that vmap folds into, then features (each family's
module lists its kernels'). Ids outside [0, M) are skipped by reductions and give 0 in
gathers; no id reads or writes outside an array. Reductions take `ordered`, a one-element
flag computed from the ids: when it is 1 (ids non-decreasing) each segment is reduced by one
thread (or a group of lanes) over its own CSR range in index order, so results are bitwise
repeatable; when it is 0 the kernel falls back to float atomics over a grid-stride loop into a
zero-initialised output.

A family's table (a tuple of Variant rows: op, step, device, ordering, size → Kernel) is what
the primitives dispatch on, by `pick`; `launch` runs a Kernel from JAX, making it into Warp
kernels (one per dtype) at its first launch.

>>> import jax.numpy as jnp
>>> from segcli.ops import kernels
>>> spec = kernels.pick(kernels.LAYOUT, "offsets", device="cpu")
>>> ids = jnp.array([0, 0, 1, 3], jnp.int32)
>>> kernels.launch(spec, ids, dims=(1,), out=(5,)).tolist()
[0, 2, 3, 3, 4]
"""

from segcli.ops.kernels._common import LANES, lane_grid
from segcli.ops.kernels._registry import (
    ANY,
    KERNELS,
    Kernel,
    Variant,
    cpu_available,
    launch,
    pick,
    pinned_bytes,
    stride,
)
from segcli.ops.kernels.gathers import GATHERS
from segcli.ops.kernels.layout import LAYOUT
from segcli.ops.kernels.moments import MOMENTS
from segcli.ops.kernels.neighbours import NEIGHBOURS
from segcli.ops.kernels.norms import NORMS, PLAIN_SQUARES
from segcli.ops.kernels.reductions import BINCOUNT_LANES, REDUCE_BITS, REDUCTIONS
from segcli.ops.kernels.searches import MAX_NORM_LANES, PACKED_RUN, SEARCHES
from segcli.ops.kernels.softmax import SOFTMAX

TABLES = {"layout": LAYOUT, "reductions": REDUCTIONS, "norms": NORMS, "searches": SEARCHES,
          "moments": MOMENTS, "softmax": SOFTMAX, "gathers": GATHERS, "neighbours": NEIGHBOURS}
"""Each family's table of variants, by family."""

__all__ = [
    "ANY", "BINCOUNT_LANES", "GATHERS", "KERNELS", "LANES", "LAYOUT", "MAX_NORM_LANES",
    "MOMENTS", "NEIGHBOURS", "NORMS", "PACKED_RUN", "PLAIN_SQUARES", "REDUCE_BITS", "REDUCTIONS",
    "SEARCHES", "SOFTMAX", "TABLES", "Kernel", "Variant", "cpu_available", "lane_grid", "launch",
    "pick", "pinned_bytes", "stride",
]
