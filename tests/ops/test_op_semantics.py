"""What only some ops promise (SPEC §1b): ties, stability at extreme values, integer data,
bincount, and the values of empty segments; each against jax.ops.segment_* or NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segcli import ops
from segcli.ops import _primitives
from segcli.registry import OPS

pytestmark = pytest.mark.usefixtures("x64", "strict_numpy")


def _ids(request):
    """Ids of rows 0..7 over 4 segments (segment 2 empty, one row out of range), and a
    permutation applied to the rows for the unsorted cases (with the GPU's code paths, on
    the CPU, for "unsorted_gpu_paths")."""
    ids = np.array([0, 0, 0, 1, 1, 3, 3, 4])
    order = np.arange(8) if request.param == "sorted" else np.array([5, 0, 7, 3, 1, 6, 4, 2])
    if request.param == "unsorted_gpu_paths":
        _primitives.lower_cpu_as_gpu(True)
    yield jnp.asarray(ids[order], jnp.int32), order
    if request.param == "unsorted_gpu_paths":
        _primitives.lower_cpu_as_gpu(False)


ids = pytest.fixture(params=["sorted", "unsorted"])(_ids)
any_ids = pytest.fixture(params=["sorted", "unsorted", "unsorted_gpu_paths"])(_ids)


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.kinks == "value_ties"])
def test_extremes_tie_to_the_first_row_and_differentiate_there(any_ids, name):
    idx, order = any_ids
    # column 0 ties within segments 0 and 1 (at either extreme); column 1 has a NaN in segment 3
    x = np.array([[2.0, 1], [2, 5], [-1, 5], [7, 0], [7, 3], [1, np.nan], [1, -2], [9, 9]])
    x[:2, 0] = x[:2, 0] if name == "max" else -3
    x = jnp.asarray(x[order])
    function = OPS[name].function
    got = np.asarray(function(x, idx, 4))
    np.testing.assert_array_equal(got, OPS[name].reference(x, idx, 4))
    assert np.all(np.isinf(got[2]))
    grad = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(jnp.nan_to_num(function(x, idx, 4)))))(x))
    # the first row (in row order) of each tie gets the whole derivative, others nothing
    rows = np.asarray(idx)
    for s, column in ((0, 0), (1, 0), (0, 1)):
        members = np.flatnonzero(rows == s)
        winners = members[x[members, column] == got[s, column]]
        assert len(winners) > 1 or (s, column) == (0, 1)
        assert grad[winners[0], column] == 1 and np.all(grad[winners[1:], column] == 0)
    assert np.isnan(got[3, 1]) and np.all(grad[rows == 4] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("name", ["max", "min"])
def test_extremes_of_rows_of_three_tie_to_the_first_row_across_vector_lanes(name, dtype):
    # segments of 0 to 40 rows (whole blocks of 8 rows and tails), few distinct values (ties in
    # and across lanes and blocks), NaN in entry 1 of some rows; sorted ids, promised or found
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 41, 60)
    counts[:4] = (0, 1, 8, 9)
    ids = np.repeat(np.arange(60), counts).astype(np.int32)
    x = rng.integers(-3, 4, (len(ids), 3)).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        x[rng.choice(len(ids), 6, replace=False), 1] = np.nan
    pick = np.nanargmax if name == "max" else np.nanargmin
    bounds = ((np.iinfo(dtype).min, np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer)
              else (-np.inf, np.inf))
    expected = np.full((60, 3), bounds[name == "min"], dtype)  # an empty segment's
    winners = np.zeros((len(ids), 3))
    for s in np.flatnonzero(counts):
        rows = np.flatnonzero(ids == s)
        for e in range(3):
            values = x[rows, e].astype(np.float64)
            nans = np.flatnonzero(np.isnan(values))
            first = rows[nans[0]] if len(nans) else rows[pick(values)]
            expected[s, e] = x[first, e]
            winners[first, e] = not len(nans)
    function = getattr(ops, f"segmented_{name}")
    for promised in (True, False):
        got = function(jnp.asarray(x), jnp.asarray(ids), 60, indices_are_sorted=promised)
        np.testing.assert_array_equal(np.asarray(got), expected)
        if np.issubdtype(dtype, np.floating):
            grad = jax.grad(lambda x, promised=promised: jnp.sum(jnp.nan_to_num(
                function(x, jnp.asarray(ids), 60, indices_are_sorted=promised))))(jnp.asarray(x))
            np.testing.assert_array_equal(np.asarray(grad), winners)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.uint32, np.int64])
def test_integer_data_is_reduced_in_its_own_dtype(ids, dtype):
    idx, order = ids
    info = np.iinfo(dtype)
    rng = np.random.default_rng(3)
    x = rng.integers(info.min, info.max, size=(8, 2), dtype=dtype, endpoint=True)
    x[0, 0] = info.max  # overflow wraps in sum as jax.ops.segment_sum's does
    x = jnp.asarray(x[order])
    for op in (op for op in OPS.values() if op.integers):
        got = op.function(x, idx, 4)
        expected = op.reference(x, idx, 4)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", [name for name, op in OPS.items()
                                  if not op.integers and op.inputs and op.inputs[0].shape is None])
def test_other_ops_refuse_integer_data_naming_the_ones_that_take_it(name):
    op, rows = OPS[name], jnp.ones((3, 1))
    args = [rows.astype(jnp.int32),
            *(rows if a.per == "atom" else jnp.ones(1) for a in op.inputs[1:])]
    with pytest.raises(TypeError, match="x must be a real floating-point array, got dtype int32 "
                                        r"\(integer data: segmented_sum, _max, _min\)"):
        op.function(*args, jnp.zeros(3, jnp.int32), 1)


@pytest.mark.parametrize("dtype, big", [(np.float32, 1e4), (np.float64, 1e300)])
def test_logsumexp_and_softmax_stay_finite_at_extreme_values(ids, dtype, big):
    idx, order = ids
    x = np.array([big, big, -big, -big, big, 0.5, -0.5, 1.0], dtype)[order]
    lse = np.asarray(ops.segmented_logsumexp(jnp.asarray(x), idx, 4))
    soft = np.asarray(ops.segmented_softmax(jnp.asarray(x), idx, 4))
    assert lse.dtype == dtype and np.all(np.isfinite(np.asarray(lse)[[0, 1, 3]]))
    rows = np.asarray(idx)
    for s in (0, 1, 3):
        part = x[rows == s].astype(np.float64)
        top = part.max()
        np.testing.assert_allclose(lse[s], top + np.log(np.sum(np.exp(part - top))),
                                   rtol=1e-6 if dtype == np.float32 else 1e-14)
        np.testing.assert_allclose(soft[rows == s], np.exp(part - top) / np.sum(np.exp(part - top)),
                                   rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-30)
    assert lse[2] == -np.inf and np.all(np.asarray(soft)[rows == 4] == 0)
    grad = jax.jit(jax.grad(
        lambda x: jnp.sum(ops.segmented_logsumexp(x, idx, 4)[jnp.array([0, 1, 3])])))(
        jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(grad)[rows < 4], soft[rows < 4], rtol=1e-6)


def test_variance_is_free_of_cancellation_and_std_has_zero_derivatives_where_it_is_zero():
    x = jnp.asarray([1e8 + 1, 1e8 + 2, 1e8 + 3, 5.0, 5.0, 7.0])
    idx = jnp.asarray([0, 0, 0, 1, 1, 2])
    np.testing.assert_allclose(ops.segmented_var(x, idx, 4), [2 / 3, 0, 0, 0], rtol=1e-9)
    np.testing.assert_array_equal(ops.segmented_std(x, idx, 4)[1:], [0, 0, 0])

    def loss(x):
        return jnp.sum(ops.segmented_std(x, idx, 4))

    for derivative in (jax.grad(loss), jax.hessian(loss), jax.jacfwd(jax.hessian(loss))):
        value = np.asarray(jax.jit(derivative)(x))
        assert np.all(np.isfinite(value))
        assert np.all(value[..., 3:] == 0)  # the rows of zero-spread segments


def test_bincount_counts_labels_per_segment(any_ids):
    idx, order = any_ids
    labels = np.array([1, 1, 8, 6, -3, 119, 8, 1])[order]
    got = ops.segmented_bincount(jnp.asarray(labels), idx, 4, 10)
    rows = np.asarray(idx)
    expected = np.array([np.bincount(labels[(rows == s) & (labels >= 0) & (labels < 10)],
                                     minlength=10)
                         for s in range(4)])
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("gpu_paths", [False, True])
def test_bincount_of_long_segments_and_many_labels_matches_numpy_in_any_id_order(gpu_paths,
                                                                                  label_dtype):
    # segments of 0–80 rows (more than a warp's lanes) and labels past 32, 64 and 96 (a lane
    # zeroes several entries of its row), some outside [0, length) (int64 ones also 2³² above
    # a label in range, which int32 would wrap onto it); the ids as a Segments, promised
    # sorted, sorted unpromised, shuffled and with rows past the last segment
    rng = np.random.default_rng(7)
    n_atoms = rng.integers(0, 81, 60)
    n_atoms[[3, 17, 18]] = 0
    ids = np.repeat(np.arange(60), n_atoms)
    for length in (119, 5):
        low = 0 if label_dtype == np.uint8 else -3
        labels = rng.integers(low, length + 3, ids.size).astype(label_dtype)
        if label_dtype == np.int64:
            labels[::7] += 2**32
        expected = np.zeros((60, length), np.int32)
        inside = (labels >= 0) & (labels < length)
        np.add.at(expected, (ids[inside], labels[inside]), 1)
        order = rng.permutation(ids.size)
        cases = [(ops.segments(n_atoms), labels, {}),
                 (ids, labels, {"indices_are_sorted": True}), (ids, labels, {}),
                 (ids[order], labels[order], {}),
                 (np.append(ids, [60, 75]), np.append(labels, np.array([1, 2], label_dtype)), {})]
        _primitives.lower_cpu_as_gpu(gpu_paths)
        try:
            for idx, lab, params in cases:
                idx = idx if isinstance(idx, ops.Segments) else jnp.asarray(idx, jnp.int32)
                got = ops.segmented_bincount(jnp.asarray(lab), idx, 60, length, **params)
                assert jnp.asarray(lab).dtype == label_dtype
                np.testing.assert_array_equal(got, expected)
        finally:
            _primitives.lower_cpu_as_gpu(False)


def test_bincount_edge_cases_and_transforms():
    labels, idx = jnp.asarray([3, 0, 3], jnp.int64), jnp.asarray([0, 1, 1])
    assert ops.segmented_bincount(labels[:0], idx[:0], 2, 4).tolist() == [[0] * 4] * 2
    assert ops.segmented_bincount(labels, idx, 0, 4).shape == (0, 4)
    assert ops.segmented_bincount(labels, idx, 2, 0).shape == (2, 0)
    jitted = jax.jit(ops.segmented_bincount, static_argnums=(2, 3))(labels, idx, 2, 4)
    np.testing.assert_array_equal(jitted, [[0, 0, 0, 1], [1, 0, 0, 1]])
    batched = jax.vmap(lambda lab: ops.segmented_bincount(lab, idx, 2, 4))(
        jnp.stack([labels, labels - 1]))
    np.testing.assert_array_equal(batched[1], [[0, 0, 1, 0], [0, 0, 1, 0]])
    with pytest.raises(TypeError, match="labels must be a 1-D integer array"):
        ops.segmented_bincount(jnp.ones(3), idx, 2, 4)
    with pytest.raises(ValueError, match="length must be a non-negative static int"):
        ops.segmented_bincount(labels, idx, 2, -1)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64,
                                   np.uint8, np.uint16, np.uint32, np.uint64])
def test_ids_and_labels_of_any_integer_dtype_are_not_wrapped(dtype, host):
    """Ids and labels of every integer dtype, as NumPy arrays (`host`) or JAX arrays: each
    value in [0, M) counts where it is, every other one is dropped, including those 2³² above
    or below a value in range (which a narrowing to int32 would wrap onto it) and the dtype's
    extremes; with M small and with M beyond a narrow dtype's range; sorted ids promised
    sorted. Against NumPy, in float64."""
    info = np.iinfo(dtype)
    wide = [2**32 + 1, -(2**32) + 2] if info.bits == 64 else []
    values = np.array([v for v in [0, 1, 2, 5, -1, 300, info.min, info.max, *wide]
                       if info.min <= v <= info.max], dtype)
    rng = np.random.default_rng(info.bits)

    def within(a, top):  # compared as Python ints, which no dtype wraps
        return np.array([0 <= int(v) < top for v in a], bool)

    for m in (3, 40000):
        rows = np.sort(values) if m == 3 else values
        x = rng.normal(size=(rows.size, 2))
        inside = within(rows, m)
        expected = np.zeros((m, 2))
        np.add.at(expected, rows[inside].astype(np.int64), x[inside])
        labels = rows[::-1].copy()
        known = inside & within(labels, 6)
        counts = np.zeros((m, 6), np.int32)
        np.add.at(counts, (rows[known].astype(np.int64), labels[known].astype(np.int64)), 1)
        idx, lab = (rows, labels) if host else (jnp.asarray(rows), jnp.asarray(labels))
        assert idx.dtype == dtype and lab.dtype == dtype
        sums = ops.segmented_sum(jnp.asarray(x), idx, m, indices_are_sorted=m == 3)
        np.testing.assert_allclose(sums, expected, rtol=1e-15)
        np.testing.assert_array_equal(ops.segmented_bincount(lab, idx, m, 6), counts)


@pytest.mark.parametrize("name", [n for n in ops.__all__ if n.startswith("segmented_")])
def test_docstring_examples_hold(name):
    """Each op's docstring Example: every expression followed by `# value` gives that value."""
    lines = getattr(ops, name).__doc__.split("Example::")[1].strip().splitlines()
    scope, checked = {"jnp": jnp, **{n: getattr(ops, n) for n in ops.__all__}}, 0
    for line, after in zip(lines, [*lines[1:], ""]):
        code, _, comment = line.strip().partition("  # ")
        if line.strip().startswith("# "):
            continue
        if after.strip().startswith("# ["):
            comment = after.strip()[2:]
        if not comment.startswith("["):
            exec(code, scope)  # noqa: S102  (the docstring example)
            continue
        expected = np.array(eval(comment.split(" (")[0].replace("inf", "np.inf"), {"np": np}))
        np.testing.assert_allclose(np.asarray(eval(code, scope)), expected, rtol=1e-4)
        checked += 1
    assert checked
