"""segmented_mean, _rms_norm and _max_norm (and their segcli.reference forms) at values near the
float max, where sums and squares overflow but the results do not: values and derivatives
against NumPy in long double (whose range holds the squares), sorted and unsorted ids, on the
CPU's code paths and on the GPU's (run on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segcli import ops, reference
from segcli.ops import _primitives

pytestmark = pytest.mark.usefixtures("x64", "strict_numpy")

LONG = np.longdouble
OPS = {
    "mean": (ops.segmented_mean, reference.segmented_mean),
    "rms_norm": (ops.segmented_rms_norm, reference.segmented_rms_norm),
    "max_norm": (ops.segmented_max_norm, reference.segmented_max_norm),
}
RTOL = {np.float64: 1e-13, np.float32: 4e-6}


@pytest.fixture(params=["cpu_paths", "gpu_paths"])
def code_paths(request):
    """The CPU's code paths, or the GPU's (many-thread atomics, no vec3 kernels) on the CPU."""
    _primitives.lower_cpu_as_gpu(request.param == "gpu_paths")
    yield request.param
    _primitives.lower_cpu_as_gpu(False)


def huge_rows(rng, dtype, n, features):
    """n rows whose entries have random signs and magnitudes in [0.5, 0.9] of the float max
    divided by sqrt(entries per row): every sum and square of a segment of them overflows,
    no row's norm does (but may come within 10 % of the float max)."""
    top = np.finfo(dtype).max / np.sqrt(np.prod(features))
    magnitudes = rng.uniform(0.5, 0.9, (n, *features)) * top
    return (magnitudes * rng.choice([-1.0, 1.0], (n, *features))).astype(dtype)


def batch(rng, dtype, features, specials=True):
    """(x, ids, M): segment 0 huge rows of one sign (their sum overflows), 1 empty, 2 huge
    rows of both signs with tiny ones and a zero row, 3 ordinary rows, 4 one row with a single
    nonzero entry whose square overflows; with `specials`, 5 an infinite entry among huge
    rows and 6 a NaN; and a row with id -1 (dropped)."""
    tiny = np.finfo(dtype).tiny * 2**20
    one_entry = np.zeros((1, *features), dtype)
    one_entry.reshape(-1)[0] = np.sqrt(np.finfo(dtype).max) * 2**10
    parts = [
        (-1, huge_rows(rng, dtype, 1, features)),
        (0, np.abs(huge_rows(rng, dtype, 5, features))),
        (2, np.concatenate([huge_rows(rng, dtype, 2, features),
                            np.full((2, *features), tiny, dtype),
                            np.zeros((1, *features), dtype)])),
        (3, rng.normal(size=(4, *features)).astype(dtype)),
        (4, one_entry),
    ]
    if specials:
        with_inf, with_nan = huge_rows(rng, dtype, 3, features), huge_rows(rng, dtype, 2, features)
        with_inf.reshape(3, -1)[1, 0] = np.inf
        with_nan.reshape(2, -1)[0, -1] = np.nan
        parts += [(5, with_inf), (6, with_nan)]
    ids = np.concatenate([np.full(len(rows), s, np.int32) for s, rows in parts])
    return np.concatenate([rows for _, rows in parts]), ids, 7


def expected(name, x, ids, m):
    """The op in long double over each segment's rows, (M, *F) or (M,), and the scale of its
    rounding errors: the segment's largest |x| for the mean (which may cancel), else the
    norm."""
    out, scale = [], []
    for s in range(m):
        rows = x[ids == s].astype(LONG).reshape(np.sum(ids == s), int(np.prod(x.shape[1:])))
        norms = np.sqrt(np.sum(rows * rows, axis=1))
        if name == "mean":
            out.append(np.sum(rows, axis=0) / max(len(rows), 1))
            scale.append(np.max(np.abs(rows[np.isfinite(rows)]), initial=0))
        elif name == "rms_norm":
            out.append(np.sqrt(np.sum(norms * norms) / max(len(rows), 1)))
        else:
            out.append(np.max(norms, initial=0) if not np.isnan(norms).any() else np.nan)
    out = np.asarray(out).reshape(m, *(x.shape[1:] if name == "mean" else ()))
    scale = np.asarray(scale).reshape(m, *(1,) * (out.ndim - 1)) if scale else np.abs(out)
    return out, scale


def assert_matches(got, want, scale, rtol, message):
    """Entries where `want` is inf or NaN equal, the others within rtol · scale."""
    special = ~np.isfinite(want)
    np.testing.assert_array_equal(got[special], want[special].astype(got.dtype), err_msg=message)
    error = np.abs(got[~special].astype(LONG) - want[~special])
    bound = rtol * np.broadcast_to(scale, want.shape)[~special]
    assert np.all(error <= bound), (message, got, want)


def shuffled(rng, x, ids):
    order = rng.permutation(len(ids))
    return x[order], ids[order]


CASES = [(np.float64, "sorted", "cpu_paths"), (np.float64, "unsorted", "gpu_paths"),
         (np.float32, "unsorted", "cpu_paths"), (np.float32, "sorted", "gpu_paths"),
         (np.float32, "unsorted", "gpu_paths")]
"""Each dtype with sorted and unsorted ids, each on both code paths: the ordered kernels
(vec3 ones on the CPU), the CPU's one-thread atomics and the GPU's many-thread ones (for
float32 rms_norm, sums in float64)."""


def case(dtype, ordering, specials=True):
    """A batch (see `batch`) with rows of vec3 for sorted ids, (2, 2) for unsorted (the
    generic kernels), and a function calling any op of OPS on it."""
    rng = np.random.default_rng(5)
    x, ids, m = batch(rng, dtype, (3,) if ordering == "sorted" else (2, 2), specials)
    if ordering == "unsorted":
        x, ids = shuffled(rng, x, ids)

    def call(function, a):
        return function(a, jnp.asarray(ids), m, indices_are_sorted=ordering == "sorted")

    return x, ids, m, call


@pytest.mark.parametrize("dtype, ordering, code_paths", CASES, indirect=["code_paths"])
def test_values_stay_finite_near_the_float_max(code_paths, dtype, ordering):
    x, ids, m, call = case(dtype, ordering)
    functions = 2 if code_paths == "cpu_paths" else 1  # the reference has no code paths
    got = jax.jit(lambda a: {(name, i): call(pair[i], a) for name, pair in OPS.items()
                             for i in range(functions)})(x)
    for (name, i), value in got.items():
        want, scale = expected(name, x, ids, m)
        assert np.isfinite(want[:5]).all() and np.isinf(want[5]).any() and np.isnan(want[6]).any()
        assert value.dtype == dtype
        assert_matches(np.asarray(value), want, scale, RTOL[dtype], f"{OPS[name][i]} {name}")


def loss_weights(m):
    return np.linspace(0.5, 1.5, m)


def expected_gradient(name, x, ids, m):
    """d Σ_s w[s] norm(x)[s] / dx, (N, *F), in long double."""
    rows = x.astype(LONG).reshape(len(x), -1)
    grad = np.zeros_like(rows)
    for s, w in enumerate(loss_weights(m)):
        members = np.flatnonzero(ids == s)
        if not len(members):
            continue
        segment = rows[members]
        norms = np.sqrt(np.sum(segment * segment, axis=1))
        if name == "rms_norm":
            rms = np.sqrt(np.sum(norms * norms) / len(members))
            grad[members] = w * segment / (len(members) * rms) if rms else 0
        elif norms.max():
            first = members[np.argmax(norms)]
            grad[first] = w * rows[first] / norms.max()
    return grad.reshape(x.shape)


def expected_hessian(name, x, ids, m):
    """d² Σ_s w[s] norm(x)[s] / dx², (N·K, N·K), in long double."""
    rows = x.astype(LONG).reshape(len(x), -1)
    k = rows.shape[1]
    hessian = np.zeros((rows.size, rows.size), LONG)
    for s, w in enumerate(loss_weights(m)):
        members = np.flatnonzero(ids == s)
        norms = np.sqrt(np.sum(rows[members] ** 2, axis=1))
        if not len(members) or not norms.max():
            continue
        if name == "max_norm":  # |v|'' = I/|v| - v vᵀ/|v|³ at the first row attaining the max
            members = members[[np.argmax(norms)]]
        n = len(members) if name == "rms_norm" else 1
        v = rows[members].reshape(-1)
        r = np.sqrt(np.sum(v * v) / n)
        at = (members[:, None] * k + np.arange(k)).reshape(-1)
        hessian[np.ix_(at, at)] += w * (np.eye(len(v)) / (n * r) - np.outer(v, v) / (n * n * r**3))
    return hessian


@pytest.mark.parametrize("dtype, ordering, code_paths", [
    (np.float64, "sorted", "cpu_paths"), (np.float32, "unsorted", "gpu_paths")],
    indirect=["code_paths"])
def test_derivatives_stay_finite_and_exact_near_the_float_max(code_paths, dtype, ordering):
    """The norms' grad and jvp near the float max, and Hessian-vector products (forward and
    reverse over reverse) where squares overflow but the Hessian's entries (about 1/norm) are
    still normal numbers; the reference's grad in the CPU case (its tangents, scaled with the
    values, flush to 0 near the float max). The mean is linear: its derivatives do not depend
    on x."""
    x, ids, m, call = case(dtype, ordering, specials=False)
    moderate = (x / np.finfo(dtype).max ** 0.25).astype(dtype)
    tangent = np.random.default_rng(6).normal(size=x.shape).astype(dtype)
    weights = jnp.asarray(loss_weights(m), dtype)
    names = ("rms_norm", "max_norm")

    def loss(function):
        return lambda a: jnp.sum(weights * call(function, a))

    def derivatives(a, t, b):
        def hessian_times(f, b, t):  # forward over reverse, and reverse over reverse
            return (jax.jvp(jax.grad(f), (b,), (t,))[1],
                    jax.grad(lambda b: jnp.vdot(jax.grad(f)(b), t))(b))

        ours = {name: (jax.grad(loss(OPS[name][0]))(a), jax.jvp(loss(OPS[name][0]), (a,), (t,))[1],
                       *hessian_times(loss(OPS[name][0]), b, t)) for name in names}
        theirs = ({name: jax.grad(loss(OPS[name][1]))(a) for name in names}
                  if code_paths == "cpu_paths" else {})
        return ours, theirs

    ours, theirs = jax.jit(derivatives)(x, tangent, moderate)
    tolerance = RTOL[dtype] * 10
    for name in names:
        want = expected_gradient(name, x, ids, m)
        for grad in (ours[name][0], *([theirs[name]] if theirs else [])):
            np.testing.assert_allclose(grad, want.astype(dtype), rtol=tolerance, err_msg=name)
        np.testing.assert_allclose(ours[name][1], np.sum(want * tangent), rtol=tolerance,
                                   err_msg=name)
        want = (expected_hessian(name, moderate, ids, m) @ tangent.reshape(-1)).reshape(x.shape)
        for product in ours[name][2:]:
            np.testing.assert_allclose(product, want.astype(dtype), rtol=tolerance,
                                       atol=float(np.abs(want).max()) * tolerance, err_msg=name)


@pytest.mark.parametrize("dtype, ordering, code_paths", CASES, indirect=["code_paths"])
def test_norms_are_exact_across_the_whole_range(code_paths, dtype, ordering):
    """Rows of 3 (sorted) or 2 × 2 (unsorted) entries of magnitudes from near the smallest
    normal number to near the float max, every binary exponent about as often, one row a
    segment and then five: where |x|² is taken plainly and where it is scaled (beside a square
    that overflows, or underflows into subnormal numbers), max_norm and rms_norm against long
    double."""
    rng = np.random.default_rng(9)
    features = (3,) if ordering == "sorted" else (2, 2)
    info = np.finfo(dtype)
    exponents = np.arange(info.minexp + 4, info.maxexp - 4)
    rows = np.ldexp(rng.uniform(0.5, 1, (len(exponents), *features)),
                    exponents.reshape(-1, *(1,) * len(features)))
    rows[1::3, 0] = 0  # some rows with one entry far smaller than the others
    rows[2::3, ..., -1] *= 2.0 ** -(info.nmant + 2)
    x = (rows * rng.choice([-1.0, 1.0], rows.shape)).astype(dtype)
    for per_segment in (1, 5):
        ids = (np.arange(len(x)) // per_segment).astype(np.int32)
        order = rng.permutation(len(x)) if ordering == "unsorted" else np.arange(len(x))
        m = int(ids[-1]) + 1
        for name in ("max_norm", "rms_norm"):
            got = OPS[name][0](x[order], jnp.asarray(ids[order]), m,
                               indices_are_sorted=ordering == "sorted")
            want, scale = expected(name, x, ids, m)
            assert_matches(np.asarray(got), want, scale, RTOL[dtype], (name, per_segment))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_power_of_two_brackets_every_float(dtype):
    """power_of_two(top) = (2^e, 2^-e), 2^e <= top < 2^(e+1), against NumPy's frexp: across
    the whole range, subnormal tops (e clamped to the smallest normal power), tops near the
    float max (clamped so that 2^-e is normal), 0, inf and NaN (e = -1)."""
    info = np.finfo(dtype)
    rng = np.random.default_rng(8)
    exponents = rng.integers(info.minexp - info.nmant, info.maxexp, 2000)
    top = np.concatenate([np.ldexp(rng.uniform(1, 2, 2000), exponents),
                          [0, 1, 2, 0.5, info.max, info.tiny, info.smallest_subnormal, np.inf,
                           np.nan]]).astype(dtype)
    _, e = np.frexp(top.astype(np.float64))
    e = np.where((top == 0) | ~np.isfinite(top), -1, np.clip(e - 1, info.minexp, info.maxexp - 3))
    scale, inverse = jax.jit(_primitives.power_of_two)(jnp.asarray(top))
    assert scale.dtype == inverse.dtype == dtype
    np.testing.assert_array_equal(np.asarray(scale, np.float64), np.ldexp(1.0, e))
    np.testing.assert_array_equal(np.asarray(inverse, np.float64), np.ldexp(1.0, -e))
    inside = np.isfinite(top) & (top >= info.tiny) & (e < info.maxexp - 3)  # not clamped
    assert np.all(np.ldexp(1.0, e[inside]) <= top[inside])
    assert np.all(top[inside] < np.ldexp(1.0, e[inside] + 1))
