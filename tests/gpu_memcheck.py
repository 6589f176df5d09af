"""Run every op, forward and backward, with ids -1, M and 2**31 - 1, sorted and unsorted, on
rows of 3 (the vec3 kernels) and of 2 x 4 (the generic ones).

Meant to run under `compute-sanitizer --tool memcheck python tests/gpu_memcheck.py` on a GPU
(the sanitizer reports any read or write outside an array); prints OK when every op ran.
"""

import jax
import jax.numpy as jnp
import numpy as np

from segcli import ops

N, M = 257, 9
rng = np.random.default_rng(0)
bad = np.array([-1, M, 2**31 - 1], np.int32)
for ordered in (True, False):
    idx = rng.integers(0, M, N).astype(np.int32)
    idx[rng.choice(N, 12, replace=False)] = np.tile(bad, 4)
    if ordered:
        idx = np.sort(idx)
    idx = jnp.asarray(idx)
    x, y = (jnp.asarray(rng.normal(size=(N, 3)), jnp.float32) for _ in range(2))
    wide, wide_y = (jnp.asarray(rng.normal(size=(N, 2, 4)), jnp.float32) for _ in range(2))
    s, cells = jnp.asarray(rng.normal(size=M), jnp.float32), jnp.asarray(rng.normal(size=(M, 3, 3)), jnp.float32)
    calls = {
        "sum": lambda a: ops.segmented_sum(a, idx, M),
        "mean": lambda a: ops.segmented_mean(a, idx, M),
        "dot": lambda a: ops.segmented_dot(a, y, idx, M),
        "mul": lambda a: ops.segmented_mul(a, s, idx, M),
        "rms_norm": lambda a: ops.segmented_rms_norm(a, idx, M),
        "max_norm": lambda a: ops.segmented_max_norm(a, idx, M),
        "matvec": lambda a: ops.segmented_matvec(a, cells, idx, M),
    }
    for name, f in calls.items():
        grad = jax.grad(lambda a: jnp.sum(f(a) ** 2))
        jax.block_until_ready((f(x), grad(x), jax.grad(lambda a: jnp.vdot(grad(a), y))(x)))
        if name not in ("dot", "matvec"):
            jax.block_until_ready((f(wide), grad(wide), jax.grad(lambda a: jnp.vdot(grad(a), wide_y))(wide)))
    jax.block_until_ready(ops.segmented_dot(wide, wide_y, idx, M))
    jax.block_until_ready(jax.grad(lambda c: jnp.sum(ops.segmented_matvec(x, c, idx, M) ** 2))(cells))
    jax.block_until_ready(ops.segmented_count(idx, M))
print("OK", jax.devices())
