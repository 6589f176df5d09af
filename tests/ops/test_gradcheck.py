"""check_gradients and compare_functions on plain JAX functions, and segcli.reference against
NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from segcli import reference
from segcli._jax import enable_x64
from segcli.gradcheck import check_gradients, compare_functions


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def failing(report):
    return {(row.order, row.argument, row.mode) for row in report.rows if not row.passed}


def rows_of(report, order):
    return [row for row in report.rows if row.order == order]


def sin_with_derivative(derivative):
    """sin(x) whose JVP rule is t * derivative(x)."""
    f = jax.custom_jvp(jnp.sin)
    f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), tangents[0] * derivative(primals[0])))
    return f


def test_correct_function_passes_every_mode_and_argument(rng):
    x, y = rng.normal(size=(6, 3)), rng.normal(size=(6,))
    report = check_gradients(lambda x, y: jnp.tanh(x) * jnp.exp(y)[:, None], (x, y), order=2,
                             argnames=("x", "y"))
    assert report.passed, str(report)
    assert {(row.order, row.argument, row.mode) for row in report.rows} == {
        (k, a, m) for k in (1, 2) for a in ("x", "y")
        for m in ("jvp vs fd", "vjp vs fd", "vjp vs jvp")
    }
    assert all(0 <= row.abs_error <= row.tolerance for row in report.rows)


def test_first_derivative_off_by_1e_3_fails_at_order_1_for_that_argument(rng):
    wrong = sin_with_derivative(lambda x: jnp.cos(x) * (1 + 1e-3))
    x, y = rng.uniform(0.2, 1.2, size=7), rng.normal(size=7)
    report = check_gradients(lambda x, y: wrong(x) * y, (x, y), order=1, argnames=("x", "y"))
    assert not report.passed
    assert failing(report) == {(1, "x", "jvp vs fd"), (1, "x", "vjp vs fd")}
    worst = max(rows_of(report, 1), key=lambda row: row.rel_error)
    assert worst.argument == "x" and 5e-4 < worst.rel_error < 2e-3
    assert "FAIL" in str(report)


def test_wrong_second_derivative_fails_at_order_2_only(rng):
    cos_wrong_derivative = jax.custom_jvp(jnp.cos)
    cos_wrong_derivative.defjvp(lambda p, t: (jnp.cos(p[0]), -1.01 * jnp.sin(p[0]) * t[0]))
    f = sin_with_derivative(cos_wrong_derivative)
    report = check_gradients(f, (rng.uniform(0.3, 1.3, size=5),), order=2, argnames=("x",))
    assert all(row.passed for row in rows_of(report, 1))
    assert failing(report) == {(2, "x", "jvp vs fd"), (2, "x", "vjp vs fd")}


def linear_with_wrong_transpose(factor):
    """x ↦ x * c with a correct JVP rule and a transpose rule off by `factor`."""
    scale = Primitive("scale_with_wrong_transpose")
    scale.def_impl(lambda x, c: x * c)
    scale.def_abstract_eval(lambda x, c: x)
    mlir.register_lowering(scale, mlir.lower_fun(lambda x, c: x * c, multiple_results=False))
    ad.defjvp(scale, lambda t, x, c: scale.bind(t, c), None)
    ad.primitive_transposes[scale] = lambda ct, x, c: (ct * c * factor, None)
    return scale


def test_vjp_disagreeing_with_jvp_fails(rng):
    scale = linear_with_wrong_transpose(1 + 1e-3)
    c = jnp.asarray(rng.normal(size=8))
    report = check_gradients(lambda x: scale.bind(x, c), (rng.normal(size=8),), order=1,
                             argnames=("x",))
    assert failing(report) == {(1, "x", "vjp vs jvp"), (1, "x", "vjp vs fd")}
    jvp_row = next(row for row in report.rows if row.mode == "jvp vs fd")
    assert jvp_row.passed


def test_nan_gradient_at_one_point_fails_and_says_so(rng):
    n = 6
    position = rng.integers(n)
    f = sin_with_derivative(lambda x: jnp.where(jnp.arange(n) == position, jnp.nan, jnp.cos(x)))
    report = check_gradients(f, (rng.normal(size=n),), order=1, argnames=("x",))
    assert failing(report) == {(1, "x", "jvp vs fd"), (1, "x", "vjp vs fd"), (1, "x", "vjp vs jvp")}
    assert all("non-finite" in row.note for row in report.rows)
    assert "nan" in str(report)


@pytest.mark.parametrize("output_scale", [1e-8, 1.0, 1e8])
def test_values_spanning_1e_minus_8_to_1e8_pass(rng, output_scale):
    magnitudes = np.logspace(-8, 8, 17)
    x = magnitudes * rng.choice([-1, 1], size=17) * rng.uniform(0.5, 1.5, size=17)
    y = rng.normal(size=17)

    def f(x, y):
        return output_scale * (x**3 * jnp.exp(y) + jnp.log1p(x**2) + jnp.sum(jnp.tanh(y) * x))

    report = check_gradients(f, (x, y), order=2, argnames=("x", "y"))
    assert report.passed, str(report)


def test_float32_inputs_are_checked_in_float64(rng):
    x = rng.normal(size=(4, 3)).astype(np.float32)
    report = check_gradients(lambda x: jnp.sin(x) * jnp.sum(x**2), (x,), order=2)
    assert report.passed, str(report)
    # float32 finite differences could not get anywhere near this.
    assert max(row.rel_error for row in report.rows) < 1e-8


def test_third_order_of_smooth_function(rng):
    x, y = rng.normal(size=5), rng.normal(size=(5, 2))
    report = check_gradients(
        lambda x, y: jnp.sin(x)[:, None] * jnp.exp(0.5 * y) + x[:, None] * y**2, (x, y), order=3)
    assert report.passed, str(report)
    assert {row.argument for row in rows_of(report, 3)} == {"arg0", "arg1"}


def test_wrong_third_derivative_fails_at_order_3_only(rng):
    sin_wrong = jax.custom_jvp(jnp.sin)
    sin_wrong.defjvp(lambda p, t: (jnp.sin(p[0]), 1.02 * jnp.cos(p[0]) * t[0]))
    cos_wrong = jax.custom_jvp(jnp.cos)
    cos_wrong.defjvp(lambda p, t: (jnp.cos(p[0]), -sin_wrong(p[0]) * t[0]))
    f = sin_with_derivative(cos_wrong)
    report = check_gradients(f, (rng.uniform(0.3, 1.3, size=4),), order=3)
    assert {order for order, _, _ in failing(report)} == {3}


def reverse_only_sin(bwd_factor):
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x) * bwd_factor,))
    return f


def test_reverse_only_function_is_checked_in_reverse_mode(rng):
    x = rng.normal(size=5)
    report = check_gradients(reverse_only_sin(1.0), (x,), order=2)
    assert report.passed, str(report)
    first = rows_of(report, 1)
    assert [row.mode for row in first] == ["vjp vs fd"]
    assert "forward mode unavailable" in first[0].note and "custom_vjp" in first[0].note
    assert "forward mode unavailable" in str(report)

    wrong = check_gradients(reverse_only_sin(1 + 1e-3), (x,), order=1)
    assert failing(wrong) == {(1, "arg0", "vjp vs fd")}


def test_integer_arguments_are_held_fixed(rng):
    idx = np.sort(rng.integers(0, 4, size=10)).astype(np.int32)
    x = rng.normal(size=(10, 3))
    report = check_gradients(lambda x, idx: jax.ops.segment_sum(jnp.sin(x), idx, 4), (x, idx),
                             argnames=("x", "idx"))
    assert report.passed and {row.argument for row in report.rows} == {"x"}


def test_summary_keeps_the_worst_row_per_function_and_order(rng):
    wrong = sin_with_derivative(lambda x: jnp.cos(x) * (1 + 1e-3))
    report = check_gradients(lambda x, y: wrong(x) + y, (rng.normal(size=3), rng.normal(size=3)),
                             order=2, argnames=("x", "y"), name="g")
    summary = report.summary()
    assert [(row.function, row.order, row.passed) for row in summary.rows] == [("g", 1, False),
                                                                               ("g", 2, True)]
    assert summary.rows[0].argument == "x"
    assert summary.rows[0].note.startswith("2 of 6 checks failed")
    data = report.to_dict()
    assert data["passed"] is False and len(data["rows"]) == len(report.rows)


def test_compare_functions_finds_the_first_wrong_order(rng):
    cos_wrong = jax.custom_jvp(jnp.cos)
    cos_wrong.defjvp(lambda p, t: (jnp.cos(p[0]), -1.001 * jnp.sin(p[0]) * t[0]))
    x = rng.normal(size=6)
    assert compare_functions(sin_with_derivative(jnp.cos), jnp.sin, (x,), order=3).passed
    report = compare_functions(sin_with_derivative(cos_wrong), jnp.sin, (x,), order=2)
    assert {order for order, _, _ in failing(report)} == {2}
    values = compare_functions(lambda x: jnp.sin(x) + 1e-6, jnp.sin, (x,), order=1)
    assert failing(values) == {(0, "all", "value vs ref")}


def test_compare_functions_tolerates_roundoff_of_cancelling_sums(rng):
    x = rng.normal(size=(50, 3)) * 10
    x -= x.mean(axis=0)  # sums to zero up to roundoff, like forces in a structure
    idx = np.zeros(50, np.int32)
    reordered = lambda x: jax.ops.segment_sum(x[::-1], idx, 1)
    report = compare_functions(reordered, lambda x: jax.ops.segment_sum(x, idx, 1), (x,), order=1)
    assert report.passed, str(report)


# segcli.reference against plain NumPy loops, with empty segments and out-of-range ids.


@pytest.fixture
def x64():
    with enable_x64(True):
        yield


def segments_with_gaps(rng, n=23, m=6):
    idx = rng.integers(-1, m + 1, size=n)  # -1 and m are out of range
    idx[idx == 2] = 3  # segment 2 empty
    return idx.astype(np.int32), m


@pytest.mark.parametrize("trailing", [(), (3,), (2, 4)])
def test_reference_reductions_match_numpy(x64, rng, trailing):
    idx, m = segments_with_gaps(rng)
    x, y = rng.normal(size=(len(idx),) + trailing), rng.normal(size=(len(idx),) + trailing)
    members = [np.flatnonzero(idx == s) for s in range(m)]
    zero = np.zeros(trailing)
    np.testing.assert_allclose(reference.segmented_sum(x, idx, m),
                               [x[i].sum(0) if len(i) else zero for i in members])
    np.testing.assert_allclose(reference.segmented_mean(x, idx, m),
                               [x[i].mean(0) if len(i) else zero for i in members])
    dots = [sum(np.vdot(x[j], y[j]) for j in i) for i in members]
    np.testing.assert_allclose(reference.segmented_dot(x, y, idx, m), dots)
    norms = [np.sqrt(np.mean([np.vdot(x[j], x[j]) for j in i])) if len(i) else 0 for i in members]
    np.testing.assert_allclose(reference.segmented_rms_norm(x, idx, m), norms)
    largest = [max(np.linalg.norm(x[j].ravel()) for j in i) if len(i) else 0 for i in members]
    np.testing.assert_allclose(reference.segmented_max_norm(x, idx, m), largest)
    np.testing.assert_array_equal(reference.segmented_count(idx, m), [len(i) for i in members])
    assert reference.segmented_count(idx, m).dtype == jnp.int32


def test_reference_gathers_give_zero_for_out_of_range_ids(x64, rng):
    idx, m = segments_with_gaps(rng)
    x, scale, cells = rng.normal(size=(len(idx), 3)), rng.normal(size=m), rng.normal(size=(m, 3, 3))
    valid = (idx >= 0) & (idx < m)
    expected_mul = np.where(valid[:, None], x * scale[np.clip(idx, 0, m - 1)][:, None], 0)
    np.testing.assert_allclose(reference.segmented_mul(x, scale, idx, m), expected_mul)
    expected_matvec = [cells[s].T @ x[i] if 0 <= s < m else np.zeros(3) for i, s in enumerate(idx)]
    np.testing.assert_allclose(reference.segmented_matvec(x, cells, idx, m), expected_matvec)


@pytest.mark.parametrize("op", [reference.segmented_rms_norm, reference.segmented_max_norm])
def test_reference_norms_have_zero_derivatives_at_zero_norm(x64, rng, op):
    idx = np.array([0, 0, 1, 1, 1], np.int32)
    x = rng.normal(size=(5, 3))
    x[:2] = 0  # segment 0 has norm 0
    weights = jnp.asarray(rng.normal(size=2))
    loss = lambda x: jnp.vdot(weights, op(x, idx, 2))
    first = jax.jit(jax.grad(loss))(x)  # jitted: one program each, not one per operation
    second = jax.jit(jax.hessian(loss))(x)
    third = jax.jit(jax.jacfwd(jax.hessian(loss)))(x)
    for derivative in (first, second, third):
        assert np.all(np.isfinite(derivative))
        assert np.all(np.asarray(derivative)[:2] == 0)
    assert np.any(first[2:] != 0)


def test_reference_max_norm_gradient_goes_to_first_maximum(x64, rng):
    row = rng.normal(size=3)
    x = np.stack([0.5 * row, row, -row, 0.1 * row])  # atoms 1 and 2 tie for the maximum
    gradient = jax.grad(lambda x: reference.segmented_max_norm(x, np.zeros(4, np.int32), 1)[0])(x)
    np.testing.assert_allclose(gradient[1], row / np.linalg.norm(row))
    assert np.all(np.asarray(gradient)[[0, 2, 3]] == 0)


@pytest.mark.slow
def test_kink_is_not_hidden_by_the_finite_difference_error_estimate(x64, rng):
    x = rng.normal(size=(6, 3))
    x[:2] = 0  # segment 0 has norm 0: rms_norm has a kink there
    idx = np.array([0, 0, 1, 1, 1, 1], np.int32)
    report = check_gradients(lambda x: reference.segmented_rms_norm(x, idx, 2), (x,), order=2)
    assert all(row.passed for row in rows_of(report, 1))
    assert failing(report) == {(2, "arg0", "jvp vs fd"), (2, "arg0", "vjp vs fd")}
    assert all("finite differences unreliable" in row.note for row in report.failures)
    x[:2] = rng.normal(size=(2, 3))
    assert check_gradients(lambda x: reference.segmented_rms_norm(x, idx, 2), (x,), order=2).passed
