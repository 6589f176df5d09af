"""Differentiable segment ops over batches of atomic systems, computed by Warp kernels.

Every function takes per-atom arrays with a leading axis of N rows, segment ids `idx` of
shape (N,) (int32 or int64) or a `Segments` (sorted ids and their offsets, built once and
reused: no op then looks for the offsets), and a static `num_segments` M, and works under `jax.jit`,
`jax.vmap`, `jax.grad`, `jax.jvp`, `jax.jacfwd`, `jax.jacrev`, `jax.hessian` and `lax.scan`,
to any order, on the CPU and on CUDA GPUs. Called eagerly, each is one dispatch of a jitted
program, compiled on the first call of its shapes, dtypes and static arguments.

Semantics shared by all functions:

* Ids outside ``[0, num_segments)`` are dropped by reductions and give 0 in gathers
  (`segmented_mul`, `segmented_matvec`), as ``jax.ops.segment_sum`` does; no id, however
  wrong, reads or writes outside an array.
* ``indices_are_sorted=True`` promises non-decreasing ids and skips checking it; results are
  undefined if the promise is false. Non-decreasing ids (whether promised or detected) are
  reduced in a fixed order, so results are bitwise repeatable; other ids use atomics.
* float32 and float64 compute natively; float16 and bfloat16 accumulate in float32 and are
  returned in their own dtype.
* An empty segment gives 0 in sum, mean, dot, var, std, rms_norm, max_norm, count and
  bincount; -inf in max and logsumexp and +inf in min (for integers: their dtype's smallest
  and largest values), as ``jax.ops.segment_max``/``segment_min`` give.
* `segmented_rms_norm` and `segmented_max_norm` have gradient 0 where the norm is 0, and
  `segmented_max_norm` sends its gradient to the first row attaining the max.
* `segmented_mean`, `segmented_rms_norm` and `segmented_max_norm` are finite wherever their
  exact values are, up to the float max (no sum or square on the way overflows), and so are
  their derivatives.
"""

from segcli.ops._common import (
    REDUCTIONS,
    Segments,
)
from segcli.ops._gathers import (
    segmented_matvec,
    segmented_mul,
)
from segcli.ops._layout import (
    check_segments,
    segment_ids,
    segments,
    segments_of_offsets,
)
from segcli.ops._moments import (
    segmented_std,
    segmented_var,
)
from segcli.ops._norms import (
    segmented_max_norm,
    segmented_reductions,
    segmented_rms_norm,
)
from segcli.ops._reductions import (
    segmented_bincount,
    segmented_count,
    segmented_dot,
    segmented_mean,
    segmented_sum,
)
from segcli.ops._searches import (
    segmented_max,
    segmented_min,
)
from segcli.ops._softmax import (
    segmented_logsumexp,
    segmented_softmax,
)

__all__ = [
    "REDUCTIONS",
    "Segments",
    "check_segments",
    "segment_ids",
    "segmented_bincount",
    "segmented_count",
    "segmented_dot",
    "segmented_logsumexp",
    "segmented_matvec",
    "segmented_max",
    "segmented_max_norm",
    "segmented_mean",
    "segmented_min",
    "segmented_mul",
    "segmented_reductions",
    "segmented_rms_norm",
    "segmented_softmax",
    "segmented_std",
    "segmented_sum",
    "segmented_var",
    "segments",
    "segments_of_offsets",
]
