"""JAX primitives over the Warp kernels: each impl and shape rule beside its primitive, and
one table of differentiation rules.

The float primitives are linear or bilinear in their float operands, so the JVP of each is
the sum of the primitive applied with one operand replaced by its tangent, and its transpose
with respect to each operand is another primitive of the set:

    sum(x)         x ↦ gather(ct)                     (segment sum ↔ broadcast back)
    mean(x)        x ↦ gather(ct / count)
    gather(y)      y ↦ sum(ct)
    dot(x, y)      x ↦ scale(y, ct)      y ↦ scale(x, ct)
    scale(x, y)    x ↦ scale(ct, y)      y ↦ dot(ct, x)
    matvec(v, m)   v ↦ matvecᵀ(ct, m)    m ↦ outer(v, ct)   (matvec: v @ m per row; matvecᵀ: v @ mᵀ)
    matvecᵀ(v, m)  v ↦ matvec(ct, m)     m ↦ outer(ct, v)
    outer(a, b)    a ↦ matvecᵀ(b, ct)    b ↦ matvec(a, ct)
    rescale(x, y, z)     x ↦ rescale(ct, y, z)    y, z ↦ scaled_dot(x, ct, ·)   (x·y·z per row)
    rescale2(x, b, y, z, w)   x·y·z + b·y·w per row in one kernel, each product as rescale's
    variance_tangent(x, y)     x ↦ variance_cotangent(y, ct)   y ↦ variance_cotangent(x, ct)
    variance_cotangent(x, c)   x ↦ variance_cotangent(ct, c)   c ↦ variance_tangent(x, ct)
                               (2 Σ (x - mean) y / count; (x - mean) · 2 c / count per row)
    std_tangent(x; y)          y ↦ std_cotangent(x; ct)      (x ↦ by its formula)
    std_cotangent(x; c)        c ↦ std_tangent(x; ct)        (x ↦ std_curvature(x; dx, c))
    std_curvature(x; a, c)     a ↦ std_curvature(x; ct, c)   c ↦ sum(ct · std_curvature(x; a, 1))
                               (linear in the operands after x; their JVP in x as in brackets)

JAX derives every higher derivative, forward or reverse, from these rules. `rms_norm` (the
RMS norm of each segment, in one pass over the rows) has no rule: segcli.ops differentiates
it through a custom JVP built of the others, whose tangent map and that map's derivative are
`custom_transposed` primitives, composites of the others with a transpose of their own (so
that a second derivative adds its two rescales of the rows in one rescale2 kernel).
`reductions` gives several of sum, mean, rms_norm and max_norm of one array (on CPUs by one
kernel); segcli.ops differentiates each through its own primitive. `moments` (each segment's
mean and variance) and `exp_sums` (its largest value and sum of shifted exponentials) take
both passes over a segment in one kernel and have no rule either: segcli.ops differentiates
var by variance_tangent (whose derivatives are then one kernel each), std by `std_tangent`
(a custom_transposed primitive transposed into `std_cotangent`, whose JVP in x is
`std_curvature`, std's weighted second derivative), logsumexp through a custom JVP built of
sum and softmax. `softmax` has its JVP beside it: `softmax_tangent`, a custom_transposed
primitive that is its own transpose, and whose JVP in x is `softmax_curvature` (softmax's
second derivative, bilinear, its own transpose in each operand). On GPUs each of var's,
std's and softmax's derivatives is one kernel where the ids are ordered. The other
primitives give integers, so no derivative: `extreme` (the first row attaining each
segment's max, min or max norm, through which the ops differentiate), `count` and
`bincount`. Batching folds a vmapped axis into axis 1 of every float operand (the feature or
group axis), which keeps the segment ids and their order; vmapped ids fall back to a loop
over the batch.

Operands are the data arrays followed by int32 ids and int32 offsets: the segments' CSR
offsets (M+1,) when the caller has them (the ids then non-decreasing), else an empty array and
the reductions find them; parameters are `num_segments` (the length of the segment axis) and
`indices_are_sorted`, and matvec's `transpose` (matvecᵀ above), extreme's `kind` and
bincount's `length`.
"""

from segcli.ops._primitives._common import (
    at_rows,
    custom_transposed,
    ids_known_sorted,
    lower_cpu_as_gpu,
    segment_ids_of,
)
from segcli.ops._primitives.gathers import (
    put_p,
    take_p,
)
from segcli.ops._primitives.moments import (
    moments_p,
    std_cotangent_p,
    std_curvature_p,
    std_tangent_p,
    variance_cotangent_p,
    variance_tangent_p,
)
from segcli.ops._primitives.norms import (
    power_of_two,
    rms_norm_cotangent_p,
    rms_norm_curvature_rows_p,
    rms_norm_p,
    scaled_norms,
)
from segcli.ops._primitives.reductions import (
    bincount_p,
    count,
    count_p,
    dot_p,
    gather_p,
    matvec_p,
    mean_p,
    outer_p,
    rescale2_p,
    rescale_p,
    scale_p,
    scaled_dot_p,
    sum_p,
)
from segcli.ops._primitives.searches import (
    REDUCTIONS,
    extreme_p,
    max_norm_p,
    reductions_p,
)
from segcli.ops._primitives.softmax import (
    exp_sums_p,
    softmax_curvature_p,
    softmax_p,
    softmax_tangent_p,
)

__all__ = [
    "REDUCTIONS",
    "at_rows",
    "bincount_p",
    "count",
    "count_p",
    "custom_transposed",
    "dot_p",
    "exp_sums_p",
    "extreme_p",
    "gather_p",
    "ids_known_sorted",
    "lower_cpu_as_gpu",
    "matvec_p",
    "max_norm_p",
    "mean_p",
    "moments_p",
    "outer_p",
    "power_of_two",
    "put_p",
    "reductions_p",
    "rescale2_p",
    "rescale_p",
    "rms_norm_cotangent_p",
    "rms_norm_curvature_rows_p",
    "rms_norm_p",
    "scale_p",
    "scaled_dot_p",
    "scaled_norms",
    "segment_ids_of",
    "softmax_curvature_p",
    "softmax_p",
    "softmax_tangent_p",
    "std_cotangent_p",
    "std_curvature_p",
    "std_tangent_p",
    "sum_p",
    "take_p",
    "variance_cotangent_p",
    "variance_tangent_p",
]
