"""Every op, its gradient where it is differentiable and its JVP and second derivative where
those launch kernels of their own, and segmented_reductions, with Warp's bounds checks on (its
debug mode) and the GPU's (or the CPU's) code paths lowered on this CPU: ids out of range,
unsorted, sorted and promised sorted, and a Segments; float32 and float64. A kernel reading or
writing outside an array aborts here, where on a GPU it is an illegal address. Run by
tests/ops/test_ops.py::test_kernels_stay_in_bounds."""

import sys

import warp as wp

wp.config.mode = "debug"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from batch_reference import random_args  # noqa: E402

from segcli import ops  # noqa: E402
from segcli.ops import _primitives  # noqa: E402
from segcli.registry import OPS  # noqa: E402

# ops whose JVP or second derivative launches a kernel the gradient does not (on the GPU's
# paths: rms_norm's, var's variance_tangent, std's std_tangent and std_curvature, softmax's
# softmax_curvature)
SECOND_ORDER = {"rms_norm", "var", "std", "softmax"}


def check(op, layout, promise, dtype):
    """The op, and its derivatives, over `layout` (ids or a Segments) in `dtype`."""
    rows = inside.size if isinstance(layout, ops.Segments) else n
    args = tuple(jnp.asarray(a) for a in random_args(rng, op, rows, m, (3,), dtype))

    def call(*a):
        return op.apply(*a, idx=layout, num_segments=m, indices_are_sorted=promise, **op.params)

    def grad(a):
        return jax.grad(lambda a: jnp.sum(jnp.nan_to_num(call(a, *args[1:]))))(a)

    jax.block_until_ready(call(*args))
    if op.differentiable:
        jax.block_until_ready(grad(args[0]))
    if op.name in SECOND_ORDER:
        jax.block_until_ready(jax.jvp(lambda a: call(a, *args[1:]), args[:1], args[:1]))
        jax.block_until_ready(jax.grad(lambda a: jnp.vdot(jnp.nan_to_num(grad(a)), a))(args[0]))


jax.config.update("jax_enable_x64", True)
gpu = sys.argv[1] == "gpu"
_primitives.lower_cpu_as_gpu(gpu)
rng = np.random.default_rng(5)
n, m = 300, 20
ids = rng.integers(-2, m + 3, n).astype(np.int32)
inside = np.sort(ids[(ids >= 0) & (ids < m)])
layouts = [(ids, False), (np.sort(ids), False), (np.sort(ids), True),
           (ops.segments(np.bincount(inside, minlength=m)), False)]
for layout, promise in layouts:
    for dtype in (np.float32, np.float64):
        for op in OPS.values():
            check(op, layout, promise, dtype)
        rows = inside.size if isinstance(layout, ops.Segments) else n  # reductions together
        x = jnp.asarray(rng.normal(size=(rows, 3)).astype(dtype))
        jax.block_until_ready(ops.segmented_reductions(x, layout, m, ops.REDUCTIONS,
                                                       indices_are_sorted=promise))
if gpu:  # float32 norms over sorted ids by their two kernels, which long inputs take
    _primitives.norms.SQUARES_ROWS = 0
    jax.clear_caches()
    for layout, promise in layouts:
        check(OPS["rms_norm"], layout, promise, np.float32)
print("in bounds")
