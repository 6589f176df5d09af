"""Run every op of the registry, forward and backward (to second order), with ids -1, M and
2**31 - 1, sorted and unsorted, on rows of 3 (the vec3 kernels) and of 2 x 4 (the generic
ones).

Meant to run under `compute-sanitizer --tool memcheck python tests/support/gpu_memcheck.py` on a GPU
(the sanitizer reports any read or write outside an array); prints OK when every op ran.
"""

import jax
import jax.numpy as jnp
import numpy as np
from batch_reference import random_args

from segcli.registry import OPS

N, M = 257, 9


def run(op, args, idx):
    """The op's value, gradient and second derivative (along the arguments themselves)."""
    def f(*a):
        out = op.apply(*a, idx=idx, num_segments=M)
        return jnp.where(jnp.isfinite(out), out, 0)  # max of an empty segment: -inf

    jax.block_until_ready(f(*args))
    if op.differentiable:
        argnums = tuple(range(len(args)))
        grad = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums)
        second = jax.grad(lambda *a: sum(jnp.vdot(d, x) for d, x in zip(grad(*a), args)), argnums)
        jax.block_until_ready((grad(*args), second(*args)))


rng = np.random.default_rng(0)
bad = np.array([-1, M, 2**31 - 1], np.int32)
for ordered in (True, False):
    idx = rng.integers(0, M, N).astype(np.int32)
    idx[rng.choice(N, 12, replace=False)] = np.tile(bad, 4)
    if ordered:
        idx = np.sort(idx)
    for op in OPS.values():
        for features in [(3,), (2, 4)] if any(a.shape is None for a in op.inputs) else [(3,)]:
            args = tuple(jnp.asarray(a) for a in random_args(rng, op, N, M, features, np.float32))
            run(op, args, jnp.asarray(idx))
print("OK", jax.devices())
