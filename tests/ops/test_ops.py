"""segcli.ops against their independent pure-JAX references (segcli.reference, in float64):
values, every transform, edge cases; every op of the registry."""

import os
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_reference import random_args

from segcli import cache_directory, ops, reference
from segcli.ops import _primitives, kernels
from segcli.ops.kernels import _registry, searches
from segcli.registry import OPS

pytestmark = pytest.mark.usefixtures("x64", "strict_numpy")


NAMES = [name for name, op in OPS.items() if op.differentiable]
"""The ops every transform applies to; the others are checked by test_values_of_every_op."""
ZERO_AT_KINK = ("zero_norm", "norm_ties", "zero_spread")
"""The kink rules (registry.Op.kinks) of ops whose derivatives are 0 where all rows are 0."""


def jitted(function, op):
    """`function` (an op's or its reference) as one program: eager JAX compiles one per
    operation, and the edge-case tests need not pay for that (the transform tests run segcli's
    ops eagerly too)."""
    static = len(op.inputs) + 1  # num_segments, then the op's params
    return jax.jit(function, static_argnums=tuple(range(static, static + 1 + len(op.params))),
                   static_argnames=("indices_are_sorted",) * op.takes_sorted + tuple(op.params))


def functions(name, eager=False):
    """(segcli function, reference, registry.Op) of an op, both jitted (segcli's left eager
    with `eager`)."""
    op = OPS[name]
    return op.function if eager else jitted(op.function, op), jitted(op.reference, op), op


def make_args(rng, op, n, m, features=(3,), dtype=np.float64):
    return tuple(jnp.asarray(a) for a in random_args(rng, op, n, m, features, dtype))


def sorted_ids(rng, n, m):
    """Sorted ids over m segments, the second one left empty."""
    ids = np.sort(rng.choice([s for s in range(m) if s != 1], size=n))
    return jnp.asarray(ids, jnp.int32)


def assert_close(actual, expected, rtol):
    """Non-finite entries equal, the others within rtol of the expected norm."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    special = ~np.isfinite(expected)
    np.testing.assert_array_equal(actual[special], expected[special])
    a, e = actual[~special], expected[~special]
    scale = max(np.linalg.norm(e), 1e-300)
    assert np.linalg.norm(a - e) <= rtol * scale + 1e-300, (np.linalg.norm(a - e) / scale, actual,
                                                            expected)


def assert_tree_close(actual, expected, rtol=1e-10):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert_close(a, e, rtol)


def setup(name, seed=0, n=23, m=6, features=(3,), dtype=np.float64, eager=False):
    rng = np.random.default_rng(seed)
    ours, theirs, op = functions(name, eager)
    args = make_args(rng, op, n, m, features, dtype)
    idx = sorted_ids(rng, n, m)
    weights = jnp.asarray(rng.normal(size=np.shape(theirs(*args, idx, m))).astype(dtype))
    tangents = make_args(rng, op, n, m, features, dtype)

    def bind(function):
        f = lambda *a: function(*a, idx, m)
        loss = lambda *a: jnp.sum(weights * f(*a))
        return f, loss

    return args, tangents, bind(ours), bind(theirs), rng


def _nested(loss, args, tangents, order):
    """A scalar whose gradient is the `order`-th derivative of loss contracted with tangents."""
    argnums = tuple(range(len(args)))
    g = loss
    for _ in range(order - 1):
        # Bind h = g now (a closure over g would see its later values).
        g = (lambda h: lambda *a: sum(  # noqa: PLC3002
            jnp.vdot(d, t) for d, t in zip(jax.grad(h, argnums)(*a), tangents)))(g)
    return jax.grad(g, argnums)


TRANSFORMS = {
    "value": lambda f, loss, args, tangents: f(*args),
    "jit": lambda f, loss, args, tangents: jax.jit(f)(*args),
    "grad": lambda f, loss, args, tangents: _nested(loss, args, tangents, 1)(*args),
    "grad_grad": lambda f, loss, args, tangents: _nested(loss, args, tangents, 2)(*args),
    "grad_grad_grad": lambda f, loss, args, tangents: _nested(loss, args, tangents, 3)(*args),
    "jit_grad_grad":
        lambda f, loss, args, tangents: jax.jit(_nested(loss, args, tangents, 2))(*args),
    "jvp": lambda f, loss, args, tangents: jax.jvp(f, args, tangents),
    "jacfwd": lambda f, loss, args, tangents: jax.jacfwd(f, tuple(range(len(args))))(*args),
    "jacrev": lambda f, loss, args, tangents: jax.jacrev(f, tuple(range(len(args))))(*args),
    "jacfwd_jacrev": lambda f, loss, args, tangents: jax.jacfwd(jax.jacrev(loss))(*args),
    "hessian": lambda f, loss, args, tangents: jax.hessian(loss, tuple(range(len(args))))(*args),
    "linearize": lambda f, loss, args, tangents: jax.linearize(f, *args)[1](*tangents),
    "vjp": lambda f, loss, args, tangents: jax.vjp(f, *args)[1](f(*args)),
    "scan": lambda f, loss, args, tangents: jax.lax.scan(
        lambda carry, s: (carry + jnp.sum(f(*(a * s for a in args))), None), 0.0,
        jnp.linspace(0.5, 1.5, 3)
    )[0],
    "grad_scan": lambda f, loss, args, tangents: jax.grad(
        lambda *a: jax.lax.scan(lambda c, s: (c + loss(*(x * s for x in a)), None), 0.0,
                                jnp.linspace(0.5, 1.5, 3))[0],
        tuple(range(len(args))),
    )(*args),
    "vmap": lambda f, loss, args, tangents: jax.vmap(f)(*(jnp.stack([a, 2 * a, -a]) for a in args)),
    "vmap_one_arg": lambda f, loss, args, tangents: jax.vmap(lambda a0: f(a0, *args[1:]))(
        jnp.stack([args[0], 3 * args[0]])),
    "vmap_grad": lambda f, loss, args, tangents: jax.vmap(jax.grad(loss, tuple(range(len(args)))))(
        *(jnp.stack([a, 0.5 * a]) for a in args)
    ),
    "grad_vmap": lambda f, loss, args, tangents: jax.grad(
        lambda *a: jnp.sum(jax.vmap(loss)(*(jnp.stack([x, x * x]) for x in a))),
        tuple(range(len(args)))
    )(*args),
}


def sampled(names, variants, share, turn=0):
    """(name, *variant) for each op and variant (a value or a tuple of values): each op with a
    rotating 1/share of the variants (every variant with some ops; with one variant, 1/share
    of the ops, which `turn` picks) by default, the rest marked slow (the whole grid runs with
    -m slow)."""
    return [pytest.param(name, *(v if isinstance(v, tuple) else (v,)),
                         marks=() if (i + j + turn) % share == 0 else pytest.mark.slow)
            for i, name in enumerate(names) for j, v in enumerate(variants)]


@pytest.mark.parametrize("name, transform", sampled(NAMES, TRANSFORMS, 16))
def test_transform_matches_reference_float64(name, transform):
    args, tangents, (f, loss), (f_ref, loss_ref), _ = setup(
        name, seed=hash((name, transform)) % 2**32, eager=True)
    ours = TRANSFORMS[transform](f, loss, args, tangents)
    theirs = TRANSFORMS[transform](f_ref, loss_ref, args, tangents)
    assert_tree_close(ours, theirs, rtol=1e-10)


@pytest.mark.parametrize("name", ["max_norm", "rms_norm", "max"])
def test_jvp_of_vmap_of_jit_equals_vmap_of_jvp(name):
    """The order of jvp and vmap around a jitted op does not change its values or their
    batch axes (max_norm's custom JVP once gave the batch axis second under jit)."""
    rng = np.random.default_rng(3)
    idx = jnp.asarray(np.sort(rng.integers(0, 6, 23)), jnp.int32)
    x, t = (jnp.asarray(rng.normal(size=(2, 23, 3))) for _ in range(2))
    f = jax.jit(lambda y: getattr(ops, f"segmented_{name}")(y, idx, 6))
    outer = jax.jvp(jax.vmap(f), (x,), (t,))
    inner = jax.vmap(lambda y, d: jax.jvp(f, (y,), (d,)))(x, t)
    assert_tree_close(outer, inner, rtol=1e-12)
    assert outer[0].shape == jax.vmap(f)(x).shape


@pytest.mark.parametrize("name", sampled(NAMES, [()], 4, 0))
def test_vmapped_ids(name):
    """Each batch element with its own ids (and so its own segment layout)."""
    rng = np.random.default_rng(7)
    ours, theirs, op = functions(name)
    n, m = 15, 4
    args = make_args(rng, op, n, m)
    ids = jnp.asarray(np.stack([np.sort(rng.integers(0, m, n)), rng.integers(-1, m + 1, n)]),
                      jnp.int32)
    got = jax.vmap(lambda i: ours(*args, i, m))(ids)
    want = jax.vmap(lambda i: theirs(*args, i, m))(ids)
    assert_close(got, want, 1e-12)
    grads = jax.vmap(
        lambda i: jax.grad(lambda a: jnp.sum(ours(a, *args[1:], i, m) ** 2))(args[0]))(ids)
    grads_ref = jax.vmap(
        lambda i: jax.grad(lambda a: jnp.sum(theirs(a, *args[1:], i, m) ** 2))(args[0]))(ids)
    assert_close(grads, grads_ref, 1e-10)


@pytest.mark.parametrize("name, features", sampled(
    [n for n in NAMES if any(a.shape is None for a in OPS[n].inputs)],
    [((),), ((1,),), ((3,),), ((8,),), ((2, 4),)], 11))
def test_trailing_shapes(name, features):
    args, _tangents, (f, loss), (f_ref, loss_ref), _ = setup(name, n=31, m=5, features=features)
    assert_close(f(*args), f_ref(*args), 1e-12)
    assert_tree_close(jax.grad(loss, (0, 1) if len(args) == 2 else 0)(*args),
                      jax.grad(loss_ref, (0, 1) if len(args) == 2 else 0)(*args))


@pytest.mark.parametrize("name, x64_mode", sampled(NAMES, [True, False], 8))
def test_float32(name, x64_mode):
    jax.config.update("jax_enable_x64", x64_mode)
    args, tangents, (f, loss), (f_ref, loss_ref), _ = setup(name, n=200, m=9, dtype=np.float32)
    out = f(*args)
    assert out.dtype == jnp.float32
    assert_close(out, f_ref(*args), 1e-5)
    argnums = tuple(range(len(args)))
    assert_tree_close(jax.grad(loss, argnums)(*args), jax.grad(loss_ref, argnums)(*args), 1e-5)
    assert_tree_close(_nested(loss, args, tangents, 2)(*args),
                      _nested(loss_ref, args, tangents, 2)(*args), 1e-5)


@pytest.mark.parametrize("name, dtype", sampled(NAMES, [jnp.float16, jnp.bfloat16], 7, 1))
def test_half_precision_accumulates_in_float32(name, dtype):
    args, _, (f, _), (f_ref, _), _ = setup(name, n=300, m=4)
    half = tuple(a.astype(dtype) for a in args)
    out = f(*half)
    assert out.dtype == dtype
    # the float32 result of the same half inputs, rounded once to the half dtype
    assert_close(out, f_ref(*(a.astype(jnp.float32) for a in half)).astype(dtype), 1e-2)
    grad = jax.grad(lambda a: jnp.sum(f(a, *half[1:]).astype(jnp.float32)))(half[0])
    assert grad.dtype == dtype


@pytest.mark.parametrize("name", sampled(NAMES, [()], 3, 1))
def test_unsorted_ids_match_sorted(name):
    rng = np.random.default_rng(3)
    ours, theirs, op = functions(name)
    n, m = 60, 7
    args = make_args(rng, op, n, m)
    idx = rng.integers(0, m, n).astype(np.int32)
    order = np.argsort(idx, kind="stable")
    sorted_args = [a[order] if arg.per == "atom" else a for a, arg in zip(args, op.inputs)]
    unsorted = ours(*args, jnp.asarray(idx), m)
    in_order = ours(*sorted_args, jnp.asarray(idx[order]), m)
    if op.output_per == "atom":
        in_order = jnp.zeros_like(in_order).at[order].set(in_order)
    assert_close(unsorted, in_order, 1e-13)
    assert_close(unsorted, theirs(*args, jnp.asarray(idx), m), 1e-13)
    g = jax.grad(lambda *a: jnp.sum(ours(*a, jnp.asarray(idx), m) ** 2),
                 tuple(range(len(args))))(*args)
    g_ref = jax.grad(lambda *a: jnp.sum(theirs(*a, jnp.asarray(idx), m) ** 2),
                     tuple(range(len(args))))(*args)
    assert_tree_close(g, g_ref)


@pytest.mark.parametrize("name, ids_dtype, sorted_", sampled(
    [name for name, op in OPS.items() if op.inputs],
    [(np.int32, True), (np.int64, True), (np.int32, False), (np.int64, False)], 9))
def test_out_of_range_ids_are_dropped(name, ids_dtype, sorted_):
    rng = np.random.default_rng(11)
    ours, theirs, op = functions(name)
    n, m = 40, 5
    args = make_args(rng, op, n, m)
    bad = [-1, m, 2**31 - 1] + ([2**40, -(2**40)] if ids_dtype == np.int64 else [])
    idx = rng.integers(0, m, n).astype(ids_dtype)
    idx[rng.choice(n, size=len(bad) * 2, replace=False)] = bad * 2
    if sorted_:
        idx = np.sort(idx)
    valid = (idx >= 0) & (idx < m)
    got = ours(*args, idx, m, **op.params,
               **({"indices_are_sorted": True} if sorted_ and op.takes_sorted else {}))
    # the reference on the valid rows only, with invalid rows giving 0 for per-atom results
    kept = [a[valid] if arg.per == "atom" else a for a, arg in zip(args, op.inputs)]
    want = theirs(*kept, jnp.asarray(idx[valid].astype(np.int32)), m, **op.params)
    if op.output_per == "atom":
        want = jnp.zeros((n, *want.shape[1:])).at[np.flatnonzero(valid)].set(want)
    assert_close(got, want, 1e-13)
    if not op.differentiable:
        return
    g = jax.grad(lambda a: jnp.sum(ours(a, *args[1:], idx, m) ** 2))(args[0])
    assert np.all(np.asarray(g)[~valid] == 0)


def test_int64_ids_equal_int32():
    args, _, _, _, rng = setup("dot")
    idx = sorted_ids(rng, 23, 6)
    assert np.array_equal(ops.segmented_dot(*args, idx, 6),
                          ops.segmented_dot(*args, idx.astype(jnp.int64), 6))


@pytest.mark.parametrize("name", sampled([name for name, op in OPS.items() if op.inputs],
                                         [()], 4))
def test_numpy_int64_ids_with_x64_off_are_dropped_not_wrapped(name):
    """Eager calls with x64 off take NumPy int64 ids past int32 as out of range (clipped on the
    host), where narrowing them to int32 would wrap them onto segments 0 and 1."""
    jax.config.update("jax_enable_x64", False)
    _, theirs, op = functions(name)
    rng = np.random.default_rng(5)
    n, m = 30, 4
    args = make_args(rng, op, n, m, dtype=np.float32)
    idx = rng.integers(0, m, n)
    idx[:3] = [2**32, 2**32 + 1, -(2**32)]
    got = op.function(*args, idx, m, **op.params)
    kept = [a[3:] if arg.per == "atom" else a for a, arg in zip(args, op.inputs)]
    want = theirs(*kept, jnp.asarray(idx[3:], jnp.int32), m, **op.params)
    if op.output_per == "atom":
        want = jnp.concatenate([jnp.zeros((3, *want.shape[1:]), want.dtype), want])
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.inputs])
def test_values_of_every_op(name):
    """Sorted and unsorted ids (one segment empty), against the reference, in the inputs'
    own dtypes (integer data for the ops that reduce integers)."""
    ours, theirs, op = functions(name)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args = make_args(rng, op, 40, 6)
    if op.integers:
        args = (jnp.asarray(rng.integers(-50, 50, args[0].shape)), *args[1:])
    idx = sorted_ids(rng, 40, 6)
    for ids in (idx, jnp.asarray(rng.permutation(np.asarray(idx)))):
        got, want = ours(*args, ids, 6, **op.params), theirs(*args, ids, 6, **op.params)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-13)


@pytest.mark.parametrize("name", sampled(NAMES, [()], 2, 1))
def test_no_rows(name):
    ours, theirs, op = functions(name)
    args = make_args(np.random.default_rng(0), op, 0, 4)
    idx = jnp.zeros((0,), jnp.int32)
    assert_close(ours(*args, idx, 4), theirs(*args, idx, 4), 0)
    grads = jax.grad(lambda *a: jnp.sum(ours(*a, idx, 4)), tuple(range(len(args))))(*args)
    assert [g.shape for g in grads] == [a.shape for a in args]
    assert all(np.all(np.asarray(g) == 0) for g in grads)


@pytest.mark.parametrize("name", NAMES)
def test_no_segments(name):
    ours, theirs, op = functions(name)
    rng = np.random.default_rng(0)
    args = make_args(rng, op, 6, 0)
    idx = jnp.zeros((6,), jnp.int32)
    out = ours(*args, idx, 0)
    assert_close(out, theirs(*args, idx, 0), 0)
    grads = jax.grad(lambda *a: jnp.sum(ours(*a, idx, 0)), tuple(range(len(args))))(*args)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


@pytest.mark.parametrize("name", sampled(NAMES, [()], 2, 0))
def test_one_segment(name):
    args, _tangents, _, _, _ = setup(name, m=1)
    ours, theirs, _ = functions(name)
    idx = jnp.zeros((23,), jnp.int32)
    assert_close(ours(*args, idx, 1), theirs(*args, idx, 1), 1e-13)
    def weighted(f):  # not a plain sum, which is constant for softmax
        def loss(a):
            out = f(a, *args[1:], idx, 1)
            return jnp.vdot(jnp.linspace(0.5, 1.5, out.size), out.ravel())
        return loss

    h = jax.jit(jax.hessian(weighted(ours)))(args[0])
    h_ref = jax.jit(jax.hessian(weighted(theirs)))(args[0])
    assert_close(h, h_ref, 1e-10)


@pytest.mark.parametrize(
    "name", sampled([n for n in NAMES if OPS[n].output_per == "structure"], [()], 2, 1))
def test_empty_segments_give_the_reference_and_finite_gradients(name):
    ours, theirs, op = functions(name)
    x, *rest = make_args(np.random.default_rng(1), op, 5, 4)
    idx = jnp.asarray([0, 0, 2, 2, 2], jnp.int32)
    assert_close(ours(x, *rest, idx, 4), theirs(x, *rest, idx, 4), 1e-13)

    def total(a):
        out = ours(a, *rest, idx, 4)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0))  # the max of an empty one: -inf

    for derivative in (jax.grad, jax.hessian):
        assert np.all(np.isfinite(jax.jit(derivative(total))(x)))


@pytest.mark.parametrize("name", [n for n in NAMES if OPS[n].kinks in ZERO_AT_KINK])
def test_zero_vectors_have_zero_gradient(name):
    ours = OPS[name].function
    x = jnp.zeros((6, 3)).at[4].set(jnp.asarray([1.0, -2.0, 0.5]))
    idx = jnp.asarray([0, 0, 0, 1, 2, 2], jnp.int32)
    f = lambda a: jnp.sum(ours(a, idx, 3))
    g = jax.jit(jax.grad(f))(x)
    assert np.all(np.asarray(g)[:4] == 0)
    assert np.all(np.isfinite(jax.jit(jax.hessian(f))(x)))
    third = jax.jit(jax.grad(
        lambda a: jnp.vdot(jax.grad(lambda b: jnp.vdot(jax.grad(f)(b), a))(a), a)))(x)
    assert np.all(np.isfinite(third))


@pytest.mark.parametrize("name, sorted_", sampled(
    [n for n in NAMES if OPS[n].output_per == "structure"], [True, False], 2))
def test_nan_stays_in_its_segment(name, sorted_):
    ours, _, op = functions(name)
    rng = np.random.default_rng(5)
    args = list(make_args(rng, op, 12, 3))
    args[0] = args[0].at[5].set(jnp.nan)
    idx = np.repeat(np.arange(3), 4).astype(np.int32)
    if not sorted_:
        perm = rng.permutation(12)
        idx, args = idx[perm], [a[perm] for a in args]
    out = np.asarray(ours(*args, jnp.asarray(idx), 3))
    nan_rows = np.isnan(out).reshape(3, -1).any(axis=1)
    assert nan_rows.tolist() == [False, True, False]


def test_max_norm_gradient_goes_to_first_attaining_row():
    x = jnp.asarray([[3.0, 4.0], [0.0, 5.0], [1.0, 0.0], [-5.0, 0.0], [0.0, 1.0]])
    grad = lambda ids: np.asarray(jax.grad(lambda a: jnp.sum(ops.segmented_max_norm(a, ids, 2)))(x))
    # segment 0 ties rows 0 and 1 (norm 5): row 0 takes the gradient
    np.testing.assert_allclose(grad(jnp.asarray([0, 0, 0, 1, 1], jnp.int32)),
                               [[0.6, 0.8], [0, 0], [0, 0], [-1, 0], [0, 0]])
    # unsorted ids: segment 1 ties rows 0 and 3, row 0 wins; segment 0 is rows 1, 2, 4
    np.testing.assert_allclose(grad(jnp.asarray([1, 0, 0, 1, 0], jnp.int32)),
                               [[0.6, 0.8], [0, 1], [0, 0], [0, 0], [0, 0]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_and_min_gradients_go_to_each_entrys_own_first_row(kind, gpu_paths, dtype):
    """The gradient of Σ w · max (min) of (N, 3) rows, against NumPy: each component's weight
    at the first row attaining that component's extreme (its own row, not its neighbours'),
    0 elsewhere, an infinite weight included; with ties (small integers), empty segments, a
    segment of one row, ids out of range at both ends; ids promised sorted, and shuffled."""
    rng = np.random.default_rng(5)
    m = 40
    counts = rng.integers(0, 30, m)
    counts[[2, 9]] = 0
    counts[11] = 1
    inside = np.repeat(np.arange(m), counts)
    ids = np.concatenate([[-1], inside, [m + 2] * 3]).astype(np.int32)
    n = ids.size
    x = rng.integers(-6, 7, (n, 3)).astype(dtype)
    w = rng.normal(size=(m, 3)).astype(dtype)
    w[5, 0] = np.inf  # 0 still in the rows and components it does not reach
    pick = np.argmax if kind == "max" else np.argmin
    reduce = getattr(ops, f"segmented_{kind}")

    def expected(x, ids):
        grad = np.zeros((n, 3), dtype)
        for s in range(m):
            rows = np.flatnonzero(ids == s)
            for f in range(3 if rows.size else 0):
                grad[rows[pick(x[rows, f])], f] = w[s, f]  # argmax/argmin: the first
        return grad

    def loss(a, idx, sorted_):
        out = reduce(a, jnp.asarray(idx), m, indices_are_sorted=sorted_)
        return jnp.sum(jnp.asarray(w) * jnp.where(jnp.isfinite(out), out, 0))

    order = rng.permutation(n)
    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        for data, idx, sorted_ in [(x, ids, True), (x[order], ids[order], False)]:
            got = np.asarray(jax.grad(loss)(jnp.asarray(data), idx, sorted_))
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, expected(data, idx))
    finally:
        _primitives.lower_cpu_as_gpu(False)


def _max_norm_reference(x, ids, m):
    """NumPy float64: each segment's largest norm (the first NaN if any, 0 if empty), and the
    gradient of their finite nonzero sum: x / |x| at the first row attaining each."""
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    values, grad = np.zeros(m), np.zeros(x.shape)
    for s in range(m):
        rows = np.flatnonzero(ids == s)
        if rows.size:
            nan = rows[np.isnan(norms[rows])]
            first = nan[0] if nan.size else rows[np.argmax(norms[rows])]  # the first of ties
            values[s] = norms[first]
            if np.isfinite(norms[first]) and norms[first] > 0:
                grad[first] = x[first] / norms[first]
    return values, grad


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gpu_paths", [False, True])
def test_max_norm_picks_the_first_largest_row_in_any_id_order(gpu_paths, dtype):
    """float32 (on GPUs a search by packed keys) and float64, in any order of the ids (ordered:
    on GPUs a group of lanes a segment, up to 44 rows, so that each lane takes several): the
    values and the row that takes the gradient, against NumPy, with ties, NaN, inf, rows whose
    squares overflow float32, zero rows, empty segments and dropped ids; sorted (as a Segments
    too, and promised with dropped ids at both ends) and not."""
    rng = np.random.default_rng(11)
    # ties exact in float32 however the squares are added (a GPU fuses them into FMAs)
    vectors = np.array([[3, 4, 0], [0, 5, 0], [0, 0, -5], [1, 0, 0], [5, 12, 0], [0, 0, 0],
                        [1.5e38, 2e38, 0], [3e38, 0, 0], [0, -3e38, 0]], dtype)
    m = 60
    counts = rng.integers(0, 45, m)
    counts[[3, 17]] = 0
    ids = np.repeat(np.arange(m), counts).astype(np.int32)
    x = vectors[rng.integers(0, len(vectors), ids.size)]
    x[rng.integers(0, ids.size, 3)] = [np.nan, 1, 0]
    x[rng.integers(0, ids.size, 2)] = [np.inf, 0, 0]
    long = np.flatnonzero(counts >= 12)[:2]  # two NaN rows of one segment, in other lanes
    x[np.cumsum(counts)[long[0]] - counts[long[0]] + np.array([2, 9])] = [np.nan, 0, 0]
    x[np.cumsum(counts)[long[1]] - counts[long[1]] + np.array([4, 11])] = [np.inf, 0, 0]
    order = rng.permutation(ids.size)
    shuffled = np.where(rng.random(ids.size) < 0.1, [-1, m + 3][rng.integers(0, 2)], ids)[order]
    dropped = np.concatenate([[-1, -1], ids, [m, m + 3]]).astype(np.int32)  # sorted still
    padded = np.concatenate([x[:2], x, x[-2:]])
    layouts = [(x, ids, ids, False), (x, ops.segments(counts), ids, False), (x, ids, ids, True),
               (padded, dropped, dropped, True), (x[order], shuffled, shuffled, False)]
    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        for data, idx, plain, sorted_ in layouts:
            values, grad = _max_norm_reference(data, plain, m)
            def total(a, idx=idx, sorted_=sorted_):
                out = ops.segmented_max_norm(a, idx, m, indices_are_sorted=sorted_)
                return out, jnp.sum(jnp.where(jnp.isfinite(out), out, 0))
            out = total(jnp.asarray(data))[0]
            assert out.dtype == dtype
            np.testing.assert_allclose(np.asarray(out), values.astype(dtype), rtol=1e-7)
            got = jax.grad(lambda a, f=total: f(a)[1])(jnp.asarray(data))
            # rows of segments whose norm is inf or NaN are left out (0 · NaN there)
            segment = np.where((plain >= 0) & (plain < m), plain, m)
            finite = np.isfinite(np.append(values, 0))[segment]
            np.testing.assert_allclose(np.asarray(got)[finite], grad[finite], rtol=1e-6, atol=0)
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
def test_max_norm_ties_of_norms_whose_squares_differ(gpu_paths):
    """Rows (1, 0, 0) and (1, 2⁻²⁶, 0): squares 1 and 1 + 2⁻⁵², both norm 1.0 in float64. The
    gradient goes to the first of them in either order, whatever comes before or after; a
    row of norm 1 + 2⁻⁵¹ beats both."""
    one, tied, above = [1.0, 0, 0], [1.0, 2.0 ** -26, 0], [1.0, 2.0 ** -25, 0]
    assert np.sqrt(1 + 2.0 ** -52) == 1.0 and np.sqrt(1 + 2.0 ** -50) > 1.0
    segments = [[one, tied], [tied, one], [[0.5, 0, 0], one, [0, 0.5, 0], tied, [0, 0, 0.1]],
                [tied, [0.5, 0, 0], one], [one, tied, above], [above, one, tied]]
    x = np.array([row for rows in segments for row in rows])
    ids = np.repeat(np.arange(len(segments)), [len(rows) for rows in segments]).astype(np.int32)
    norms = np.sqrt(np.sum(x * x, axis=1))
    expected = np.zeros_like(x)
    for s in range(len(segments)):
        rows = np.flatnonzero(ids == s)
        first = rows[np.argmax(norms[rows])]  # argmax: the first of ties
        expected[first] = x[first] / norms[first]
    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        for sorted_ in (False, True):
            grad = jax.grad(lambda a, sorted_=sorted_: jnp.sum(ops.segmented_max_norm(
                a, jnp.asarray(ids), len(segments), indices_are_sorted=sorted_)))(jnp.asarray(x))
            np.testing.assert_array_equal(np.flatnonzero(np.asarray(grad)[:, 0]),
                                          np.flatnonzero(expected[:, 0]))
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
def test_max_norm_ties_go_to_the_first_row_wherever_they_fall(gpu_paths):
    """Segments of 1..12 rows drawn from vectors of norm 5 (ties) and 1: the gradient goes to
    the first row of norm 5 wherever the ties fall in a segment."""
    rng = np.random.default_rng(7)
    vectors = np.array([[3.0, 4, 0], [0, 5, 0], [4, 0, -3], [0, 0, 5], [1, 0, 0], [0, -1, 0]])
    counts = rng.integers(1, 13, 40)
    ids = np.repeat(np.arange(40), counts).astype(np.int32)
    x = vectors[rng.integers(0, 6, ids.size)]
    expected = np.zeros_like(x)
    for s in range(40):
        rows = np.flatnonzero(ids == s)
        norms = np.linalg.norm(x[rows], axis=1)
        first = rows[np.argmax(norms)]  # argmax: the first of ties
        expected[first] = x[first] / norms.max()
    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        for sorted_ in (False, True):
            grad = jax.grad(lambda a, sorted_=sorted_: jnp.sum(ops.segmented_max_norm(
                a, jnp.asarray(ids), 40, indices_are_sorted=sorted_)))(jnp.asarray(x))
            np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-12, atol=0)
    finally:
        _primitives.lower_cpu_as_gpu(False)


def special_rows(rng, counts, dtype):
    """Rows of 3 for segments of `counts` rows: normal ones, and whole segments of rows whose
    squares overflow, underflow or tie (the rescaled and the careful paths of rms_norm and
    max_norm), of NaN and of inf."""
    x = rng.normal(size=(counts.sum(), 3)).astype(dtype)
    starts = np.cumsum(counts) - counts
    big, tiny = np.finfo(dtype).max / 4, np.finfo(dtype).tiny * 4
    for k, fill in enumerate(([big, -big, big], [tiny, 0, -tiny], [3, 4, 0], [np.nan, 0, 1],
                              [np.inf, 0, 0])):
        s = np.flatnonzero(counts >= 9)[k]
        x[starts[s]:starts[s] + counts[s]] = fill
        x[starts[s] + 5] = [0, 5, 0]  # a tie of norm 5
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reductions_together_are_each_op_alone_bit_for_bit(dtype):
    """segmented_reductions against each op called alone: the same bits (the one-pass kernel
    on CPUs for rows of 3 with ids known sorted, each op's own kernels otherwise), for any
    set of the names in any order (repeats too), empty segments first, inside and last, a
    segment running to the end of x; the same derivatives (each output's VJP and a JVP, and
    finite differences), the same under vmap; float16 in and out; a bad name refused."""
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 30, 90)
    counts[[0, 40, -1]] = 0
    counts[-2] = 29
    m = counts.size
    x = special_rows(rng, counts, dtype)
    ids = np.repeat(np.arange(m), counts).astype(np.int32)
    alone = {name: getattr(ops, f"segmented_{name}") for name in ops.REDUCTIONS}
    sets = [ops.REDUCTIONS, ("max_norm", "mean"), ("rms_norm", "sum", "rms_norm"), ("mean",)]
    for idx, sorted_ in ((ops.segments(counts), False), (jnp.asarray(ids), True),
                         (jnp.asarray(ids), False)):
        for data in (x, x[:, :2], x[:, 0]):
            for names in sets:
                got = ops.segmented_reductions(data, idx, m, names, indices_are_sorted=sorted_)
                assert len(got) == len(names)
                for name, value in zip(names, got):
                    expected = alone[name](data, idx, m, indices_are_sorted=sorted_)
                    assert value.dtype == expected.dtype == dtype
                    np.testing.assert_array_equal(np.asarray(value), np.asarray(expected))
    # derivatives, on finite rows
    finite = jnp.asarray(rng.normal(size=x.shape).astype(dtype))
    seg = ops.segments(counts)
    weights = [jnp.asarray(rng.normal(size=(m, 3)[:1 + (n in ("sum", "mean"))]).astype(dtype))
               for n in ops.REDUCTIONS]
    for k, name in enumerate(ops.REDUCTIONS):
        pick = lambda a, k=k: jnp.sum(ops.segmented_reductions(a, seg, m, ops.REDUCTIONS)[k]
                                      * weights[k])
        one = lambda a, k=k, name=name: jnp.sum(alone[name](a, seg, m) * weights[k])
        np.testing.assert_array_equal(np.asarray(jax.grad(pick)(finite)),
                                      np.asarray(jax.grad(one)(finite)))
    direction = jnp.asarray(rng.normal(size=x.shape).astype(dtype))
    tangents = jax.jvp(lambda a: ops.segmented_reductions(a, seg, m, ops.REDUCTIONS),
                       (finite,), (direction,))[1]
    for name, tangent in zip(ops.REDUCTIONS, tangents):
        np.testing.assert_array_equal(np.asarray(tangent), np.asarray(
            jax.jvp(lambda a, name=name: alone[name](a, seg, m), (finite,), (direction,))[1]))
        if dtype == np.float64:  # float32 steps large enough to see cross max_norm's kinks
            f = lambda a, name=name: np.asarray(ops.segmented_reductions(a, seg, m, (name,))[0])
            numeric = (f(finite + 1e-6 * direction) - f(finite - 1e-6 * direction)) / 2e-6
            np.testing.assert_allclose(np.asarray(tangent), numeric, rtol=1e-6, atol=1e-8)
    batch = jnp.stack([finite, 2 * finite])
    mapped = jax.vmap(lambda a: ops.segmented_reductions(a, seg, m, ops.REDUCTIONS))(batch)
    for name, value in zip(ops.REDUCTIONS, mapped):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(
            jax.vmap(lambda a, name=name: alone[name](a, seg, m))(batch)))
    half = finite.astype(jnp.float16)
    for name, value in zip(ops.REDUCTIONS, ops.segmented_reductions(half, seg, m, ops.REDUCTIONS)):
        assert value.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(value), np.asarray(alone[name](half, seg, m)))
    with pytest.raises(ValueError, match="reductions must name one or more of sum, mean"):
        ops.segmented_reductions(finite, seg, m, ("sum", "dot"))
    for counts in ([], [0, 0]):  # no rows, no segments
        seg = ops.segments(np.array(counts, int))
        empty = jnp.zeros((0, 3), dtype)
        for name, value in zip(ops.REDUCTIONS, ops.segmented_reductions(
                empty, seg, len(counts), ops.REDUCTIONS)):
            np.testing.assert_array_equal(np.asarray(value),
                                          np.asarray(alone[name](empty, seg, len(counts))))


def rows_before_a_guard_page(rows):
    """A float64 (rows, 3) NumPy array whose last byte ends a page that a page no process may
    read follows: a kernel reading past its end is killed (SIGSEGV)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    size = rows * 3 * 8
    data_pages = -(-size // page)
    block = mmap.mmap(-1, (data_pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(block))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + data_pages * page, page, 0) == 0, ctypes.get_errno()
    return np.frombuffer(block, np.float64, rows * 3, data_pages * page - size).reshape(rows, 3)


def test_flat_launches_of_lane_groups_stay_within_warps_int_thread_index():
    """Groups of lanes are launched flat (groups · lanes threads); where that would pass
    2³¹ - 1 threads a group takes fewer lanes, the most that fit."""
    def lanes_for(groups, gpu, lanes=kernels.LANES):
        got, dims = kernels.lane_grid(groups, gpu, lanes)
        assert dims == (groups * got,)
        return got

    assert lanes_for(312_501, gpu=True) == kernels.LANES == 8
    assert lanes_for(312_501, gpu=False) == 1
    assert lanes_for(2**28 - 1, gpu=True) == 8
    assert lanes_for(2**28, gpu=True) == 4
    assert lanes_for(10**8, gpu=True, lanes=kernels.BINCOUNT_LANES) == 16
    for groups in (1, 2**26 + 1, 2**28 + 5, 2**29, 2**30 + 3):
        for lanes in (8, 32):
            got = lanes_for(groups, gpu=True, lanes=lanes)
            assert groups * got < 2**31
            assert got == lanes or groups * got * 2 >= 2**31


def test_cpu_kernels_read_no_row_past_the_end_of_x():
    """sum, mean, rms_norm, max_norm, dot and the reductions together, on rows of 3 that end
    where a guarded page begins (given to XLA without a copy, as the engine's mapped rows
    are), in segments whose last blocks of 8 rows run past x's end: the kernels stop at its
    last row. In a subprocess, which a read past the end kills."""
    code = """if True:
        import jax, numpy as np
        jax.config.update("jax_enable_x64", True)
        from segcli import ops
        from test_ops import rows_before_a_guard_page
        counts = np.array([3, 5, 0, 13, 1, 10])  # 32 rows (64-byte aligned): the 8-row
        # block from row 30 runs past the end, and the 8-entry block from entry 90
        x = rows_before_a_guard_page(int(counts.sum()))
        x[:] = np.random.default_rng(0).normal(size=x.shape)
        on_device = jax.device_put(x, may_alias=True)
        assert on_device.unsafe_buffer_pointer() == x.ctypes.data  # no copy
        seg, m = ops.segments(counts), len(counts)
        for name in ops.REDUCTIONS:
            got = np.asarray(getattr(ops, f"segmented_{name}")(on_device, seg, m))
            assert np.isfinite(got).all(), name
        ops.segmented_dot(on_device, on_device, seg, m).block_until_ready()
        ops.segmented_reductions(on_device, seg, m, ops.REDUCTIONS)[0].block_until_ready()
        print("read no row past x")
    """
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "read no row past x" in done.stdout, done.stderr[-2000:]


def test_reductions_together_are_one_primitive_and_each_alone_on_gpu_paths():
    """One segcli_reductions in the program; on the GPU's code paths (each op its own
    kernels) the same values as each op alone there."""
    rng = np.random.default_rng(4)
    counts = rng.integers(0, 12, 40)
    x = jnp.asarray(special_rows(rng, counts, np.float64))
    seg = ops.segments(counts)
    program = str(jax.make_jaxpr(lambda a: ops.segmented_reductions(
        a, seg, 40, ops.REDUCTIONS))(x))
    assert program.count("segcli_reductions") == 1
    _primitives.lower_cpu_as_gpu(True)
    try:
        got = ops.segmented_reductions(x, seg, 40, ops.REDUCTIONS)
        for name, value in zip(ops.REDUCTIONS, got):
            np.testing.assert_array_equal(np.asarray(value), np.asarray(
                getattr(ops, f"segmented_{name}")(x, seg, 40)))
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_norm_search_by_lanes_finds_the_first_of_ties_anywhere(dtype):
    """The CPU's ordered search takes rows 8 at a time in vector lanes. Segments of 1..40 rows
    drawn from rows of norm 1 whose squares differ by an ulp (`one`, `tied`: the same norm),
    rows beating them by one (`above`), smaller and zero rows, so that ties fall in one lane
    (8 rows apart) and across lanes, before and after the largest square; each next segment
    holds a larger norm, and the last runs to the end of x (its lanes past the end neither
    read nor counted). The gradient goes to the first row of the largest norm (NumPy float64
    norms in the dtype), for rows of 3 features, of 2 and of (2, 3), and batched by vmap."""
    unit = np.finfo(dtype).eps
    one, tied, above = [1.0, 0, 0], [1.0, np.sqrt(0.75 * unit), 0], [1.0, np.sqrt(4 * unit), 0]
    with np.errstate(over="ignore"):
        norms = np.linalg.norm(np.array([one, tied, above], dtype), axis=1)
    assert norms[0] == norms[1] < norms[2]
    assert (np.array(tied, dtype) ** 2).sum() > 1
    rng = np.random.default_rng(5)
    pool = np.array([one, tied, above, [0.5, 0, 0], [0, 0, 0], [0, 0.25, 0.5]], dtype)
    counts = rng.integers(1, 41, 150)
    counts[-1] = 37  # x ends 5 rows into a block of 8
    kinds = rng.choice(len(pool), counts.sum(), p=[0.2, 0.2, 0.02, 0.3, 0.08, 0.2])
    kinds[np.cumsum(counts) - counts] = 3  # no segment of zero rows alone
    x = pool[kinds] * np.repeat(2.0 ** (np.arange(counts.size) % 3), counts)[:, None].astype(dtype)
    ids = np.repeat(np.arange(counts.size), counts).astype(np.int32)

    def first_rows(x):
        norms = np.linalg.norm(x.reshape(len(x), -1).astype(np.float64), axis=1).astype(dtype)
        starts = np.cumsum(counts) - counts
        return np.array([s + np.argmax(norms[s:s + c]) for s, c in zip(starts, counts)])

    def chosen(x, idx):
        grad = jax.grad(lambda a: jnp.sum(ops.segmented_max_norm(a, idx, counts.size)))(x)
        return np.flatnonzero(np.any(np.asarray(grad).reshape(len(x), -1) != 0, axis=1))

    for data in (x, x[:, :2], np.stack([x, x[:, ::-1]], axis=1)):
        expected = first_rows(data)
        for idx in (ops.segments(counts), jnp.asarray(ids)):
            np.testing.assert_array_equal(chosen(jnp.asarray(data), idx), expected)
    # vmap: the batch's two arrays as two groups of one kernel
    batch = jnp.asarray(np.stack([x, x[::-1]]))
    values = jax.vmap(lambda a: ops.segmented_max_norm(a, ops.segments(counts), counts.size))(
        batch)
    for b, data in enumerate((x, x[::-1])):
        np.testing.assert_array_equal(
            np.asarray(values[b]), np.asarray(ops.segmented_max_norm(
                jnp.asarray(data), ops.segments(counts), counts.size)))


@pytest.mark.parametrize("gpu_paths", [False, True])
def test_sorted_results_are_bitwise_repeatable_and_flag_independent(gpu_paths):
    """Every op's value, and every differentiable op's gradient, on sorted ids: the same bits
    on every call, and with the sorted promise (on the CPU's code paths and the GPU's)."""
    rng = np.random.default_rng(2)
    n, m = 20_000, 600
    idx = jnp.asarray(np.sort(rng.integers(0, m, n)), jnp.int32)
    args = {name: make_args(rng, op, n, m) for name, op in OPS.items()}

    def f(promise):
        def run(args):
            out = {}
            for name, op in OPS.items():
                call = lambda *a, op=op: op.apply(*a, idx=idx, num_segments=m,
                                                  indices_are_sorted=promise, **op.params)
                out[name] = call(*args[name])
                if op.differentiable:
                    out[name + " grad"] = jax.grad(
                        lambda a, call=call, rest=args[name][1:]: jnp.sum(
                            jnp.nan_to_num(call(a, *rest)) ** 2))(args[name][0])
            return out
        return jax.jit(run)

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        unpromised = f(False)
        first = unpromised(args)
        for _ in range(3):
            again = unpromised(args)
            assert all(np.array_equal(again[k], first[k], equal_nan=True) for k in first)
        promised = f(True)(args)
        assert [k for k in first if not np.array_equal(promised[k], first[k], equal_nan=True)] \
            == []
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.fixture
def gpu_code_paths():
    """Lower the ops on this CPU with the code paths a GPU takes (scan layout, many-thread
    atomics)."""
    _primitives.lower_cpu_as_gpu(True)
    yield
    _primitives.lower_cpu_as_gpu(False)


@pytest.mark.slow  # about 90 CPU-seconds; on a GPU the other tests take these paths anyway
@pytest.mark.parametrize("name", NAMES)
def test_gpu_code_paths(name, gpu_code_paths):
    for transform in ("value", "grad", "grad_grad", "jvp", "vmap"):
        test_transform_matches_reference_float64(name, transform)
    test_unsorted_ids_match_sorted(name)
    for sorted_ in (True, False):
        test_out_of_range_ids_are_dropped(name, np.int32, sorted_)
    test_no_segments(name)
    test_one_segment(name)


def test_matvec_gives_cartesian_positions():
    rng = np.random.default_rng(4)
    cells = jnp.asarray(rng.normal(size=(3, 3, 3)))
    scaled = jnp.asarray(rng.random(size=(7, 3)))
    idx = jnp.asarray([0, 0, 1, 1, 1, 2, 2], jnp.int32)
    expected = np.stack([np.asarray(scaled[i]) @ np.asarray(cells[idx[i]]) for i in range(7)])
    np.testing.assert_allclose(ops.segmented_matvec(scaled, cells, idx, 3), expected, rtol=1e-13)


def test_count_and_segment_ids():
    idx = jnp.asarray([2, 0, 2, -1, 5, 2], jnp.int32)
    assert ops.segmented_count(idx, 4).tolist() == [1, 0, 3, 0]
    assert ops.segmented_count(idx, 4).dtype == jnp.int32
    assert ops.segmented_count(jnp.zeros((0,), jnp.int32), 3).tolist() == [0, 0, 0]
    assert ops.segment_ids(np.asarray([2, 0, 3])).tolist() == [0, 0, 2, 2, 2]
    assert ops.segment_ids(np.asarray([], np.int64)).shape == (0,)
    with pytest.raises(ValueError, match="non-negative"):
        ops.segment_ids(np.asarray([1, -2]))


def test_check_segments_names_first_bad_position():
    ops.check_segments(np.asarray([0, 1, 1]), 2)
    with pytest.raises(ValueError, match=r"idx\[2\] = 7 is outside \[0, 3\)"):
        ops.check_segments(np.asarray([0, 2, 7, -1]), 3)
    with pytest.raises(ValueError, match=r"idx\[0\] = -1"):
        ops.check_segments(np.asarray([-1]), 3)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: ops.segmented_mean(jnp.ones((3, 2), jnp.int32), jnp.zeros(3, jnp.int32), 2),
         TypeError, "x must be a real floating.*segmented_sum, _max, _min"),
        (lambda: ops.segmented_sum(jnp.ones((3, 2), jnp.uint64), jnp.zeros(3, jnp.int32), 2),
         TypeError, "x must be a real floating-point or int8"),
        (lambda: ops.segmented_sum(jnp.ones((3, 2), jnp.complex64), jnp.zeros(3, jnp.int32), 2),
         TypeError, "complex64"),
        (lambda: ops.segmented_sum(jnp.ones((3, 2)), jnp.zeros(4, jnp.int32), 2),
         ValueError, r"idx has length 4 but x has 3 rows \(shape of idx: \(4,\), of x: \(3, 2\)\)"),
        (lambda: ops.segmented_sum(jnp.ones((3, 2)), jnp.zeros((3, 1), jnp.int32), 2),
         ValueError, r"one-dimensional.*\(3, 1\)"),
        (lambda: ops.segmented_sum(jnp.ones((3, 2)), jnp.zeros(3), 2),
         TypeError, "idx must hold integers"),
        (lambda: ops.segmented_sum(jnp.ones((3, 2)), jnp.zeros(3, jnp.int32), -1),
         ValueError, "num_segments must be a non-negative"),
        (lambda: ops.segmented_dot(jnp.ones((3, 2)), jnp.ones((3, 3)), jnp.zeros(3, jnp.int32), 2),
         ValueError, r"x \(3, 2\) and y \(3, 3\)"),
        (lambda: ops.segmented_mul(jnp.ones((3, 2)), jnp.ones(3), jnp.zeros(3, jnp.int32), 2),
         ValueError, r"y must have 2 rows.*\(3,\)"),
        (lambda: ops.segmented_mul(jnp.ones((3, 2)), jnp.ones((2, 2)), jnp.zeros(3, jnp.int32), 2),
         ValueError, r"y must have shape \(num_segments,\)"),
        (lambda: ops.segmented_matvec(jnp.ones((3, 3)), jnp.ones((2, 3, 2)),
                                      jnp.zeros(3, jnp.int32), 2),
         ValueError, r"m must have shape .*\(2, 3, 2\)"),
        (lambda: ops.segmented_matvec(jnp.ones((3, 2)), jnp.ones((2, 3, 3)),
                                      jnp.zeros(3, jnp.int32), 2),
         ValueError, r"v must have shape \(N, 3\)"),
        (lambda: ops.segmented_count(jnp.zeros((3, 1), jnp.int32), 2),
         ValueError, "one-dimensional"),
        (lambda: jax.jit(lambda m: ops.segmented_sum(jnp.ones(3), jnp.zeros(3, jnp.int32), m))(2),
         TypeError, "static"),
    ],
)
def test_bad_calls_raise_at_trace_time(call, error, message):
    with pytest.raises(error, match=message):
        call()


def segments_of(idx, m):
    """ops.Segments of sorted ids over m segments, offsets from NumPy."""
    ids = np.asarray(idx)
    offsets = np.searchsorted(ids, np.arange(m + 1), side="left").astype(np.int32)
    return ops.Segments(jnp.asarray(ids), jnp.asarray(offsets))


@pytest.mark.parametrize("name, transform", sampled(NAMES, ["jit", "grad_grad", "jvp", "vmap"], 8))
def test_segments_give_the_values_of_their_ids(name, transform):
    rng = np.random.default_rng(zlib.crc32(f"{name} {transform}".encode()))
    ours, theirs, op = functions(name)
    n, m = 29, 7
    args, tangents = make_args(rng, op, n, m), make_args(rng, op, n, m)
    idx = sorted_ids(rng, n, m)
    weights = jnp.asarray(rng.normal(size=np.shape(theirs(*args, idx, m))))

    def bound(segment_ids):
        f = lambda *a: ours(*a, segment_ids, m)
        return f, lambda *a: jnp.sum(weights * f(*a))

    with_segments = TRANSFORMS[transform](*bound(segments_of(idx, m)), args, tangents)
    with_ids = TRANSFORMS[transform](*bound(idx), args, tangents)
    for a, b in zip(jax.tree.leaves(with_segments), jax.tree.leaves(with_ids), strict=True):
        # the same reductions in the same order; XLA may fuse the arithmetic around them
        # differently (a division of the counts one way, a reciprocal the other)
        np.testing.assert_array_max_ulp(a, b, maxulp=2)
    f_ref = lambda *a: theirs(*a, idx, m)
    reference = TRANSFORMS[transform](f_ref, lambda *a: jnp.sum(weights * f_ref(*a)), args,
                                      tangents)
    assert_tree_close(with_segments, reference, rtol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_written_a_segment_at_a_time_are_those_written_a_row_at_a_time(dtype):
    """On CPUs, given a Segments, the scale kernels of mul, dot's derivatives and rms_norm's
    first and second derivatives, the gather of sum's and mean's derivatives, and matvec
    (and its transpose, in its derivative) take a segment a thread: the bits of the same ids
    given alone (a row a thread), rows ahead of the first segment and after the last 0, as
    the reference says."""
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU's kernels on any machine
        check_rows_written_a_segment_at_a_time(dtype)


def check_rows_written_a_segment_at_a_time(dtype):
    rng = np.random.default_rng(12)
    n, m = 40, 7
    ids = np.sort(rng.choice([-1, 0, 2, 3, 5, 6, 7], size=n))  # -1 and m: outside them all
    ids[[0, -1]] = -1, m
    offsets = np.searchsorted(ids, np.arange(m + 1), side="left").astype(np.int32)
    x, v = (jnp.asarray(rng.normal(size=(n, 3)).astype(dtype)) for _ in range(2))
    y, w = (jnp.asarray(rng.normal(size=m).astype(dtype)) for _ in range(2))
    w3 = rng.normal(size=(m, 3)).astype(dtype)
    cells = jnp.asarray(rng.normal(size=(m, 3, 3)).astype(dtype))
    calls = {
        "matvec": lambda idx: ops.segmented_matvec(x, cells, idx, m),
        "grad matvec": lambda idx: jax.grad(
            lambda a: jnp.sum(v * ops.segmented_matvec(a, cells, idx, m)))(x),
        "grad sum": lambda idx: jax.grad(
            lambda a: jnp.sum(w3 * ops.segmented_sum(a, idx, m)))(x),
        "grad mean": lambda idx: jax.grad(
            lambda a: jnp.sum(w3 * ops.segmented_mean(a, idx, m)))(x),
        "mul": lambda idx: ops.segmented_mul(x, y, idx, m),
        "grad dot": lambda idx: jax.grad(
            lambda a: jnp.sum(w * ops.segmented_dot(a, v, idx, m)))(x),
        "grad rms_norm": lambda idx: jax.grad(
            lambda a: jnp.sum(w * ops.segmented_rms_norm(a, idx, m)))(x),
        "hvp rms_norm": lambda idx: jax.jvp(jax.grad(
            lambda a: jnp.sum(w * ops.segmented_rms_norm(a, idx, m))), (x,), (v,))[1],
    }
    inside = (ids >= 0) & (ids < m)
    counts = np.bincount(ids[inside], minlength=m).astype(np.float64)
    per_row = np.where(inside[:, None], np.pad(w3.astype(np.float64), ((0, 1), (0, 0)))[ids], 0)
    references = {"mul": lambda: OPS["mul"].reference(x, y, jnp.asarray(ids), m),
                  "matvec": lambda: OPS["matvec"].reference(x, cells, jnp.asarray(ids), m),
                  "grad sum": lambda: per_row,
                  "grad mean": lambda: per_row / np.maximum(counts, 1)[np.where(inside, ids, 0),
                                                                       None]}
    segments = ops.Segments(jnp.asarray(ids, jnp.int32), jnp.asarray(offsets))
    for name, call in calls.items():
        by_segment, by_row = call(segments), call(jnp.asarray(ids, jnp.int32))
        np.testing.assert_array_equal(by_segment, by_row, err_msg=name)
        outside = (ids < 0) | (ids >= m)
        assert not np.asarray(by_segment)[outside].any(), name
        if name in references:
            np.testing.assert_allclose(by_segment, references[name](), rtol=1e-6, err_msg=name)


def derivative_calls(op, seg, m, weights_too=False):
    """name -> f(x, w, v): the gradient of Σ w · op(x, seg, m) in x, the gradient of
    <gradient, v> in x (and with `weights_too` in w), and the JVP of the gradient along v."""

    def grad(a, weights):
        return jax.grad(lambda a: jnp.sum(weights * op(a, seg, m)))(a)

    calls = {"grad": lambda a, weights, _: grad(a, weights),
             "grad2": lambda a, weights, v: jax.grad(lambda a: jnp.sum(grad(a, weights) * v))(a),
             "hvp": lambda a, weights, v: jax.jvp(lambda a: grad(a, weights), (a,), (v,))[1]}
    if weights_too:
        calls["grad2_weights"] = lambda a, weights, v: jax.grad(
            lambda weights: jnp.sum(grad(a, weights) * v))(weights)
    return calls


def edge_case_segments(rng, n, m):
    """n sorted ids over m = 9 segments: 2, 5, 7 empty, 6 of one row, -1 and 9 outside (rows of
    no segment); the same as a Segments (with their offsets); whether each row is inside."""
    ids = np.sort(np.append(rng.choice([-1, 0, 1, 3, 4, 8, 9], size=n - 1), 6))
    offsets = np.searchsorted(ids, np.arange(m + 1), side="left").astype(np.int32)
    return (ids, ops.Segments(jnp.asarray(ids, jnp.int32), jnp.asarray(offsets)),
            (ids >= 0) & (ids < m))


def kernel_calls(function, *args):
    """The custom calls (kernel launches) in the program XLA compiles for function(*args)."""
    compiled = jax.jit(function).lower(*args).compile().as_text()
    return compiled[compiled.index("ENTRY"):].count(" custom-call(")


def check_derivative_calls(op, segments, ids, m, inputs, launches, tolerance, zero_rows,
                           weights_per_row, order):
    """derivative_calls(op, segments, m, weights_too=True), returned, after checking them over
    the batch `inputs` (x, w, v): each compiles to `launches[name]` custom calls; vmap gives
    each example's values; the same ids alone give the same bits; the rows permuted by `order`
    (their ids, and the weights too where they are per row) the same values; rows where
    `zero_rows` get 0."""
    calls, by_ids, shuffled = (derivative_calls(op, seg, m, weights_too=True) for seg in (
        segments, jnp.asarray(ids, jnp.int32), jnp.asarray(ids[order], jnp.int32)))
    a, weights, along = inputs
    for name, call in calls.items():
        assert kernel_calls(call, a[0], weights[0], along[0]) == launches[name], name
        per_row = name != "grad2_weights" or weights_per_row
        batched = jax.jit(jax.vmap(call))(a, weights, along)
        for k in range(a.shape[0]):
            one = jax.jit(call)(a[k], weights[k], along[k])
            scale = tolerance * np.max(np.abs(one))
            np.testing.assert_allclose(batched[k], one, rtol=0, atol=scale, err_msg=name)
            np.testing.assert_array_equal(jax.jit(by_ids[name])(a[k], weights[k], along[k]),
                                          one, err_msg=name)
            w = weights[k][order] if weights_per_row else weights[k]
            mixed = np.asarray(jax.jit(shuffled[name])(a[k][order], w, along[k][order]))
            if per_row:
                mixed = mixed[np.argsort(order)]
                assert not np.asarray(one)[zero_rows].any(), name
            np.testing.assert_allclose(mixed, one, rtol=0, atol=scale, err_msg=name)
    return calls


@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rms_norm_derivatives_over_known_sorted_ids_are_one_kernel_each(gpu_paths, dtype):
    """Given a Segments, rms_norm's gradient and its second derivatives (the gradient of
    <gradient, v>, and the JVP of the gradient along v) each sum the norms in the kernel that
    writes the rows: each program launches that kernel alone (the forward's is dropped). The
    gradient is checked against NumPy in float64, and the second derivative against central
    differences of the gradient in float64; all three against the same ids given alone (bit for
    bit where both sum the norms alike: not float32 on the GPU's paths, whose ids not known
    sorted sum them in float64), with 0 in rows of no segment; and batched by vmap (the batch
    as groups of the kernel, whose sums run in another order) each example's to 16 units in
    the last place of its largest entry."""
    rng = np.random.default_rng(31)
    n, m, batch = 50, 9, 3
    ids = np.sort(rng.choice([-1, 0, 1, 3, 4, 6, 8, 9], size=n))  # 2, 5, 7 empty; -1, 9 outside
    offsets = np.searchsorted(ids, np.arange(m + 1), side="left").astype(np.int32)
    segments = ops.Segments(jnp.asarray(ids, jnp.int32), jnp.asarray(offsets))
    x = rng.normal(size=(batch, n, 3))
    x[:, ids == 4] = 0  # a segment whose norm is 0: every derivative 0
    v = rng.normal(size=(batch, n, 3))
    w = rng.normal(size=(batch, m))
    inside = (ids >= 0) & (ids < m)

    def derivatives(seg):
        return derivative_calls(ops.segmented_rms_norm, seg, m)

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        a, weights, along = (jnp.asarray(array, dtype) for array in (x, w, v))
        by_ids = derivatives(jnp.asarray(ids, jnp.int32))
        for name, call in derivatives(segments).items():
            assert kernel_calls(call, a[0], weights[0], along[0]) == 1, name
            batched = jax.jit(jax.vmap(call))(a, weights, along)
            for k in range(batch):
                one = jax.jit(call)(a[k], weights[k], along[k])
                scale = 16 * np.finfo(dtype).eps * np.max(np.abs(one))
                np.testing.assert_allclose(batched[k], one, rtol=0, atol=scale, err_msg=name)
                alone = jax.jit(by_ids[name])(a[k], weights[k], along[k])
                if (gpu_paths or jax.default_backend() == "gpu") and dtype == np.float32:
                    np.testing.assert_allclose(one, alone, rtol=0, atol=scale, err_msg=name)
                else:
                    np.testing.assert_array_equal(one, alone, err_msg=name)
                assert not np.asarray(one)[~inside].any(), name
        xk, wk, vk = x[0], w[0], v[0]
        s = np.clip(ids, 0, m - 1)

        def numpy_grad(xk):
            squares = np.bincount(ids[inside], np.sum(xk[inside] ** 2, axis=1), minlength=m)
            counts = np.bincount(ids[inside], minlength=m)
            norms = np.sqrt(squares / np.maximum(counts, 1))
            return np.where((inside & (norms[s] > 0))[:, None], xk * (wk[s] / (
                np.maximum(counts[s], 1) * np.where(norms[s] > 0, norms[s], 1)))[:, None], 0)

        tolerance = 2e-5 if dtype == np.float32 else 1e-9
        calls = derivatives(segments)
        np.testing.assert_allclose(jax.jit(calls["grad"])(a[0], weights[0], along[0]),
                                   numpy_grad(xk), rtol=tolerance, atol=1e-30)
        # d/dt grad(x + t v) at 0, the Hessian (symmetric) along v; v 0 on the segment whose
        # norm is 0, where the gradient jumps (and its derivative is taken as 0)
        vk = np.where((ids == 4)[:, None], 0, vk)
        step = 1e-6
        central = (numpy_grad(xk + step * vk) - numpy_grad(xk - step * vk)) / (2 * step)
        for name in ("grad2", "hvp"):
            np.testing.assert_allclose(
                jax.jit(calls[name])(a[0], weights[0], jnp.asarray(vk, dtype)), central,
                rtol=max(tolerance, 1e-6), atol=1e-7, err_msg=name)
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
def test_var_and_std_are_one_kernel_over_ordered_ids_and_numpy_s_values_over_any(gpu_paths):
    """var and std take both passes of each segment in one kernel where the ids are ordered (one
    custom call in the compiled program given a Segments, std's gradient too), the same bits
    whether the order is promised or found; unordered ids (atomic sums, then the squares about
    their means) give NumPy's float64 values too. Rows of no segment count nowhere; an empty
    segment gives 0."""
    rng = np.random.default_rng(41)
    n, m = 60, 9
    ids, segments, inside = edge_case_segments(rng, n, m)
    x = rng.normal(size=(n, 3)) * 10.0 ** rng.integers(-3, 4, size=(n, 1)) + 1e3
    w = rng.normal(size=(m, 3))
    expected = np.zeros((m, 3))
    for s in range(m):
        if np.any(ids == s):
            expected[s] = np.var(x[ids == s], axis=0)

    def loss(a, seg):
        return jnp.sum(w * ops.segmented_std(a, seg, m))

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        a = jnp.asarray(x)
        calls = {"var": lambda a: ops.segmented_var(a, segments, m),
                 "grad": jax.grad(lambda a: loss(a, segments))}
        for name, call in calls.items():
            assert kernel_calls(call, a) == 1, name
        promised = ops.segmented_var(a, segments, m)
        np.testing.assert_allclose(promised, expected, rtol=1e-12, atol=1e-300)
        np.testing.assert_array_equal(ops.segmented_var(a, jnp.asarray(ids, jnp.int32), m),
                                      promised)
        order = rng.permutation(n)
        shuffled = ops.segmented_var(a[order], jnp.asarray(ids[order], jnp.int32), m)
        np.testing.assert_allclose(shuffled, expected, rtol=1e-12, atol=1e-300)
        grad = np.asarray(calls["grad"](a))
        assert not grad[~inside].any()
        shuffled_grad = jax.grad(lambda a: loss(a, jnp.asarray(ids[order], jnp.int32)))(a[order])
        np.testing.assert_allclose(np.asarray(shuffled_grad)[np.argsort(order)], grad,
                                   rtol=1e-10, atol=1e-14)
        step = 1e-4
        for i, k in ((0, 0), (n // 2, 1), (n - 5, 2)):
            bump = np.zeros_like(x)
            bump[i, k] = step
            central = (float(loss(a + bump, segments)) - float(loss(a - bump, segments))) / (
                2 * step)
            np.testing.assert_allclose(grad[i, k], central, rtol=1e-6, atol=1e-9)
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_var_derivatives_are_one_kernel_each_and_numpy_s_values(gpu_paths, dtype):
    """Given a Segments, var's gradient and its second derivatives (the gradient of
    <gradient, v> in x and in the weights, and the JVP of the gradient along v) each compile to
    one kernel on GPUs' paths, a group of lanes per segment and feature (on CPUs the mean's,
    XLA's fusions and in the weights' derivative a sum's). The
    gradient equals NumPy's float64 2 (x - mean) w / count, the second derivative central
    differences of it; the same ids alone give the same bits (the order found at run time),
    shuffled ids the same values (atomic sums); rows of no segment and empty segments get 0;
    vmap gives each example's values."""
    rng = np.random.default_rng(43)
    n, m, batch = 60, 9, 3
    ids, segments, inside = edge_case_segments(rng, n, m)
    x = rng.normal(size=(batch, n, 3)) * 10.0 ** rng.integers(-2, 3, size=(batch, n, 1))
    w, v = rng.normal(size=(batch, m, 3)), rng.normal(size=(batch, n, 3))
    s = np.clip(ids, 0, m - 1)

    def numpy_grad(xk, wk):
        counts = np.maximum(np.bincount(ids[inside], minlength=m), 1)
        means = np.stack([np.bincount(ids[inside], xk[inside, k], minlength=m)
                          for k in range(3)], axis=1) / counts[:, None]
        return np.where(inside[:, None], 2 * (xk - means[s]) * wk[s] / counts[s, None], 0)

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        a, weights, along = (jnp.asarray(array, dtype) for array in (x, w, v))
        tolerance = 2e-5 if dtype == np.float32 else 1e-11
        gpu = gpu_paths or jax.default_backend() == "gpu"
        launches = {"grad": 1, "grad2": 1, "hvp": 1, "grad2_weights": 1 if gpu else 2}
        calls = check_derivative_calls(ops.segmented_var, segments, ids, m, (a, weights, along),
                                       launches, tolerance, ~inside, weights_per_row=False,
                                       order=rng.permutation(n))
        xk, wk, vk = x[0], w[0], v[0]
        expected = numpy_grad(xk, wk)
        np.testing.assert_allclose(calls["grad"](a[0], weights[0], along[0]), expected,
                                   rtol=tolerance, atol=tolerance * np.max(np.abs(expected)))
        step = 1e-3
        central = (numpy_grad(xk + step * vk, wk) - numpy_grad(xk - step * vk, wk)) / (2 * step)
        for name in ("grad2", "hvp"):
            np.testing.assert_allclose(calls[name](a[0], weights[0], along[0]), central,
                                       rtol=tolerance, atol=tolerance * np.max(np.abs(central)),
                                       err_msg=name)
        # d/dw <grad, v> = <grad(x, e_j), v> for each unit weight e_j: the gradient is linear in w
        units = np.eye(m * 3).reshape(m * 3, m, 3)
        exact = np.array([np.sum(numpy_grad(xk, unit) * vk) for unit in units]).reshape(m, 3)
        np.testing.assert_allclose(calls["grad2_weights"](a[0], weights[0], along[0]), exact,
                                   rtol=tolerance, atol=tolerance * np.max(np.abs(exact)))
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_std_derivatives_are_one_kernel_each_and_numpy_s_values(gpu_paths, dtype):
    """Given a Segments, std's gradient, its second derivatives (the gradient of <gradient, v>
    in x and in the weights, the JVP of the gradient along v) and its JVP each compile to one
    kernel on GPUs' paths, a group of lanes per segment and feature (on CPUs the moments' and
    XLA's fusions, and one mean or sum for the second derivatives and the JVP). The gradient
    equals NumPy's float64 (x - mean) w / (count · std), the second derivatives central
    differences of it, the JVP NumPy's Σ (x - mean) v / (count · std), a third derivative (in the
    weights, of the JVP of the gradient) the pure-JAX reference's; the same ids alone give
    the same bits, shuffled ids the same values; rows of no segment, empty segments and segments
    whose std is 0 (of zeros, of one row) get 0; vmap gives each example's values."""
    rng = np.random.default_rng(47)
    n, m, batch = 60, 9, 3
    ids, segments, inside = edge_case_segments(rng, n, m)  # and 3 of zeros: std 0 exactly
    x = rng.normal(size=(batch, n, 3)) * 10.0 ** rng.uniform(-1, 1, size=(batch, n, 1))
    x[:, ids == 3] = 0
    w, v = rng.normal(size=(batch, m, 3)), rng.normal(size=(batch, n, 3))
    s = np.clip(ids, 0, m - 1)

    def numpy_scaled_deviations(xk):  # (x - mean) / (count · std), 0 where std is 0
        counts = np.maximum(np.bincount(ids[inside], minlength=m), 1)[:, None]
        means = np.stack([np.bincount(ids[inside], xk[inside, k], minlength=m)
                          for k in range(3)], axis=1) / counts
        deviations = np.where(inside[:, None], xk - means[s], 0)
        var = np.stack([np.bincount(ids[inside], deviations[inside, k] ** 2, minlength=m)
                        for k in range(3)], axis=1) / counts
        std = np.sqrt(var)
        scale = np.where(var > 0, 1 / (counts * np.where(var > 0, std, 1)), 0)
        return deviations * scale[s]

    def numpy_grad(xk, wk):
        return numpy_scaled_deviations(xk) * wk[s]

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        a, weights, along = (jnp.asarray(array, dtype) for array in (x, w, v))
        tolerance = 2e-5 if dtype == np.float32 else 1e-11
        gpu = gpu_paths or jax.default_backend() == "gpu"
        launches = {"grad": 1, "grad2": 1 if gpu else 2, "hvp": 1 if gpu else 2,
                    "grad2_weights": 1 if gpu else 2}
        calls = check_derivative_calls(ops.segmented_std, segments, ids, m, (a, weights, along),
                                       launches, tolerance, ~inside | (ids == 3) | (ids == 6),
                                       weights_per_row=False, order=rng.permutation(n))
        xk, wk, vk = x[0], w[0], v[0]
        expected = numpy_grad(xk, wk)
        np.testing.assert_allclose(calls["grad"](a[0], weights[0], along[0]), expected,
                                   rtol=tolerance, atol=tolerance * np.max(np.abs(expected)))
        # v 0 where std is 0, where the gradient jumps (and its derivative is taken as 0)
        vk = np.where(((ids == 3) | (ids == 6))[:, None], 0, vk)
        step = 1e-5
        central = (numpy_grad(xk + step * vk, wk) - numpy_grad(xk - step * vk, wk)) / (2 * step)
        bound = max(tolerance, 1e-7)
        for name in ("grad2", "hvp"):
            np.testing.assert_allclose(calls[name](a[0], weights[0], jnp.asarray(vk, dtype)),
                                       central, rtol=bound, atol=bound * np.max(np.abs(central)),
                                       err_msg=name)
        units = np.eye(m * 3).reshape(m * 3, m, 3)
        exact = np.array([np.sum(numpy_grad(xk, unit) * vk) for unit in units]).reshape(m, 3)
        np.testing.assert_allclose(
            calls["grad2_weights"](a[0], weights[0], jnp.asarray(vk, dtype)), exact,
            rtol=tolerance, atol=tolerance * np.max(np.abs(exact)))
        # the JVP: <(x - mean) / (count · std), v> per segment, one kernel on GPUs' paths
        def jvp(a, v):
            return jax.jvp(lambda a: ops.segmented_std(a, segments, m), (a,), (v,))[1]

        assert kernel_calls(jvp, a[0], along[0]) == (1 if gpu else 2)
        products = numpy_scaled_deviations(xk) * vk
        expected_jvp = np.stack([np.bincount(ids[inside], products[inside, k], minlength=m)
                                 for k in range(3)], axis=1)
        np.testing.assert_allclose(jax.jit(jvp)(a[0], jnp.asarray(vk, dtype)), expected_jvp,
                                   rtol=tolerance, atol=tolerance * np.max(np.abs(expected_jvp)))

        # the weights' derivative of <JVP of the gradient along v, u> (std_curvature's transpose
        # in its weights), against the pure-JAX reference's in float64
        def third(function, seg, xk, wk, uk):
            def hvp(wk):
                return jax.jvp(jax.grad(lambda b: jnp.sum(wk * function(b, seg, m))),
                               (xk,), (jnp.asarray(vk, xk.dtype),))[1]

            return jax.grad(lambda wk: jnp.sum(hvp(wk) * uk))(wk)

        uk = rng.normal(size=(n, 3))
        exact = third(reference.segmented_std, jnp.asarray(ids), *map(jnp.asarray, (xk, wk, uk)))
        np.testing.assert_allclose(
            jax.jit(lambda *args: third(ops.segmented_std, segments, *args))(
                a[0], weights[0], jnp.asarray(uk, dtype)),
            exact, rtol=tolerance, atol=tolerance * np.max(np.abs(exact)))
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
def test_logsumexp_and_softmax_are_one_kernel_over_ordered_ids_and_numpy_s_values_over_any(
        gpu_paths):
    """logsumexp and softmax find each segment's largest value and sum its shifted exponentials in
    one kernel where the ids are ordered (one custom call given a Segments; logsumexp's
    gradient one more on CPUs, the cotangent gathered, which XLA gathers on GPUs), the same
    bits whether the order is promised or found; unordered ids (atomic max, then the sums) give
    NumPy's float64 values too. A segment of -inf alone gives logsumexp -inf and softmax 0 (as
    pure JAX's reference), both with derivative 0; rows of no segment count nowhere."""
    rng = np.random.default_rng(43)
    n, m = 60, 9
    ids, segments, _ = edge_case_segments(rng, n, m)  # and 8 all -inf
    x = rng.normal(size=(n, 3)) * 30 + 500
    x[ids == 8] = -np.inf
    w = rng.normal(size=(m, 3))
    expected_lse = np.full((m, 3), -np.inf)
    expected_soft = np.zeros((n, 3))
    for s in range(m):
        rows = ids == s
        top = np.max(x[rows], axis=0, initial=-np.inf)
        if np.all(np.isfinite(top)):
            terms = np.exp(x[rows] - top)
            expected_lse[s] = top + np.log(terms.sum(axis=0))
            expected_soft[rows] = terms / terms.sum(axis=0)

    def loss(a, seg):
        return jnp.sum(w * jnp.where(jnp.asarray(expected_lse) > -np.inf,
                                     ops.segmented_logsumexp(a, seg, m), 0))

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        a = jnp.asarray(x)
        calls = {"logsumexp": lambda a: ops.segmented_logsumexp(a, segments, m),
                 "softmax": lambda a: ops.segmented_softmax(a, segments, m),
                 "grad": jax.grad(lambda a: loss(a, segments))}
        gpu = gpu_paths or jax.default_backend() == "gpu"
        for name, launches in (("logsumexp", 1), ("softmax", 1), ("grad", 1 if gpu else 2)):
            assert kernel_calls(calls[name], a) == launches, name
        order = rng.permutation(n)
        for function, expected in ((ops.segmented_logsumexp, expected_lse),
                                   (ops.segmented_softmax, expected_soft)):
            promised = function(a, segments, m)
            np.testing.assert_allclose(promised, expected, rtol=1e-13, atol=1e-300)
            np.testing.assert_array_equal(function(a, jnp.asarray(ids, jnp.int32), m), promised)
            shuffled = np.asarray(function(a[order], jnp.asarray(ids[order], jnp.int32), m))
            if function is ops.segmented_softmax:
                shuffled = shuffled[np.argsort(order)]
            np.testing.assert_allclose(shuffled, expected, rtol=1e-13, atol=1e-300)
        grad = np.asarray(calls["grad"](a))
        np.testing.assert_allclose(grad, expected_soft * np.where(
            (ids >= 0) & (ids < m), 1, 0)[:, None] * w[np.clip(ids, 0, m - 1)], rtol=1e-12,
            atol=1e-300)
        soft_grad = jax.grad(lambda a: jnp.sum(w[np.clip(ids, 0, m - 1)] * ops.segmented_softmax(
            a, segments, m)))(a)
        assert np.all(np.asarray(soft_grad)[ids == 8] == 0)
        step = 1e-5
        for i in np.flatnonzero(np.isin(ids, [0, 3, 6]))[:4]:
            bump = np.zeros_like(x)
            bump[i, 1] = step
            def value(b):
                return float(jnp.sum(w[np.clip(ids, 0, m - 1)] * ops.segmented_softmax(
                    a + b, segments, m)))
            central = (value(bump) - value(-bump)) / (2 * step)
            np.testing.assert_allclose(soft_grad[i, 1], central, rtol=1e-6, atol=1e-8)
    finally:
        _primitives.lower_cpu_as_gpu(False)


@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_derivatives_are_one_kernel_each_and_numpy_s_values(gpu_paths, dtype):
    """Given a Segments, softmax's gradient s (w - Σ s w) (softmax_tangent), the gradient of
    <gradient, v> in x and the JVP of the gradient along v (softmax_curvature), and that
    gradient in the weights (softmax_tangent along v) each compile to one kernel on GPUs'
    paths, a group of lanes per segment and feature (on CPUs softmax3_tangent and, for the
    second derivatives in x, sums). The gradient equals NumPy's float64 value, the second
    derivatives central differences of it, the third (in float64) central differences of the
    second; the same ids alone give the same bits, shuffled ids the same values; rows of no
    segment, empty segments and a segment of -inf alone get 0; vmap gives each example's
    values."""
    rng = np.random.default_rng(47)
    n, m, batch = 60, 9, 3
    ids, segments, inside = edge_case_segments(rng, n, m)  # and 8 all -inf
    x = rng.normal(size=(batch, n, 3)) * 2 + 300
    x[:, ids == 8] = -np.inf
    w, v = rng.normal(size=(batch, n, 3)), rng.normal(size=(batch, n, 3))

    def numpy_grad(xk, wk):  # s (w - Σ s w) over each segment
        out = np.zeros_like(xk)
        for s in range(m):
            rows = ids == s
            top = np.max(xk[rows], axis=0, initial=-np.inf)
            if rows.any() and np.all(np.isfinite(top)):
                soft = np.exp(xk[rows] - top) / np.exp(xk[rows] - top).sum(axis=0)
                out[rows] = soft * (wk[rows] - (soft * wk[rows]).sum(axis=0))
        return out

    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        a, weights, along = (jnp.asarray(array, dtype) for array in (x, w, v))
        gpu = gpu_paths or jax.default_backend() == "gpu"
        launches = ({"grad": 1, "grad2": 1, "hvp": 1, "grad2_weights": 1} if gpu else
                    {"grad": 1, "grad2": 6, "hvp": 6, "grad2_weights": 1})
        tolerance = 2e-5 if dtype == np.float32 else 1e-12
        calls = check_derivative_calls(ops.segmented_softmax, segments, ids, m,
                                       (a, weights, along), launches, tolerance,
                                       ~inside | (ids == 8), weights_per_row=True,
                                       order=rng.permutation(n))
        xk, wk, vk = x[0], w[0], v[0]
        expected = numpy_grad(xk, wk)
        np.testing.assert_allclose(calls["grad"](a[0], weights[0], along[0]), expected,
                                   rtol=tolerance, atol=tolerance * np.max(np.abs(expected)))
        # the gradient is linear in w, and softmax's Jacobian symmetric: d/dw <grad, v> is the
        # gradient with weights v
        exact = numpy_grad(xk, vk)
        np.testing.assert_allclose(calls["grad2_weights"](a[0], weights[0], along[0]), exact,
                                   rtol=tolerance, atol=tolerance * np.max(np.abs(exact)))
        step = 1e-4
        central = (numpy_grad(xk + step * vk, wk) - numpy_grad(xk - step * vk, wk)) / (2 * step)
        second = max(tolerance, 1e-7)  # central differences' own error, step²
        for name in ("grad2", "hvp"):
            np.testing.assert_allclose(calls[name](a[0], weights[0], along[0]), central,
                                       rtol=second, atol=second * np.max(np.abs(central)),
                                       err_msg=name)
        if dtype == np.float64:  # the third derivative: the JVP of the hvp along v

            def hvp(a):
                return calls["hvp"](a, weights[0], along[0])

            third = jax.jvp(hvp, (a[0],), (along[0],))[1]
            central = (hvp(a[0] + step * along[0]) - hvp(a[0] - step * along[0])) / (2 * step)
            np.testing.assert_allclose(third, central, rtol=1e-7,
                                       atol=1e-7 * np.max(np.abs(central)))
    finally:
        _primitives.lower_cpu_as_gpu(False)


def test_segments_built_from_counts_and_their_edge_cases():
    seg = ops.segments(np.array([2, 0, 3, 0]))
    assert seg.ids.tolist() == [0, 0, 2, 2, 2] and seg.offsets.tolist() == [0, 2, 2, 5, 5]
    x = jnp.arange(15.0).reshape(5, 3)
    np.testing.assert_array_equal(ops.segmented_sum(x, seg, 4),
                                  np.array([[3, 5, 7], [0, 0, 0], [27, 30, 33], [0, 0, 0.0]]))
    assert ops.segmented_count(seg, 4).tolist() == [2, 0, 3, 0]
    empty = ops.segments(np.zeros(0, np.int64))
    assert ops.segmented_rms_norm(jnp.zeros((0, 3)), empty, 0).shape == (0,)
    # out-of-range rows before and after the segments: dropped, as with ids
    ids = jnp.asarray([-1, 0, 0, 1, 2, 2], jnp.int32)
    seg = ops.Segments(ids, jnp.asarray([1, 3, 4], jnp.int32))
    x = jnp.arange(6.0)[:, None]
    np.testing.assert_array_equal(ops.segmented_sum(x, seg, 2), [[3.0], [3.0]])
    with pytest.raises(ValueError, match=r"Segments.offsets must be \(num_segments \+ 1,\)"):
        ops.segmented_sum(x, ops.Segments(ids, jnp.asarray([0, 3], jnp.int32)), 2)
    with pytest.raises(ValueError, match="Segments.ids has length 6 but x has 5 rows"):
        ops.segmented_sum(x[:5], seg, 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_segments_of_offsets_give_padded_rows_the_values_of_the_rows_alone(dtype):
    """Segments made from offsets under jit, over rows padded ahead and behind (ids -1 and M),
    give the values and gradients of the unpadded rows' Segments, bit for bit."""
    rng = np.random.default_rng(3)
    n_atoms = rng.integers(0, 9, 40)
    n_atoms[[0, 7, -1]] = 0
    n, m, skip, rows = int(n_atoms.sum()), len(n_atoms), 5, int(n_atoms.sum()) + 16
    x = rng.normal(size=(n, 3)).astype(dtype)
    padded = np.zeros((rows, 3), dtype)
    padded[skip:skip + n] = x
    offsets = np.full(m + 9, skip + n, np.int32)  # as the engine pads: 9 empty segments more
    offsets[:m + 1] = skip + np.concatenate([[0], np.cumsum(n_atoms)])
    seg = ops.segments(n_atoms)
    for name in ("sum", "mean", "rms_norm", "max_norm"):
        op = getattr(ops, f"segmented_{name}")

        @jax.jit
        def both(a, offsets, op=op):
            pad = ops.segments_of_offsets(offsets, rows)
            value = op(a, pad, m + 8)[:m]
            return value, jax.grad(lambda a: jnp.sum(op(a, pad, m + 8)[:m] ** 2))(a)

        value, grad = both(padded, offsets)
        np.testing.assert_array_equal(value, op(x, seg, m), err_msg=name)
        alone = jax.grad(lambda a, op=op: jnp.sum(op(a, seg, m) ** 2))(x)
        np.testing.assert_array_equal(
            grad, np.r_[np.zeros((skip, 3)), alone, np.zeros((16 - skip, 3))].astype(dtype),
            err_msg=name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("features", [1, 3, 5, 33])
def test_rms_norm_and_dot_over_any_features_and_layout(gpu_paths, features, dtype, monkeypatch):
    """rms_norm and dot, and their gradients (which take the scaled dot and the rescale), of
    rows of 1, 3, 5 and 33 features, whatever lanes a GPU gives a segment (33, more than a
    warp: a thread walks them all), in float64 and float32, against NumPy in float64 (and
    finite differences in float64): ids promised sorted, given as a Segments, sorted but not
    promised, and unsorted; empty segments, ids out of range, and a segment whose squares
    overflow. On the GPU's paths also with float32 norms of sorted ids by the two kernels that
    long inputs take (SQUARES_ROWS)."""
    rng = np.random.default_rng(features)
    n, m = 300, 40
    ids = np.sort(rng.integers(-1, m + 2, n))
    ids[ids == 3], ids[ids == 7] = 2, 8  # segments 3 and 7 empty, still sorted
    x, y = rng.normal(size=(2, n, features)).astype(dtype).astype(np.float64)
    # segment 5's squares overflow: summed again, scaled
    huge = np.where(ids == 5, 1e200 if dtype == np.float64 else 1e30, 1.0)[:, None]
    tolerance = 1e-12 if dtype == np.float64 else 2e-6
    kept = (ids >= 0) & (ids < m)
    want_dot = np.zeros(m)
    np.add.at(want_dot, ids[kept], np.sum(x * y, axis=1)[kept])
    want_rms = np.array([np.sqrt(np.mean(np.sum(x[ids == s] ** 2, axis=1))) if np.any(ids == s)
                         else 0 for s in range(m)]) * np.where(np.arange(m) == 5, huge.max(), 1)
    # d Σ dot² / dx[i] = 2 dot[s] y[i]; d Σ rms / dx[i] = x[i] / (count · rms) of its segment
    counts = np.bincount(ids[kept], minlength=m)
    s_of = np.clip(ids, 0, m - 1)
    want_dot_grad = np.where(kept[:, None], 2 * want_dot[s_of][:, None] * y, 0)
    want_rms_grad = np.where(kept[:, None], x * huge / (counts[s_of] * want_rms[s_of])[:, None],
                             0)
    order = rng.permutation(n)
    layouts = {"promised": (np.arange(n), ids, {"indices_are_sorted": True}),
               "segments": (np.arange(n), segments_of(np.clip(ids, -1, m), m), {}),
               "sorted": (np.arange(n), ids, {}), "unsorted": (order, ids[order], {})}
    _primitives.lower_cpu_as_gpu(gpu_paths)
    default = _primitives.norms.SQUARES_ROWS
    runs = [(squares_rows, *layout) for squares_rows in ((default, 0) if gpu_paths else (default,))
            for layout in layouts.values()]
    try:
        for squares_rows, rows, idx, kw in runs:
            monkeypatch.setattr(_primitives.norms, "SQUARES_ROWS", squares_rows)
            jax.clear_caches()
            a, b = jnp.asarray(x[rows], dtype), jnp.asarray(y[rows], dtype)
            big = jnp.asarray(x[rows] * huge[rows], dtype)
            rms = ops.segmented_rms_norm(big, idx, m, **kw)
            assert rms.dtype == dtype
            assert_close(rms, want_rms, tolerance / 10)
            assert_close(ops.segmented_dot(a, b, idx, m, **kw), want_dot, tolerance / 10)
            rms_grad = jax.grad(lambda a, idx=idx, kw=kw: jnp.sum(
                ops.segmented_rms_norm(a, idx, m, **kw)))(big)
            assert_close(rms_grad, want_rms_grad[rows], tolerance)
            dot_grad = jax.grad(lambda a, b=b, idx=idx, kw=kw: jnp.sum(
                ops.segmented_dot(a, b, idx, m, **kw) ** 2))(a)
            assert_close(dot_grad, want_dot_grad[rows], tolerance)
            if dtype == np.float32:
                continue
            loss = lambda a, idx=idx, kw=kw: jnp.sum(ops.segmented_rms_norm(a, idx, m, **kw))
            direction = jnp.asarray(rng.normal(size=(n, features)))
            numeric = (loss(a + 1e-6 * direction) - loss(a - 1e-6 * direction)) / 2e-6
            np.testing.assert_allclose(jnp.vdot(jax.grad(loss)(a), direction), numeric,
                                       rtol=1e-6)
    finally:
        _primitives.lower_cpu_as_gpu(False)


CPU_KERNELS = {"layout_runs", "sum3", "mean3", "reductions3", "max_cpu_ordered",
               "min_cpu_ordered", "max_norm_cpu_ordered", "moments_cpu", "exp_sums_cpu",
               "softmax3", "softmax3_tangent"}
"""The kernels only CPUs launch (their C has no CUDA branch)."""


def test_gpu_kernels_compile_for_cuda(tmp_path):
    """Every other kernel, and each of its dtypes, compiles for sm_90 (H100, H200) by Warp's
    NVRTC, which needs no GPU: the C that only GPUs run (under `__CUDA_ARCH__`) is compiled
    wherever the tests run, not first on a GPU."""
    import warp as wp

    assert set(kernels.KERNELS) >= CPU_KERNELS
    failed = {}
    for name in sorted(set(kernels.KERNELS) - CPU_KERNELS):
        module = next(iter(_registry.warp_kernels(kernels.KERNELS[name]).values())).module
        try:
            wp.compile_aot_module(module, arch=90, module_dir=tmp_path, use_ptx=True)
        except Exception as err:  # noqa: BLE001 - name every kernel that fails
            failed[name] = str(err)
    assert failed == {}


# max_norm's lanes search, its C compiled on the host as a GPU compiles it (__CUDA_ARCH__, the
# shuffles stubbed: one lane gives the answer alone): rows of 3 in a 16-byte-aligned array take
# the blocks path, the same rows 4 or 8 bytes further on the per-row path
_LANES_SEARCH_HOST = r"""
#define __CUDA_ARCH__ 900
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
using std::fma;
struct { unsigned x; } threadIdx{0};
template <class T> T __shfl_xor_sync(unsigned, T v, int, int) { return v; }
template <class T> struct Arr { void* data; int shape[3]; };
int search64(Arr<double> x, int lo, int hi, int g, int lane, int lanes) {
#include "float64.inc"
}
int search32(Arr<float> x, int lo, int hi, int g, int lane, int lanes) {
#include "float32.inc"
}
template <class T, class F> int check(F search, int seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal;
    int differ = 0;
    for (int n = 1; n <= 40; n++) {
        T *aligned, *shifted;  /* exactly 3n entries each, for the sanitizer */
        char* raw;
        if (posix_memalign((void**)&aligned, 64, 3 * n * sizeof(T)) ||
            posix_memalign((void**)&raw, 64, 3 * n * sizeof(T) + sizeof(T)))
            return 1;
        shifted = (T*)(raw + sizeof(T));
        for (int e = 0; e < 3 * n; e++) aligned[e] = (T)normal(rng);
        if (seed % 2)  /* rows tied with the first */
            for (int i = 1; i < n; i += 3) std::memcpy(aligned + 3 * i, aligned, 3 * sizeof(T));
        std::memcpy(shifted, aligned, 3 * n * sizeof(T));
        for (int lo = 0; lo < n; lo++)
            for (int hi = lo + 1; hi <= n; hi++) {
                Arr<T> a{aligned, {n, 1, 3}}, b{shifted, {n, 1, 3}};
                differ += search(a, lo, hi, 0, 0, 1) != search(b, lo, hi, 0, 0, 1);
                for (int lanes = 2; lanes <= 8; lanes *= 2)  /* every lane reads in bounds */
                    for (int lane = 0; lane < lanes; lane++) search(a, lo, hi, 0, lane, lanes);
            }
        std::free(aligned);
        std::free(raw);
    }
    return differ;
}
int main() {
    int differ = 0;
    for (int seed = 0; seed < 4; seed++)
        differ += check<double>(search64, seed) + check<float>(search32, seed);
    std::printf("%d differ\n", differ);
    return differ != 0;
}
"""


def test_lanes_search_blocks_find_the_rows_of_the_per_row_loop(tmp_path):
    """max_norm's GPU search (its CUDA branch, compiled on the host with a sanitizer, one lane):
    rows of 3 loaded as 16-byte blocks give the answer the per-row loop gives, for every span
    lo:hi of 1 to 40 rows (blocks cut at both ends, the array's last rows), tied rows too; and
    no lane of a group of 2, 4 or 8 reads outside the array."""
    for dtype in ("float32", "float64"):
        (tmp_path / f"{dtype}.inc").write_text(searches._lanes_squares_source(dtype))
    (tmp_path / "search.cpp").write_text(_LANES_SEARCH_HOST)
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, "-std=c++17", "-O1", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", "-o", "search", "search.cpp"], cwd=tmp_path,
                   check=True, capture_output=True)
    result = subprocess.run([str(tmp_path / "search")], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "0 differ\n", result.stdout + result.stderr


@pytest.mark.parametrize("paths", ["gpu", pytest.param("cpu", marks=pytest.mark.slow)])
def test_kernels_stay_in_bounds(paths):
    """Every op and gradient on the GPU's (or the CPU's) code paths with Warp's bounds checks
    on (tests/support/bounds_check.py, its kernels built in a cache of their own, kept in segcli's
    cache directory from one run to the next): no kernel reads or writes outside an array,
    which a CPU survives silently and a GPU does not."""
    bounds_cache = os.path.join(cache_directory(), "warp-bounds-check")
    result = subprocess.run([sys.executable, "bounds_check.py", paths],
                            cwd=Path(__file__).parents[1] / "support",
                            env={**os.environ, "WARP_CACHE_PATH": bounds_cache},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "in bounds" in result.stdout, (
        result.stdout[-2000:] + result.stderr[-2000:])


@pytest.mark.parametrize("gpu_paths", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_span_kernels_read_each_segment_to_its_last_entry(dtype, gpu_paths):
    """sum, mean, rms_norm and dot over a Segments (on GPUs, lanes over each segment's
    entries) for every number of rows from 1 to 9, so that the entries end at every place in
    a block of 4 (2 in float64), the last segment at the array's end, empty segments first and
    inside: against NumPy in float64."""
    rng = np.random.default_rng(21)
    tolerance = 1e-13 if dtype == np.float64 else 1e-6
    _primitives.lower_cpu_as_gpu(gpu_paths)
    try:
        check_spans_to_the_last_entry(rng, dtype, tolerance)
    finally:
        _primitives.lower_cpu_as_gpu(False)


def check_spans_to_the_last_entry(rng, dtype, tolerance):
    for n in range(1, 10):
        counts = np.array([0, *rng.multinomial(n - 1, [0.5, 0.5]), 0, 1])  # last row alone
        ids = np.repeat(np.arange(len(counts)), counts)
        m = len(counts)
        x, y = rng.normal(size=(2, n, 3)).astype(dtype)
        sums = np.zeros((m, 3))
        np.add.at(sums, ids, x.astype(np.float64))
        dots = np.zeros(m)
        np.add.at(dots, ids, np.sum(x.astype(np.float64) * y, axis=1))
        squares = np.zeros(m)
        np.add.at(squares, ids, np.sum(x.astype(np.float64) ** 2, axis=1))
        seg = ops.segments(counts)
        a, b = jnp.asarray(x), jnp.asarray(y)
        assert_close(ops.segmented_sum(a, seg, m), sums, tolerance)
        assert_close(ops.segmented_mean(a, seg, m), sums / np.maximum(counts, 1)[:, None],
                     tolerance)
        assert_close(ops.segmented_rms_norm(a, seg, m),
                     np.sqrt(squares / np.maximum(counts, 1)), tolerance)
        assert_close(ops.segmented_dot(a, b, seg, m), dots, tolerance)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_var_logsumexp_and_softmax_of_rows_of_three_by_vector_lanes_match_numpy(x64, dtype):
    """On CPUs, rows of 3 with ordered ids take their passes in vector lanes (moments3,
    exp_sums3, softmax3 and softmax3_tangent, whose exponentials are exp8's own; softmax's
    gradient checked too): segments of 0 to 40 rows (whole
    blocks of 8 rows and tails), differences beyond exp8's range (wp::exp's then), infinities
    and NaN, against NumPy in float64; the same bits whether the order is promised or
    found."""
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 41, 64)
    counts[:5] = (0, 1, 8, 9, 3)
    ids = np.repeat(np.arange(64), counts).astype(np.int32)
    x = (rng.normal(size=(len(ids), 3)) * 3).astype(dtype)
    rows = np.concatenate([[0], np.cumsum(counts)])
    x[rows[4]:rows[5]] = [[-np.inf, 1, -np.inf], [-np.inf, -1000, np.inf], [-np.inf, 2, 0]]
    x[rows[6], 0] = np.nan
    wide = np.float64(x)
    lse, var, softmax = np.zeros((64, 3)), np.zeros((64, 3)), np.zeros_like(wide)
    for s in range(64):
        part = wide[rows[s]:rows[s + 1]]
        if len(part):
            top = part.max(axis=0)
            shift = np.where(np.isfinite(top), top, 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                exps = np.exp(part - shift)
                lse[s] = np.log(exps.sum(axis=0)) + shift
                softmax[rows[s]:rows[s + 1]] = np.where(exps.sum(axis=0) != 0,
                                                        exps / exps.sum(axis=0), 0)
            var[s] = part.var(axis=0)
        else:
            lse[s] = -np.inf
    weights = rng.normal(size=x.shape).astype(dtype)
    expected_grad = np.zeros_like(wide)
    for s in range(64):
        part, w = softmax[rows[s]:rows[s + 1]], np.float64(weights[rows[s]:rows[s + 1]])
        expected_grad[rows[s]:rows[s + 1]] = part * (w - (part * w).sum(axis=0))
    tight = 1e-13 if dtype == np.float64 else 2e-6
    first = {}
    for promised in (True, False):
        got = {name: np.asarray(getattr(ops, f"segmented_{name}")(
            jnp.asarray(x), jnp.asarray(ids), 64, indices_are_sorted=promised))
            for name in ("logsumexp", "var", "softmax")}
        for name, value in got.items():
            np.testing.assert_array_equal(value, first.setdefault(name, value))
        got_lse, got_var = got["logsumexp"], got["var"]
        np.testing.assert_allclose(np.float64(got_lse), lse, rtol=tight, atol=tight)
        np.testing.assert_allclose(np.float64(got["softmax"]), softmax, rtol=tight * 4,
                                   atol=tight)
        # softmax's gradient (softmax3_tangent): s (w - Σ s w) over each segment
        grad = np.asarray(jax.grad(lambda a, promised=promised: jnp.sum(
            jnp.asarray(weights) * ops.segmented_softmax(a, jnp.asarray(ids), 64,
                                                         indices_are_sorted=promised)))(
            jnp.asarray(x)))
        np.testing.assert_array_equal(grad, first.setdefault("grad", grad))
        finite = np.isfinite(expected_grad)
        np.testing.assert_allclose(np.float64(grad)[finite], expected_grad[finite],
                                   rtol=tight * 4, atol=tight)
        assert np.array_equal(np.isnan(grad), np.isnan(expected_grad))
        finite = np.isfinite(var)
        np.testing.assert_allclose(np.float64(got_var)[finite], var[finite], rtol=tight * 10,
                                   atol=tight)
        assert np.array_equal(np.isnan(got_var), np.isnan(var))


def test_softmax_of_rows_of_three_is_0_on_rows_in_no_segment(x64):
    """Rows ahead of a Segments' first offset and from its last on (padding) get 0 from
    softmax3's and softmax3_tangent's last thread; the rows between, each segment's softmax
    and its tangent."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(11, 3)))
    seg = ops.segments_of_offsets(jnp.array([2, 5, 5, 9], jnp.int32), 11)
    got = np.asarray(ops.segmented_softmax(x, seg, 3))
    expected = np.zeros((11, 3))
    for lo, hi in ((2, 5), (5, 9)):
        exps = np.exp(np.asarray(x[lo:hi]) - np.asarray(x[lo:hi]).max(axis=0))
        expected[lo:hi] = exps / exps.sum(axis=0)
    # the kernel itself, into rows that held NaN: every row written (XLA's fresh output
    # buffers may hold zeros already)
    with jax.default_device(jax.devices("cpu")[0]):  # CPU kernels
        operands = jax.device_put((x, x, seg.offsets))
        written = kernels.launch(kernels.KERNELS["softmax3"], *operands,
                                 jnp.ones(1, jnp.int32), jnp.full((11, 3), jnp.nan), dims=(4,),
                                 in_out=("out",))
        tangent = kernels.launch(kernels.KERNELS["softmax3_tangent"], *operands,
                                 jnp.ones(1, jnp.int32), jnp.full((11, 3), jnp.nan), dims=(4,),
                                 in_out=("out",))
    for value in (got, np.asarray(written)):
        np.testing.assert_allclose(value, expected, rtol=1e-14, atol=0)
        assert np.all(value[:2] == 0) and np.all(value[9:] == 0)
    expected_tangent = np.zeros((11, 3))
    for lo, hi in ((2, 5), (5, 9)):
        s, d = expected[lo:hi], np.asarray(x[lo:hi])
        expected_tangent[lo:hi] = s * (d - (s * d).sum(axis=0))
    np.testing.assert_allclose(np.asarray(tangent), expected_tangent, rtol=1e-13, atol=1e-15)
    assert np.all(np.asarray(tangent)[:2] == 0) and np.all(np.asarray(tangent)[9:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_sums_of_rows_of_three_sum_exp8_s_exponentials_to_two_units(x64, dtype):
    """exp8 over its whole range: segments of rows (0, 0, 0) and (t, t, t), for t from exp8's
    lowest argument to 0 (and 2000 in [-ln 2, 0], where each unit of e^t shows in the sum),
    sum to 1 + e^t within 2 units in the last place of the sum."""
    low = -87.0 if dtype == np.float32 else -708.0
    near = -np.random.default_rng(5).uniform(0, np.log(2), 2000)
    t = np.concatenate([np.linspace(low, 0, 4001), near]).astype(dtype)
    x = np.repeat(np.stack([np.zeros_like(t), t], axis=1).reshape(-1), 3).reshape(-1, 3)
    ids = np.repeat(np.arange(len(t)), 2).astype(np.int32)
    out = np.asarray(_primitives.exp_sums_p.bind(
        jnp.asarray(x), jnp.asarray(ids), jnp.zeros((0,), jnp.int32), num_segments=len(t),
        indices_are_sorted=True))
    expected = 1 + np.exp(np.float64(t))
    ulp = np.spacing(expected.astype(dtype)).astype(np.float64)
    assert np.all(out[:, :, 0] == 0)
    assert np.all(np.abs(np.float64(out[:, :, 1]) - expected[:, None]) <= 2 * ulp[:, None])
