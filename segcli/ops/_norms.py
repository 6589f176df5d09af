"""`segmented_rms_norm` and `segmented_max_norm` with their derivatives, and
`segmented_reductions` (sum, mean, rms_norm, max_norm of one array in one pass)."""

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from segcli.ops import _primitives as P
from segcli.ops._common import _common, _grouped, _nonzero_counts, _op, _params


@_op
def segmented_rms_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """Root mean square norm of each segment's rows.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M,): sqrt(Σ_{idx[i]=s} |x[i]|² / count); 0 for an empty segment. Finite wherever the
      norm is, up to the float max, and exact down to the smallest numbers (a segment whose
      squares overflow or underflow is summed again, scaled by a power of two), and so are its
      derivatives. Every derivative is 0 (never NaN) where the norm is 0.

    Example::

        segmented_rms_norm(jnp.array([[3., 4.], [0., 0.]]), jnp.array([0, 0]), 1)  # [3.5355]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = _params(m, indices_are_sorted)
    return _rms_norms(_grouped(x), seg, tuple(params.items()))[:, 0].astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _rms_norms(g, seg, params):
    """sqrt(Σ |g[i]|² / count) per segment and group of g (N, G, K), by one kernel."""
    return P.rms_norm_p.bind(g, *seg, **dict(params))


@_rms_norms.defjvp
def _rms_norms_jvp(params, primals, tangents):
    g, seg = primals
    norms = _rms_norms(g, seg, params)
    return norms, _rms_norm_tangent_p.bind(g, tangents[0], norms, *seg, **dict(params))


def _norm_terms(g, norms, idx, offsets, params):
    """(ι, count, δ, zero) of rms_norm's derivatives: ι a power of two near 1/norm, held
    constant (every derivative stays exact, and no g · ι overflows), the rows per segment
    (M, 1), δ = count · norm · ι, and where the norm is 0 (every derivative is 0 there)."""
    _, inverse = P.power_of_two(jax.lax.stop_gradient(norms))
    zero = norms == 0
    counts = _nonzero_counts((idx, offsets), params, g.dtype)[:, None]
    return inverse, counts, counts * jnp.where(zero, 1, norms * inverse), zero


def _rms_norm_tangent(g, dg, norms, idx, offsets, **params):
    """d norm = Σ <g[i], dg[i]> / (count · norm) = Σ <g[i] · ι, dg[i]> / δ."""
    inverse, _, divisor, zero = _norm_terms(g, norms, idx, offsets, params)
    dot = P.scaled_dot_p.bind(g, dg, inverse, idx, offsets, **params)
    return jnp.where(zero, 0, dot / divisor)


def _rms_norm_tangent_transpose(ct, g, dg, norms, idx, offsets, **params):
    return [None, _rms_norm_cotangent(g, ct, norms, (idx, offsets), tuple(params.items())),
            None, None, None]


_rms_norm_tangent_p = P.custom_transposed("rms_norm_tangent", _rms_norm_tangent, linear=(1,),
                                          like=2, transpose=_rms_norm_tangent_transpose)
"""rms_norm's tangent map (linear in dg), transposed into _rms_norm_cotangent, which has a
JVP of its own in turn."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _rms_norm_cotangent(g, c, norms, seg, params):
    """rms_norm's transposed tangent map: the cotangent g[i] · c[s] / (count · norm) of g for a
    cotangent c (M, G) of the norms (= rms_norm(g), held constant: the JVP differentiates
    through g)."""
    if P.ids_known_sorted(seg[1], dict(params)["indices_are_sorted"]):  # the norms summed in it
        return P.rms_norm_cotangent_p.bind(g, c, *seg, **dict(params))
    inverse, _, divisor, zero = _norm_terms(g, norms, *seg, dict(params))
    return P.rescale_p.bind(g, inverse, jnp.where(zero, 0, c / divisor), *seg, **dict(params))


@_rms_norm_cotangent.defjvp
def _rms_norm_cotangent_jvp(params, primals, tangents):
    g, c, norms, seg = primals
    out = _rms_norm_cotangent(g, c, norms, seg, params)
    return out, _rms_norm_curvature_p.bind(g, tangents[0], tangents[1], norms, c, *seg,
                                           **dict(params))


def _rms_norm_curvature(g, dg, dc, norms, c, idx, offsets, **params):
    """The JVP of _rms_norm_cotangent, linear in (dg, dc): dg[i] · c[s] / (count · norm) +
    g[i] · (dc / δ - c · count · ι · S / δ³)[s] · ι, S = Σ <g[i] · ι, dg[i]>, in one kernel
    after the dot (ids known sorted: one kernel, the norms and the dot summed in it)."""
    if P.ids_known_sorted(offsets, params["indices_are_sorted"]):
        return P.rms_norm_curvature_rows_p.bind(g, dg, dc, c, idx, offsets, **params)
    terms = _norm_terms(g, norms, idx, offsets, params)
    dot = P.scaled_dot_p.bind(g, dg, terms[0], idx, offsets, **params)
    return _curvature_rows(g, dg, dc, dot, c, terms, idx, offsets, params)


def _curvature_rows(g, rows, dc, dot, c, terms, idx, offsets, params):
    """rows · ι · c / δ + g · ι · (dc - c · count · ι · dot / δ²) / δ, 0 where the norm is 0
    (`terms` from _norm_terms)."""
    inverse, counts, divisor, zero = terms
    along = jnp.where(zero, 0, (dc - c * counts * inverse * dot / divisor ** 2) / divisor)
    return P.rescale2_p.bind(rows, g, inverse, jnp.where(zero, 0, c / divisor), along, idx,
                             offsets, **params)


def _rms_norm_curvature_transpose(u, g, dg, dc, norms, c, idx, offsets, **params):
    """The transpose of the curvature, a Hessian: for dg the map itself at (u, 0) (both its
    terms by one kernel, where JAX would add two rescales), for dc R / δ, R = Σ <g · ι, u>
    (the same scaled dot as the map's, which XLA computes once)."""
    ct_dg = ct_dc = None
    if ad.is_undefined_primal(dg):
        ct_dg = _rms_norm_curvature(g, u, jnp.zeros_like(c), norms, c, idx, offsets, **params)
    if ad.is_undefined_primal(dc):
        inverse, _, divisor, zero = _norm_terms(g, norms, idx, offsets, params)
        dot = P.scaled_dot_p.bind(g, u, inverse, idx, offsets, **params)
        ct_dc = jnp.where(zero, 0, dot / divisor)
    return [None, ct_dg, ct_dc, None, None, None, None]


_rms_norm_curvature_p = P.custom_transposed(
    "rms_norm_curvature", _rms_norm_curvature, linear=(1, 2), like=0,
    transpose=_rms_norm_curvature_transpose)


@_op
def segmented_max_norm(x, idx, num_segments, *, indices_are_sorted=False):
    """Largest norm of each segment's rows.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M,): max_{idx[i]=s} |x[i]|; 0 for an empty segment. Each norm is computed with the row
      scaled by a power of two near its largest entry, so it is finite wherever it is true,
      up to the float max. The derivative flows to the first row attaining the max, and is
      0 (never NaN) where the norm is 0.

    Example::

        segmented_max_norm(jnp.array([[3., 4.], [1., 0.]]), jnp.array([0, 0]), 1)  # [5.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = _params(m, indices_are_sorted)
    return _max_norms(_grouped(x), seg, tuple(params.items()))[:, 0].astype(dtype)


@_op
def segmented_reductions(x, idx, num_segments, reductions, *, indices_are_sorted=False):
    """Several reductions of the same rows at once.

    Args:
      x: (N, *F) floats.
      {segment args}
      reductions: names among "sum", "mean", "rms_norm" and "max_norm" (static).

    Returns:
      A tuple: for each name, what segmented_<name>(x, idx, num_segments) returns, bit for
      bit, and with the same derivatives. On CPUs, for rows of 3 features and ids known
      sorted (a Segments, or the promise), one kernel reads each segment's rows once for all
      of them; elsewhere each is computed as its own function computes it.

    Example::

        x = jnp.array([[3., 4., 0.], [0., 0., 0.]])
        segmented_reductions(x, jnp.array([0, 0]), 1, ("max_norm", "rms_norm"))  # [[5.], [3.5355]]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    params = tuple(_params(m, indices_are_sorted).items())
    return tuple(out.reshape(m, *x.shape[1:]).astype(dtype) if name in ("sum", "mean")
                 else out[:, 0].astype(dtype)
                 for name, out in zip(reductions, _together(_grouped(x), seg, reductions, params)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _together(g, seg, names, params):
    """[each named reduction of g (N, 1, K)]: sum and mean (M, K), rms_norm and max_norm (M, 1),
    by one primitive (see P.reductions_p)."""
    return P.reductions_p.bind(g, *seg, names=names, **dict(params))


@_together.defjvp
def _together_jvp(names, params, primals, tangents):
    """Each reduction's value and tangent by its own primitive and rules."""
    (g, seg), (dg, _) = primals, tangents
    p = dict(params)
    alone = {"sum": lambda g: P.sum_p.bind(g[:, 0], *seg, **p),
             "mean": lambda g: P.mean_p.bind(g[:, 0], *seg, **p),
             "rms_norm": lambda g: _rms_norms(g, seg, params),
             "max_norm": lambda g: _max_norms(g, seg, params)}
    return jax.jvp(lambda g: [alone[name](g) for name in names], (g,), (dg,))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _max_norms(g, seg, params):
    """max |g[i]| per segment of g (N, 1, K), by the kernels alone where nothing is
    differentiated."""
    return P.max_norm_p.bind(g, *seg, **dict(params))


@_max_norms.defjvp
def _max_norms_jvp(params, primals, tangents):
    """The norms of the rows the search chose, and their derivative (see _norms)."""
    (g, seg), (dg, _) = primals, tangents
    first = P.extreme_p.bind(g, *seg, kind="max_norm", **dict(params))
    norms, tangent = jax.jvp(_norms, (P.take_p.bind(g, first, *seg, **dict(params))[:, 0],),
                             (P.take_p.bind(dg, first, *seg, **dict(params))[:, 0],))
    return norms[:, None], tangent[:, None]


@jax.custom_jvp
def _norms(rows):
    """|rows[s]| of rows (M, K), each row scaled by a power of two near its largest entry
    (so no square overflows or underflows)."""
    return P.scaled_norms(rows)


@_norms.defjvp
def _norms_jvp(primals, tangents):
    """d |v| = <v, dv> / |v|, with v and |v| (not dv, which would underflow) divided by a power
    of two near |v|, held constant: every derivative stays exact; 0 where |v| is."""
    (rows,), (dv,) = primals, tangents
    norms = _norms(rows)
    _, inverse = P.power_of_two(jax.lax.stop_gradient(norms))
    zero = norms == 0
    units = rows * inverse[:, None] / jnp.where(zero, 1, norms * inverse)[:, None]
    return norms, jnp.where(zero, 0, jnp.sum(units * dv, axis=1))
