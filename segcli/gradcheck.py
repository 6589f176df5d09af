"""Derivative checks for any JAX function, in float64.

`check_gradients` compares forward-mode (JVP) and reverse-mode (VJP) products of a function
and of its directional derivatives with central finite differences along random directions;
`compare_functions` compares a function's values and derivative products with those of a
reference implementation. Both return a `Report`: one `Row` per order, argument and mode,
and a table as `str(report)`.

How order k is checked: g₁ = f, and g_k(x) = D g_{k-1}(x)[v_{k-1}] (a JVP along a fixed
random direction of all arguments jointly), so the first derivative of g_k is the k-th
derivative of f. Functions without forward mode (`jax.custom_vjp`) use
g_k(x) = D g_{k-1}(x)ᵀ u_{k-1} (a VJP with a fixed random cotangent) instead, and are checked
in reverse mode only. The first derivative of g_k is then checked one argument at a time.
"""

import math
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from segcli._jax import enable_x64

DIRECTIONS = 3
"""Random directions per order and argument."""

SAFETY = 10.0
"""Multiple of the estimated finite-difference error allowed on top of rtol and atol."""

TRUNCATION_LIMIT = 1e-6
"""Largest estimated truncation error, relative to the finite difference (or rtol if larger),
that a finite difference may have and still be trusted: beyond it the function is not
smooth enough at this step (a kink, a jump, or eps too large) and the check fails."""

_UNAVAILABLE = (TypeError, NotImplementedError)
"""What JAX raises for a mode a function does not support (jvp of a `custom_vjp`, a missing
rule)."""


@dataclass(frozen=True)
class Row:
    """One check: `mode` compares two derivative products (or values) of `function`.

    Errors are ∞-norms over the output (or absolute values for projected scalars), maximised
    over random directions; `rel_error` divides by the magnitude of the quantity checked
    against. A row passes when `abs_error <= tolerance` and, for finite-difference modes, the
    finite differences could be trusted; NaN never passes.
    """

    function: str
    order: int
    argument: str
    mode: str
    abs_error: float
    rel_error: float
    tolerance: float
    passed: bool
    note: str = ""

    @property
    def ratio(self):
        """abs_error / tolerance; inf for NaN or a nonzero error against a zero tolerance."""
        return _ratio(self.abs_error, self.tolerance)


def _ratio(error, tolerance):
    if math.isnan(error) or math.isnan(tolerance):
        return math.inf
    if error == 0:
        return 0.0
    return error / tolerance if tolerance > 0 else math.inf


@dataclass(frozen=True)
class Report:
    """The rows of one or more checks; `passed` only if every row passed."""

    rows: tuple

    @property
    def passed(self):
        return all(row.passed for row in self.rows)

    @property
    def failures(self):
        return tuple(row for row in self.rows if not row.passed)

    def __add__(self, other):
        return Report(self.rows + other.rows)

    def summary(self):
        """One row per function and order: the worst check (failed first, then the largest
        error / tolerance), with every distinct note of the group and how many checks failed."""
        groups = {}
        for row in self.rows:
            groups.setdefault((row.function, row.order), []).append(row)
        rows = []
        for group in groups.values():
            worst = max(group, key=lambda row: (not row.passed, row.ratio, row.tolerance))
            notes = list(dict.fromkeys(row.note for row in group if row.note))
            failed = sum(not row.passed for row in group)
            if failed:
                notes.insert(0, f"{failed} of {len(group)} checks failed")
            rows.append(replace(worst, passed=failed == 0, note="; ".join(notes)))
        return Report(tuple(rows))

    def to_dict(self):
        """Plain data for JSON: non-finite numbers become None."""
        def clean(value):
            return None if isinstance(value, float) and not math.isfinite(value) else value

        return {
            "passed": self.passed,
            "rows": [{key: clean(value) for key, value in asdict(row).items()}
                     for row in self.rows],
        }

    def __str__(self):
        header = ("function", "order", "argument", "mode", "max abs err", "max rel err",
                  "tolerance", "result", "note")
        cells = [header] + [
            (row.function, str(row.order), row.argument, row.mode, f"{row.abs_error:.2e}",
             f"{row.rel_error:.2e}", f"{row.tolerance:.2e}", "pass" if row.passed else "FAIL",
             row.note)
            for row in self.rows
        ]
        widths = [max(len(line[column]) for line in cells) for column in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                 for line in cells]
        failures = self.failures
        lines.append(
            f"FAILED: {len(failures)} of {len(self.rows)} rows" if failures
            else f"passed: {len(self.rows)} rows"
        )
        return "\n".join(lines)


class _Problem:
    """f restricted to its floating-point arguments (float64), returning one flat vector."""

    def __init__(self, f, args, argnames):
        args = tuple(jnp.asarray(arg) for arg in args)
        names = (tuple(argnames) if argnames is not None
                 else tuple(f"arg{i}" for i in range(len(args))))
        if len(names) != len(args):
            raise ValueError(f"argnames has {len(names)} names for {len(args)} arguments")
        self.positions = tuple(i for i, arg in enumerate(args)
                               if jnp.issubdtype(arg.dtype, jnp.floating))
        self.names = tuple(names[i] for i in self.positions)
        self.xs = tuple(args[i].astype(jnp.float64) for i in self.positions)
        self._args = args
        self._f = f

    def __call__(self, *xs):
        args = list(self._args)
        for position, x in zip(self.positions, xs):
            args[position] = x
        return ravel_pytree(self._f(*args))[0]


@jax.jit
def _scaled_direction(key, x):
    """A random direction whose entries are proportional to |x| (the rms of x where x is 0),
    so a step `eps` moves every entry by about `eps` relative to its own magnitude."""
    magnitude = jnp.abs(x)
    nonzero = magnitude > 0
    fallback = jnp.sqrt(jnp.sum(jnp.where(nonzero, magnitude**2, 0))
                        / jnp.maximum(jnp.sum(nonzero), 1))
    fallback = jnp.where(fallback > 0, fallback, 1.0)
    return jax.random.normal(key, x.shape, jnp.float64) * jnp.where(nonzero, magnitude, fallback)


def _forward(g, tangents):
    return lambda *xs: jax.jvp(g, xs, tangents)[1]


def _reverse(g, cotangent):
    return lambda *xs: ravel_pytree(jax.vjp(g, *xs)[1](cotangent))[0]


def _chain(g, xs, forward, keys):
    """g_k built from g = g₁ with one JVP (forward) or VJP per key, directions drawn from the
    keys."""
    for key in keys:
        if forward:
            g = _forward(g, tuple(_scaled_direction(k, x)
                                  for k, x in zip(jax.random.split(key, len(xs)), xs)))
        else:
            out = jax.eval_shape(g, *xs)
            g = _reverse(g, jax.random.normal(key, out.shape, out.dtype))
    return g


def _first_line(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _derivative(problem, order, keys, forward=None):
    """(g_order, forward) with forward chaining where it works (or as requested), else reverse.

    Raises one of _UNAVAILABLE when neither chain can be evaluated."""
    if order == 1:
        return problem, True
    if forward is not None:
        return _chain(problem, problem.xs, forward, keys), forward
    g = _chain(problem, problem.xs, True, keys)
    try:
        jax.block_until_ready(g(*problem.xs))
        return g, True
    except _UNAVAILABLE:
        g = _chain(problem, problem.xs, False, keys)
        g(*problem.xs)
        return g, False


def _try(function, *args):
    """(result, None), or (None, note) when the mode is unavailable."""
    try:
        return _host(function(*args)), None
    except _UNAVAILABLE as error:
        return None, _first_line(error)


def _replace(xs, position, value):
    return tuple(value if i == position else x for i, x in enumerate(xs))


def _with_tangent(xs, position, tangent):
    return tuple(tangent if i == position else np.zeros(x.shape, x.dtype) for i, x in enumerate(xs))


def _norm(values):
    return float(np.max(np.abs(values))) if values.size else 0.0


def _host(values):
    """A JAX result (array or tuple of them) as NumPy: the checks' arithmetic runs on the host,
    where each eager jnp operation would compile a program of its own."""
    return tuple(map(np.asarray, values)) if isinstance(values, tuple) else np.asarray(values)


class _Sample(NamedTuple):
    """One direction's comparison; `trusted` is False when the finite difference is not."""

    error: float
    scale: float
    tolerance: float
    note: str = ""
    trusted: bool = True

    @property
    def ratio(self):
        return _ratio(self.error, self.tolerance) if self.trusted else math.inf


def _fd_sample(error, scale, truncation, roundoff, rtol, atol, note):
    """A comparison with a finite difference of estimated truncation and roundoff errors."""
    trusted = truncation <= max(TRUNCATION_LIMIT, rtol) * scale + SAFETY * roundoff + atol
    if not trusted and not note:
        note = (f"finite differences unreliable (estimated error {truncation:.1e} of {scale:.1e}): "
                "not differentiable here, or eps too large")
    return _Sample(error, scale, atol + rtol * scale + SAFETY * (truncation + roundoff), note,
                   trusted)


def _nonfinite_note(*products):
    for name, values in products:
        if not np.isfinite(values).all():
            return f"non-finite {name}"
    return ""


def _row(function, order, argument, mode, samples, note):
    """A row from per-direction samples: the direction with the largest error / tolerance
    (or an untrusted finite difference) speaks for the row."""
    worst = max(samples, key=lambda sample: sample.ratio)
    scale, error = worst.scale, worst.error
    rel = error / scale if scale > 0 else (0.0 if error == 0 else math.inf)
    notes = "; ".join(part for part in (worst.note, note) if part)
    return Row(function, order, argument, mode, error, rel, worst.tolerance, worst.ratio <= 1,
               notes)


def _unavailable_rows(function, order, names, note):
    return [Row(function, order, name, "none", math.nan, math.nan, math.nan, False,
                f"no derivative available: {note}") for name in names]


_NONFINITE_NOTED = {"invalid": "ignore", "over": "ignore", "divide": "ignore"}
"""Products that meet inf or NaN are no NumPy warning: their rows say so (see
_nonfinite_note)."""


def check_gradients(f, args, *, order=2, eps=None, rtol=None, atol=None, seed=0, argnames=None,
                    name=None):
    """Check the derivatives of `f(*args)` up to `order` against central finite differences.

    f: a JAX function of array arguments returning an array, scalar or pytree of them.
    Floating-point arguments are upcast to float64 and checked one at a time; other
    arguments (integer ids, ...) are held fixed. Runs under `jax.enable_x64`. `seed` fixes
    the random directions; `argnames` names the arguments in the rows (default arg0, arg1,
    ...) and `name` the function (default `f.__name__`).

    For each order k, argument a and `DIRECTIONS` random directions v (entries scaled to
    |x_a|) and cotangents u, with D_h = (g(x + h v) − g(x − h v)) / 2h along argument a:
    - "jvp vs fd": JVP of g_k along v against D_h (∞-norm over the output);
    - "vjp vs fd": <VJP(u), v> against <u, D_h>;
    - "vjp vs jvp": <VJP(u), v> against <u, JVP(v)>, the adjoint identity (no step error).
    A mode that raises TypeError/NotImplementedError (jvp of a `custom_vjp`) is skipped and
    the rows say so; an order with no usable mode fails.

    Step and tolerance. The central difference errs by about h²|g'''|/6 (truncation) plus
    ε|g|/h (roundoff, ε the machine epsilon of g's output), smallest near h = ε^(1/3):
    the default `eps` (6e-6 in float64, relative to each entry because v scales with |x|).
    Both error terms are estimated for every direction from the data: truncation as
    |D_h − D_2h|/3 (Richardson), roundoff as ε·max|g|/h over the points used. A row passes
    when error <= atol + rtol·magnitude + SAFETY·(estimated finite-difference error), with
    magnitude the size of the finite-difference product. At the default step that error is
    near ε^(2/3) (4e-11) relative, so the default rtol = √ε (1.5e-8) leaves room for the
    roundoff of the AD products while any real derivative bug (1e-6 relative and up) fails;
    default atol = 0. Functions that compute in float32 internally get ε of float32.
    A finite difference whose estimated truncation error exceeds TRUNCATION_LIMIT (or rtol)
    of its magnitude, beyond roundoff, is not trusted and its row fails: the function is not
    smooth there (a kink such as a norm at 0 or a tied maximum) or eps is too large.
    """
    if order < 1:
        raise ValueError(f"order must be at least 1, got {order}")
    with enable_x64(True), np.errstate(**_NONFINITE_NOTED):
        problem = _Problem(f, args, argnames)
        if not problem.xs:
            raise ValueError("f has no floating-point argument to differentiate")
        function = name or getattr(f, "__name__", "f")
        keys = jax.random.split(jax.random.key(seed), 2 * order)
        rows = []
        for k in range(1, order + 1):
            try:
                g, forward = _derivative(problem, k, keys[: k - 1])
            except _UNAVAILABLE as error:
                rows += _unavailable_rows(function, k, problem.names, _first_line(error))
                continue
            chain_note = "" if forward else "reverse-mode chain (forward mode unavailable)"
            rows += _check_order(function, k, g, problem, keys[order + k - 1], eps, rtol, atol,
                                 chain_note)
        return Report(tuple(rows))


def _check_order(function, order, g, problem, key, eps, rtol, atol, chain_note):
    xs = problem.xs
    jitted = jax.jit(g)
    value = lambda *xs: np.asarray(jitted(*xs))  # noqa: E731
    g0 = value(*xs)
    machine = float(np.finfo(g0.dtype).eps)
    step = eps if eps is not None else machine ** (1 / 3)
    rtol = rtol if rtol is not None else math.sqrt(machine)
    atol = atol if atol is not None else 0.0
    jvp = jax.jit(lambda xs, tangents: jax.jvp(g, xs, tangents)[1])
    vjp = jax.jit(lambda xs, cotangent: jax.vjp(g, *xs)[1](cotangent))
    forward_note = reverse_note = None
    samples = {(a, mode): [] for a in range(len(xs))
               for mode in ("jvp vs fd", "vjp vs fd", "vjp vs jvp")}
    for direction_key in jax.random.split(key, DIRECTIONS):
        u_key, *v_keys = jax.random.split(direction_key, 1 + len(xs))
        u = np.asarray(jax.random.normal(u_key, g0.shape, g0.dtype))
        pullback, reverse_note = _try(vjp, xs, u) if reverse_note is None else (None, reverse_note)
        for a, v_key in enumerate(v_keys):
            v = np.asarray(_scaled_direction(v_key, xs[a]))
            x = np.asarray(xs[a])
            points = [value(*_replace(xs, a, x + t * step * v)) for t in (1, -1, 2, -2)]
            fd = (points[0] - points[1]) / (2 * step)
            fd_2h = (points[2] - points[3]) / (4 * step)
            truncation = np.abs(fd - fd_2h) / 3
            roundoff = machine * np.max(np.abs(np.stack(points)), axis=0) / step
            fd_note = _nonfinite_note(("finite difference", fd))
            tangent, forward_note = (
                _try(jvp, xs, _with_tangent(xs, a, v)) if forward_note is None
                else (None, forward_note)
            )
            if tangent is not None:
                samples[a, "jvp vs fd"].append(_fd_sample(
                    _norm(tangent - fd), _norm(fd), _norm(truncation), _norm(roundoff), rtol, atol,
                    fd_note or _nonfinite_note(("JVP", tangent))))
            if pullback is not None:
                projected = float(np.vdot(pullback[a], v))
                weights = np.abs(u)
                samples[a, "vjp vs fd"].append(_fd_sample(
                    abs(projected - float(np.vdot(u, fd))), float(np.vdot(weights, np.abs(fd))),
                    float(np.vdot(weights, truncation)), float(np.vdot(weights, roundoff)),
                    rtol, atol,
                    fd_note or _nonfinite_note(("VJP", pullback[a]))))
            if tangent is not None and pullback is not None:
                error = abs(projected - float(np.vdot(u, tangent)))
                scale = max(float(np.vdot(np.abs(u), np.abs(tangent))),
                            float(np.vdot(np.abs(pullback[a]), np.abs(v))))
                note = _nonfinite_note(("JVP", tangent), ("VJP", pullback[a]))
                samples[a, "vjp vs jvp"].append(_Sample(error, scale, atol + rtol * scale, note))
    notes = [chain_note]
    if forward_note:
        notes.append(f"forward mode unavailable ({forward_note})")
    if reverse_note:
        notes.append(f"reverse mode unavailable ({reverse_note})")
    note = "; ".join(part for part in notes if part)
    if forward_note and reverse_note:
        return _unavailable_rows(function, order, problem.names, note)
    return [
        _row(function, order, problem.names[a], mode, rows, note)
        for (a, mode), rows in samples.items()
        if rows
    ]


def compare_functions(f, reference, args, *, order=2, rtol=None, atol=None, seed=0, argnames=None,
                      name=None):
    """Compare `f(*args)` with `reference(*args)`: values, then JVP and VJP products of every
    order up to `order`, along the same random directions (float64, under `jax.enable_x64`).

    Order k compares the JVP and the VJP (per floating-point argument) of g_k built as in
    `check_gradients`, with f's chain (forward if f supports it) used for both functions.
    A row passes when error <= atol + rtol·magnitude (default rtol = √ε, atol = 0), with
    magnitude the ∞-norm of the reference's product. For values, magnitude is at least the
    reference's response to a relative perturbation of every input (its JVP along a
    direction scaled to |x|), which bounds the roundoff of sums that cancel (e.g. the total
    force of a structure).
    """
    with enable_x64(True), np.errstate(**_NONFINITE_NOTED):
        candidate = _Problem(f, args, argnames)
        expected = _Problem(reference, args, argnames)
        function = name or getattr(f, "__name__", "f")
        machine = float(jnp.finfo(jnp.float64).eps)
        rtol = rtol if rtol is not None else math.sqrt(machine)
        atol = atol if atol is not None else 0.0
        keys = jax.random.split(jax.random.key(seed), 2 * order + 1)
        rows = [_compare_values(function, candidate, expected, keys[-1], rtol, atol)]
        for k in range(1, order + 1 if candidate.xs else 1):
            try:
                g, forward = _derivative(candidate, k, keys[: k - 1])
            except _UNAVAILABLE as error:
                rows += _unavailable_rows(function, k, candidate.names, _first_line(error))
                continue
            r, _ = _derivative(expected, k, keys[: k - 1], forward)
            rows += _compare_order(function, k, g, r, candidate, keys[order + k - 1], rtol, atol)
        return Report(tuple(rows))


def _compared(function, order, argument, mode, actual, wanted, scale, rtol, atol, note=""):
    if actual.shape != wanted.shape:
        return Row(function, order, argument, mode, math.nan, math.nan, math.nan, False,
                   f"size {actual.size} but the reference gives {wanted.size}")
    extra = _nonfinite_note(("result", actual), ("reference", wanted))
    return _row(function, order, argument, mode,
                [_Sample(_norm(actual - wanted), scale, atol + rtol * scale, extra)], note)


def _compare_values(function, candidate, expected, key, rtol, atol):
    xs = candidate.xs
    actual = np.asarray(jax.jit(candidate)(*xs), np.float64)
    wanted = np.asarray(jax.jit(expected)(*xs), np.float64)
    scale = _norm(wanted)
    if xs:
        directions = tuple(_scaled_direction(k, x)
                           for k, x in zip(jax.random.split(key, len(xs)), xs))
        response, _ = _try(jax.jit(lambda: jax.jvp(expected, xs, directions)[1]))
        if response is not None:
            scale = max(scale, _norm(response))
    return _compared(function, 0, "all", "value vs ref", actual, wanted, scale, rtol, atol)


def _compare_order(function, order, g, r, problem, key, rtol, atol):
    xs = problem.xs
    u_key, *v_keys = jax.random.split(key, 1 + len(xs))
    out = jax.eval_shape(g, *xs)
    u = jax.random.normal(u_key, out.shape, out.dtype)
    pullback, reverse_note = _try(jax.jit(lambda: jax.vjp(g, *xs)[1](u)))
    expected_pullback = (_host(jax.jit(lambda: jax.vjp(r, *xs)[1](u))()) if pullback is not None
                         else None)
    rows = []
    forward_note = None
    for a, v_key in enumerate(v_keys):
        name = problem.names[a]
        tangents = _with_tangent(xs, a, _scaled_direction(v_key, xs[a]))
        tangent, forward_note = (
            _try(jax.jit(lambda: jax.jvp(g, xs, tangents)[1]))  # noqa: B023  (called at once)
            if forward_note is None else (None, forward_note))
        if tangent is not None:
            wanted = _host(jax.jit(lambda: jax.jvp(r, xs, tangents)[1])())  # noqa: B023
            rows.append(_compared(function, order, name, "jvp vs ref", tangent, wanted,
                                  _norm(wanted), rtol, atol))
        if pullback is not None:
            wanted = expected_pullback[a]
            rows.append(_compared(function, order, name, "vjp vs ref", pullback[a], wanted,
                                  _norm(wanted), rtol, atol))
    notes = [f"forward mode unavailable ({forward_note})" if forward_note else "",
             f"reverse mode unavailable ({reverse_note})" if reverse_note else ""]
    note = "; ".join(part for part in notes if part)
    if not rows:
        return _unavailable_rows(function, order, problem.names, note)
    return [replace(row, note="; ".join(part for part in (row.note, note) if part)) for row in rows]
