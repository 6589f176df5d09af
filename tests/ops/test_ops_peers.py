"""segcli.ops where its peers' own test suites (jraph's utils tests, JAX's jax.ops.segment_*
tests) pin it down: a mean rounded once (sum / count), its overflow fallback, empty segments,
dropped ids and integer dtypes against exact NumPy references, and every op's derivatives
under JAX's strict NumPy rules, on the CPU's code paths and on the GPU's (run on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segcli import ops
from segcli.ops import _primitives

pytestmark = pytest.mark.usefixtures("x64", "strict_numpy")


@pytest.fixture(params=["cpu_paths", "gpu_paths"])
def code_paths(request):
    """The CPU's code paths, or the GPU's (many-thread atomics, no vec3 kernels) on the CPU."""
    _primitives.lower_cpu_as_gpu(request.param == "gpu_paths")
    yield request.param
    _primitives.lower_cpu_as_gpu(False)


def id_layouts(n):
    """(name, idx for segmented_mean, indices_are_sorted, rows of segment 1) for n rows all in
    segment 1 of 3: promised sorted, a Segments, sorted found at run time, and unsorted (the
    atomic path: rows of segments 0 and 2 interleaved)."""
    ones = np.ones(n, np.int32)
    mixed = np.concatenate([[0], ones[: n // 2], [2], ones[n // 2:], [0]]).astype(np.int32)
    return [("promised", ones, True), ("segments", ops.segments(np.array([0, n, 0])), False),
            ("found", ones, False), ("unsorted", mixed, False)]


@pytest.mark.parametrize("dtype,values", [(np.float32, [1, 6, 7]), (np.float64, [3, 4, 5])])
def test_mean_is_the_sum_over_the_count_rounded_once(code_paths, dtype, values):
    """mean([1, 6, 7]) in float32 is float32(14) / float32(3) = 4.6666665 (not 4.666667) and
    mean([3, 4, 5]) in float64 is 4.0 (not 3.9999999999999996), on every path: rows of one
    feature and of 3 (CPUs' vec3 kernels), and segmented_reductions."""
    expected = dtype(sum(values)) / dtype(len(values))
    for features in [(), (3,)] if code_paths == "cpu_paths" else [(3,)]:  # GPUs: no vec3 kernel
        x = np.array(values, dtype).reshape(-1, *(1,) * len(features)) * np.ones(features, dtype)
        for name, idx, promised in id_layouts(len(values)):
            rows = x if isinstance(idx, ops.Segments) else _spread(x, idx)
            got = np.asarray(ops.segmented_mean(rows, idx, 3, indices_are_sorted=promised))
            assert got.dtype == dtype
            np.testing.assert_array_equal(got[1], np.full(features, expected), err_msg=name)
            if name in ("promised", "unsorted"):  # segments 0 and 2: their own means
                np.testing.assert_array_equal(got[[0, 2]], _numpy_means(rows, idx, 3)[[0, 2]])
        together = ops.segmented_reductions(x, ops.segments(np.array([0, len(values)])), 2,
                                            ("sum", "mean"))
        np.testing.assert_array_equal(np.asarray(together[1])[1], np.full(features, expected))


def _spread(x, idx):
    """Rows for ids `idx`: x's rows where the id is 1, others (distinct values) elsewhere."""
    rows = np.empty((len(idx), *x.shape[1:]), x.dtype)
    rows[idx == 1] = x
    rows[idx != 1] = np.arange(1, 1 + np.count_nonzero(idx != 1)).reshape(
        -1, *(1,) * (x.ndim - 1)) * 0.25
    return rows


def _numpy_means(x, idx, m):
    """Each segment's sum in float64, divided by its count once, rounded to x's dtype."""
    out = np.zeros((m, *x.shape[1:]))
    for s in range(m):
        if np.any(idx == s):
            out[s] = x[idx == s].astype(np.float64).sum(axis=0) / np.count_nonzero(idx == s)
    return out.astype(x.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_whose_sum_overflows_is_finite_and_exact(code_paths, dtype):
    """Values near the float max: the plain sum overflows, the mean does not and is within
    rounding of NumPy's long double mean, and so is its tangent (the mean is linear); a segment
    holding inf stays inf, one with NaN NaN; the other segments are divided once."""
    big = np.finfo(dtype).max * dtype(0.9)
    order = [0, 4, 1, 5, 2, 7, 3, 6, 8]
    for features in [(), (3,)]:
        shape = (1,) * len(features)
        x = np.array([big, big, -big, big, 1, np.inf, big, big, np.nan], dtype).reshape(
            -1, *shape) * np.ones(features, dtype)
        ids = np.array([0, 0, 0, 0, 1, 2, 2, 3, 3])
        expected = np.array([np.longdouble(big) / 2, 1, np.inf, np.nan]).reshape(-1, *shape)
        expected = np.broadcast_to(expected, (4, *features)).astype(dtype)
        for rows, idx, promised in [(x, ids, True), (x[order], ids[order], False)]:
            def mean(v, idx=idx, promised=promised):
                return ops.segmented_mean(v, idx, 4, indices_are_sorted=promised)

            got, tangent = jax.jvp(mean, (rows,), (rows,))
            np.testing.assert_allclose(np.asarray(got), expected, rtol=np.finfo(dtype).eps)
            np.testing.assert_array_equal(np.asarray(tangent), np.asarray(got))
    mixed = ops.segmented_mean(np.array([1, 6, 7, big, big], dtype), np.array([0, 0, 0, 1, 1]), 2)
    np.testing.assert_array_equal(np.asarray(mixed), np.array([dtype(14) / dtype(3), big], dtype))


def test_mean_derivatives_are_those_of_sum_over_count():
    """The gradient of f(mean) is f'(mean) / count on each row of the segment, its second
    derivative f''(mean) / count² between rows of one segment (forward over reverse)."""
    x = np.array([1.0, 6.0, 7.0, 2.0, 5.0])
    idx = np.array([1, 1, 1, 0, 2])

    def total(v):
        return jnp.sum(jnp.sin(ops.segmented_mean(v, idx, 3)))

    means, counts = np.array([2.0, 14 / 3, 5.0]), np.array([1.0, 3.0, 1.0])
    np.testing.assert_allclose(np.asarray(jax.grad(total)(x)), (np.cos(means) / counts)[idx],
                               rtol=1e-15)
    hessian = np.asarray(jax.jit(jax.hessian(total))(x))
    same = idx[:, None] == idx[None, :]
    np.testing.assert_allclose(hessian, np.where(same, (-np.sin(means) / counts**2)[idx], 0),
                               rtol=1e-14, atol=1e-300)


def test_max_min_and_max_norm_derivatives_under_strict_rank_promotion(code_paths):
    """Rows of several groups of features, where max's, min's and max_norm's gradients once
    broadcast the chosen rows (M, G) against (G,), which raised under JAX's strict rank
    promotion: the gradient goes to the first row attaining each component's extreme (max_norm:
    that row's unit vector), and the second derivative is that of NumPy's formula."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 2, 3))
    idx = np.array([0, 0, 2, 2, 2, 3, 5])
    for name, pick in (("max", np.argmax), ("min", np.argmin)):
        op = getattr(ops, f"segmented_{name}")
        grad, hvp = jax.jit(lambda v, op=op: jax.jvp(jax.grad(
            lambda w: jnp.sum(op(w, idx, 4) ** 3)), (v,), (v,)))(x)
        chosen = np.zeros_like(x)
        for s in range(4):
            rows = np.flatnonzero(idx == s)
            for g in range(2):
                for k in range(3):
                    if rows.size:
                        i = rows[pick(x[rows, g, k])]
                        chosen[i, g, k] = x[i, g, k]
        np.testing.assert_allclose(np.asarray(grad), 3 * chosen**2, rtol=1e-14)
        np.testing.assert_allclose(np.asarray(hvp), 6 * chosen**2, rtol=1e-14)
    grad = np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(ops.segmented_max_norm(v, idx, 4))))(x))
    norms = np.linalg.norm(x.reshape(7, -1), axis=1)
    expected = np.zeros_like(x)
    for s in (0, 2, 3):
        rows = np.flatnonzero(idx == s)
        i = rows[np.argmax(norms[rows])]
        expected[i] = x[i] / norms[i]
    np.testing.assert_allclose(grad, expected, rtol=1e-14)


def test_peer_cases_of_max_and_min(code_paths):
    """jraph's own cases of max and min: integers in their own dtype, an empty segment their
    dtype's bounds, ids out of range (negative too) dropped, sorted ids promised, unique
    unsorted ids."""
    data = np.arange(9, dtype=np.int32)
    ids = np.array([0, 1, 2, 0, 4, 0, 1, 1, -6])
    low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    for promised, (x, idx, m, top, bottom) in [
        (False, (data, ids, 6, [5, 7, 2, low, 4, low], [0, 1, 2, high, 4, high])),
        (True, (data, np.array([0, 0, 0, 1, 1, 1, 2, 3, 4]), 6, [2, 5, 6, 7, 8, low],
                [0, 3, 6, 7, 8, high])),
        (False, (data[:6], np.array([1, 0, 2, 4, 3, -5]), 5, [1, 0, 2, 4, 3], [1, 0, 2, 4, 3])),
    ]:
        for op, expected in ((ops.segmented_max, top), (ops.segmented_min, bottom)):
            got = op(x, idx, m, indices_are_sorted=promised)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(np.asarray(got), expected)


def test_peer_cases_of_sums_means_booleans_and_nan():
    """JAX's and jraph's cases: integers summed in their own dtype with ids out of range
    (either side) dropped, booleans reduced as jax.ops reduces them (any, all; empty False and
    True), a NaN spreading only through its segment, empty segments 0 for the mean and ∓inf
    for max and min, and a sum over no valid id with its zero gradient."""
    got = ops.segmented_sum(np.array([5, 1, 7, 2, 3, 4, 1, 3], np.int8),
                            np.array([0, 4, 8, 1, 2, -6, -1, 3]), 4)
    assert got.dtype == np.int8
    np.testing.assert_array_equal(np.asarray(got), [5, 2, 3, 3])
    flags, flag_ids = np.array([True, False, False, True, False]), np.array([0, 0, 1, 3, 3])
    for op, expected in ((ops.segmented_max, [True, False, False, True]),  # empty: False
                         (ops.segmented_min, [False, False, True, False]),  # empty: True
                         (ops.segmented_sum, [True, False, False, True])):
        got = op(flags, flag_ids, 4)
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(np.asarray(got), expected)
    floats = np.arange(9, dtype=np.float32)
    floats[0] = np.nan
    ids = np.array([0, 1, 2, 0, 4, 0, 1, 1, 0])
    mean = np.asarray(ops.segmented_mean(floats, ids, 6))
    np.testing.assert_array_equal(mean, np.array(
        [np.nan, np.float32(14) / np.float32(3), 2, 0, 4, 0], np.float32))
    assert np.isneginf(np.asarray(ops.segmented_max(floats, ids, 6))[[3, 5]]).all()
    assert np.isposinf(np.asarray(ops.segmented_min(floats, ids, 6))[[3, 5]]).all()
    softmax = np.asarray(ops.segmented_softmax(floats, ids, 6))
    assert np.isnan(softmax[ids == 0]).all() and not np.isnan(softmax[ids != 0]).any()
    value, grad = jax.value_and_grad(lambda v: jnp.sum(ops.segmented_sum(v, np.array([2, 3]), 2)))(
        np.zeros(2, np.float32))
    assert float(value) == 0 and np.all(np.asarray(grad) == 0)


def test_unsigned_32_bit_integers_with_and_without_x64():
    """uint32 above 2³¹ (JAX's segment tests draw them): max and min in uint32's own order,
    empty segments 0 and 2³² - 1, sums wrapping as uint32's do, with JAX's 64-bit mode on and
    off (where no int64 can hold them)."""
    x = np.array([3_000_000_000, 5, 7, 0, 2**32 - 1, 2**31], np.uint32)
    idx = np.array([0, 0, 1, 3, 3, 3])
    top = 2**32 - 1
    expected = {ops.segmented_max: [3_000_000_000, 7, 0, top],
                ops.segmented_min: [5, 7, top, 0],
                ops.segmented_sum: [3_000_000_005, 7, 0, (top + 2**31) % 2**32]}
    try:
        for x64 in (False, True):
            jax.config.update("jax_enable_x64", x64)
            for op, values in expected.items():
                for promised in (False, True):
                    got = op(x, idx, 4, indices_are_sorted=promised)
                    assert got.dtype == np.uint32
                    np.testing.assert_array_equal(np.asarray(got), values)
    finally:
        jax.config.update("jax_enable_x64", True)
