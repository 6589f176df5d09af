"""Neighbour statistics at cutoffs, streamed over a batch: per structure, the ordered pairs of
atoms (i, j, periodic image) closer than each cutoff, as `ase.neighborlist.neighbor_list`
counts them (an atom with its own image counts, with itself in its own cell not), and the
nearest pair; per atom, its neighbours.

A chunk of structures becomes one cell list: each structure gets, on the host (vectorised
over the structures), a basis of its own (its periodic lattice vectors, normals along its
other axes; Cartesian for a molecule) and a grid of bins at least the largest cutoff wide;
on the device, its atoms are wrapped into its cell along its periodic axes, binned and
sorted by bin. A Warp kernel then visits, for each atom, the bins within reach of its own in
every periodic image that reaches it (several images of the cell when it is thinner than the
cutoff), and segcli's segment ops reduce its per-atom counts and nearest distances per
structure. Memory is bounded by the chunk: no pair list, no N² matrix.
"""

import contextlib
import functools
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError
from segcli.numbers import plain_number

SLACK = 1e-9
"""Bins are this much (relatively) wider than the cutoff, so that a position's rounding in the
wrap cannot put a pair closer than the cutoff two bins apart."""

BINS_PER_CUTOFF = 1
"""Bins along an axis per cutoff's length: an atom visits the 3³ bins of width R around its
own. Two (5³ bins of width R/2, 2.7 times less volume) took as long on the CPU and 20 % longer
on an H200 (benchmarks/RESULTS.md)."""

MAX_VISITS = 1_000_000
"""The most bins (bins × periodic images) one atom may have to visit, and the most atoms (as
many per bin as its structure has on average, at least one): a cell far thinner than the
cutoff, or holding many atoms in a cell thinner than it, is refused rather than left to run
for hours."""

FAR_CELLS = 2.0**20
"""The most cell lengths an atom may lie outside its cell along a periodic axis: wrapping it
back keeps its position to 2^-32 of the cell. Farther (10⁹ Å from a cell of a few Å), its
wrapped position would be rounding noise, and the structure is refused."""

FAULTS = {1: "its positions are not finite",
          2: f"an atom lies more than {FAR_CELLS:.0f} cell lengths outside its periodic cell, "
             "too far to wrap it back precisely"}
"""What is wrong with a structure whose positions cannot be searched, by fault code."""

class Output(NamedTuple):
    """A statistic: per structure or per atom, its dtype, and whether it is one per cutoff."""

    per: str
    dtype: type
    per_cutoff: bool


OUTPUTS = {
    "n_pairs": Output("structure", np.int64, True),
    "mean_neighbors": Output("structure", np.float64, True),
    "min_distance": Output("structure", np.float64, False),
    "min_pair_i": Output("structure", np.int64, False),
    "min_pair_j": Output("structure", np.int64, False),
    "n_neighbors": Output("atom", np.int64, True),
}
"""Each statistic of a run (see compute); the nearest pair is over the largest cutoff."""


MAX_CUTOFF = 1e6
"""The largest cutoff in Å: far beyond any interaction, and whose grid stays countable."""

MIN_CUTOFF = float(np.sqrt(np.finfo(np.float64).tiny))
"""The smallest cutoff in Å: distances are compared through their squares, which must not
underflow."""


def cutoff_label(cutoff):
    """The shortest text that reads back as exactly `cutoff` (Python's repr), without a
    trailing ".0": 5, 2.5, 2.5000001, 1e-05. Distinct cutoffs have distinct labels."""
    text = repr(float(cutoff))
    return text[:-2] if text.endswith(".0") else text


def cutoff_problem(cutoff):
    """What is wrong with `cutoff` (Å) as a cutoff, or None."""
    if np.isnan(cutoff):
        return "is not a number"
    if cutoff <= 0:
        return "must be positive"
    if np.isinf(cutoff) or cutoff > MAX_CUTOFF:
        return f"is above the largest cutoff, {cutoff_label(MAX_CUTOFF)} Å"
    if cutoff < MIN_CUTOFF:
        return (f"is below the smallest cutoff, {MIN_CUTOFF:.3g} Å (the square of a "
                "distance that small underflows)")
    return None


def _cutoff_number(cutoff):
    """`cutoff` as a float; text (the command line's) only as a plain number (see
    segcli.numbers.plain_number)."""
    if not isinstance(cutoff, str):
        return float(cutoff)
    try:
        return plain_number(cutoff)
    except ValueError:
        raise ValueError(f"cutoff {cutoff!r} is not a number") from None


def checked_cutoffs(cutoffs):
    """The `cutoffs` (numbers, or text as the command line gives them) ascending as float64;
    ValueError naming the first that is not a plain number or that cutoff_problem refuses,
    or one given twice."""
    values = [_cutoff_number(c) for c in cutoffs]
    if not values:
        raise ValueError("no cutoff given")
    for cutoff in values:
        problem = cutoff_problem(cutoff)
        if problem:
            raise ValueError(f"cutoff {cutoff_label(cutoff)} {problem}")
    twice = sorted({c for c in values if values.count(c) > 1})
    if twice:
        raise ValueError(f"cutoff {cutoff_label(twice[0])} is given twice (results of "
                         "several cutoffs are named by each)")
    return np.array(sorted(values), np.float64)


def result_names(cutoffs, per_atom):
    """The results of a run: name -> (statistic (a key of OUTPUTS), per, dtype, the index of
    the cutoff it is of, or None for the nearest pair, taken over the largest cutoff). One
    cutoff: the names of OUTPUTS; several: n_pairs_R, mean_neighbors_R (and n_neighbors_R)
    for each cutoff R (its cutoff_label)."""
    names = {}
    for base, (per, dtype, per_cutoff) in OUTPUTS.items():
        if per == "atom" and not per_atom:
            continue
        if per_cutoff:
            for k, cutoff in enumerate(cutoffs):
                name = base if len(cutoffs) == 1 else f"{base}_{cutoff_label(cutoff)}"
                names[name] = (base, per, dtype, k)
        else:
            names[base] = (base, per, dtype, None)
    return names


def _norm(v):
    """The lengths of the rows of `v` (..., 3), without overflow or underflow in the squares."""
    scale = np.abs(v).max(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return scale * np.linalg.norm(v / scale[..., None], axis=-1)


def _unit(v):
    return v / _norm(v)[..., None]


def _basis(cells, periodic):
    """(S, 3, 3) rows: each structure's periodic lattice vectors, with unit vectors normal to
    them (and to each other) along its other axes; the identity for a structure with no
    periodic axis. Its fractional coordinates bin the atoms."""
    basis = np.broadcast_to(np.eye(3), cells.shape).copy()
    for pattern in np.unique(periodic, axis=0):
        where = (periodic == pattern).all(axis=1)
        if not pattern.any():
            continue
        cell = cells[where]
        on = np.flatnonzero(pattern)
        out = basis[where]
        out[:, on] = cell[:, on]
        if len(on) == 2:
            out[:, 3 - on.sum()] = _unit(np.cross(_unit(cell[:, on[0]]), _unit(cell[:, on[1]])))
        elif len(on) == 1:
            a = cell[:, on[0]]
            helper = np.eye(3)[np.argmin(np.abs(_unit(a)), axis=1)]
            u = _unit(np.cross(a, helper))
            out[:, [k for k in range(3) if k != on[0]]] = np.stack(
                [u, _unit(np.cross(a, u))], axis=1)
        basis[where] = out
    return basis


class Geometry(NamedTuple):
    """Per structure of a chunk: the basis its atoms are binned in (see _basis) and its
    inverse, the spacing of its lattice planes along each axis, which axes are periodic."""

    basis: np.ndarray
    inverse: np.ndarray
    spacing: np.ndarray
    periodic: np.ndarray


def geometry(path, numbers, cells, pbc):
    """The Geometry of structures numbered `numbers` in the file `path` (as errors name them)
    with lattice vectors `cells` (S, 3, 3) (rows), periodic along `pbc` (S, 3) bool; DataError
    for a cell that is not finite or singular along its periodic axes."""
    periodic = np.asarray(pbc, bool)
    cells = np.asarray(cells, np.float64)
    infinite = ~np.isfinite(np.where(periodic[:, :, None], cells, 0.0)).all(axis=(1, 2))
    if infinite.any():
        s = int(np.argmax(infinite))
        raise DataError(f"{path}: structure {numbers[s]}: its cell is not finite along its "
                        f"periodic axes (pbc {periodic[s].tolist()}, cell {cells[s].tolist()})")
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # refused below
        basis = _basis(cells, periodic)
        # the volume of the basis' unit vectors: independent of the cell's scale
        singular = ~(np.abs(np.linalg.det(_unit(basis))) > 1e-9)
    if singular.any():
        s = int(np.argmax(singular))
        raise DataError(f"{path}: structure {numbers[s]}: its cell is singular along its "
                        f"periodic axes (pbc {periodic[s].tolist()}, cell {cells[s].tolist()})")
    inverse = np.linalg.inv(basis)
    return Geometry(basis, inverse, 1 / _norm(inverse.transpose(0, 2, 1)), periodic)


class Grid(NamedTuple):
    """Per structure: its bins along each axis, how many bins away a neighbour may be, its
    first bin; and the bins of the chunk."""

    bins: np.ndarray
    reach: np.ndarray
    first_bin: np.ndarray
    n_bins: int


def grid(path, numbers, geometry, low, high, n_atoms, cutoff):
    """The Grid of structures (see `geometry`) whose atoms span fractional coordinates
    [low, high] (S, 3) along their non-periodic axes, for pairs closer than `cutoff`: bins at
    least a BINS_PER_CUTOFF-th of the cutoff wide (at most one per atom, so that a cell of
    vacuum costs nothing); one bin where the span is not finite. In floats until bounded, so
    that no structure's numbers overflow into another's bins.
    DataError for a cell so much thinner than the cutoff that each atom would visit more than
    MAX_VISITS bins or atoms."""
    periodic = geometry.periodic
    n_atoms = np.asarray(n_atoms, np.float64)
    most = np.maximum(1.0, n_atoms)
    with np.errstate(invalid="ignore", over="ignore"):
        span = np.where(periodic, 1.0, np.maximum(high - low, 0.0))
        extent = span * geometry.spacing
        reach_of = cutoff * (1 + SLACK)
        # one bin where the span is not finite (it overflows, or a position is not)
        bins = np.where(np.isfinite(extent), np.minimum(np.maximum(
            1.0, np.floor(extent * BINS_PER_CUTOFF / reach_of)), most[:, None]), 1.0)
    over = bins.prod(axis=1) > most
    while over.any():  # at most 3 log2(most) rounds: each halves an axis
        largest = np.argmax(bins[over], axis=1)
        rows = np.flatnonzero(over)
        bins[rows, largest] = np.maximum(1.0, np.floor(bins[rows, largest] / 2))
        over = bins.prod(axis=1) > most
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        reach = np.ceil(reach_of * bins / extent)
        reach = np.where(periodic, reach, np.minimum(bins - 1, np.nan_to_num(reach)))
        images = np.prod(2 * reach + 1, axis=1)
        visits = images * np.maximum(1.0, n_atoms / bins.prod(axis=1))
    for too_many, why in (
            (images > MAX_VISITS, lambda s: f"{images[s]:.3g} periodic images of its bins for "
             "each atom"),
            (visits > MAX_VISITS, lambda s: f"about {visits[s]:.3g} atoms for each of its "
             f"{int(n_atoms[s])} atoms")):
        if too_many.any():
            s = int(np.argmax(too_many))
            raise DataError(f"{path}: structure {numbers[s]}: its cell is "
                            f"{extent[s].min():.3g} Å thin, and a cutoff of "
                            f"{cutoff_label(cutoff)} Å would visit {why(s)}")
    first_bin = np.zeros(len(bins) + 1, np.int64)
    np.cumsum(bins.prod(axis=1).astype(np.int64), out=first_bin[1:])
    if first_bin[-1] >= 2**31 - 1:
        raise DataError(f"{path}: structures {numbers[0]}..{numbers[-1]} need "
                        f"{first_bin[-1]} bins; use a smaller --chunk-atoms")
    return Grid(bins.astype(np.int32), reach.astype(np.int32), first_bin[:-1].astype(np.int32),
                int(first_bin[-1]))


@functools.cache
def _fractional_program(rows, segments):
    """A jitted function of a padded chunk (positions, offsets, basis, inverse, periodic) ->
    (positions wrapped into the cell along periodic axes, their fractional coordinates in the
    basis, each structure's smallest and largest fractional coordinates before the wrap, and
    its fault (see FAULTS))."""
    import jax
    import jax.numpy as jnp

    from segcli import ops

    def program(positions, offsets, basis, inverse, periodic):
        idx = ops.segments_of_offsets(offsets, rows)
        at = jnp.minimum(idx.ids, segments - 1)
        fractional = jnp.einsum("ni,nij->nj", positions, inverse[at])
        low = ops.segmented_min(fractional, idx, segments, indices_are_sorted=True)
        high = ops.segmented_max(fractional, idx, segments, indices_are_sorted=True)
        has_atoms = offsets[1:] > offsets[:-1]
        finite = (jnp.isfinite(low) & jnp.isfinite(high)).all(axis=1)
        far = (periodic & (jnp.maximum(-low, high) > FAR_CELLS)).any(axis=1)
        fault = jnp.where(has_atoms & ~finite, 1, jnp.where(has_atoms & far, 2, 0))
        image = jnp.where(periodic[at], jnp.floor(fractional), 0.0)
        wrapped = positions - jnp.einsum("ni,nij->nj", image, basis[at])
        return wrapped, fractional - image, low, high, fault.astype(jnp.int32)

    return jax.jit(program)


@functools.cache
def _pairs_program(n_cutoffs, rows, segments, n_bins, histogram_bins):
    """A jitted function of a chunk's wrapped positions, fractional coordinates and Grid ->
    per structure: pairs per cutoff (S, K), the nearest distance, the pair attaining it (the
    lowest i, then j); per atom: neighbours per cutoff (N, K); the largest per-atom count per
    cutoff and the histogram of distances. The atoms are sorted by bin (a cell list) and the
    Warp kernel `neighbors` visits each atom's bins."""
    import jax
    import jax.numpy as jnp

    from segcli import ops
    from segcli.ops.kernels import NEIGHBOURS, launch, pick

    def program(wrapped, fractional, offsets, present, low, high, bins, reach, periodic,
                first_bin, lattice, cutoffs, scale):
        idx = ops.segments_of_offsets(offsets, rows)
        ids = idx.ids
        at = jnp.minimum(ids, segments - 1)
        real = (ids < segments) & present[at]  # others in no bin, visited by no thread
        span = jnp.where(high > low, high - low, 1.0)
        scaled = (fractional - jnp.where(periodic, 0.0, low)[at]) / jnp.where(
            periodic, 1.0, span)[at] * bins[at]
        # NaN where a span overflows (one bin there, see grid) or a position is not finite
        bin_xyz = jnp.clip(jnp.floor(jnp.nan_to_num(scaled)), 0, bins[at] - 1).astype(jnp.int32)
        key = first_bin[at] + (bin_xyz[:, 0] * bins[at, 1] + bin_xyz[:, 1]) * bins[at, 2] \
            + bin_xyz[:, 2]
        key = jnp.where(real, key, n_bins)
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        bin_start = jnp.searchsorted(key[order], jnp.arange(n_bins + 1, dtype=key.dtype))
        counts, nearest, partner, histogram = launch(
            pick(NEIGHBOURS, "neighbors"), wrapped[order], order,
            jnp.where(real, ids, -1)[order], bin_xyz[order], bin_start.astype(jnp.int32),
            lattice, bins, reach,
            periodic.astype(jnp.int32), first_bin, offsets[:-1], cutoffs, scale,
            jnp.zeros((rows, n_cutoffs), jnp.int64), jnp.zeros(rows, jnp.float64),
            jnp.zeros(rows, jnp.int32), jnp.zeros(histogram_bins, jnp.int32),
            dims=rows, in_out=("counts", "nearest", "partner", "histogram"))
        pairs = ops.segmented_sum(counts, idx, segments, indices_are_sorted=True)
        least = ops.segmented_min(nearest, idx, segments, indices_are_sorted=True)
        atom = jnp.arange(rows) - offsets[at]
        attains = (nearest == least[at]) & jnp.isfinite(nearest)
        first_i = ops.segmented_min(jnp.where(attains, atom, rows), idx, segments,
                                    indices_are_sorted=True)
        found = first_i < rows
        first_j = partner[jnp.minimum(offsets[:-1] + first_i, rows - 1)]
        return (pairs, least, jnp.where(found, first_i, -1), jnp.where(found, first_j, -1),
                counts, counts.max(axis=0, initial=0), histogram)

    return jax.jit(program)


class Prepared(NamedTuple):
    """A chunk padded for the device (see prepare): positions (rows, 3), CSR offsets
    (segments + 1,), which structures have positions (segments,), its Geometry padded to
    `segments` structures, its structures' numbers in the file `path` and atom counts."""

    path: str
    positions: np.ndarray
    offsets: np.ndarray
    present: np.ndarray
    geometry: Geometry
    numbers: np.ndarray
    n_atoms: np.ndarray


def _pad(array, size, value=0):
    """`array` padded with `value` to `size` rows."""
    return np.pad(array, [(0, size - len(array))] + [(0, 0)] * (array.ndim - 1),
                  constant_values=value)


def _padded(buffers, name, array, size, value=0):
    """`array` in a buffer `name` of `buffers` (see engine.pipeline.BufferRing), padded with `value`
    to `size` rows."""
    out = buffers.take(name, (size, *array.shape[1:]), array.dtype)
    out[:len(array)] = array
    out[len(array):] = value
    return out


def prepare(path, chunk, cells, pbc, buffers=None, least=(0, 0), scale=1.0):
    """The Prepared chunk (io.core.Chunk holding `positions`) of structures whose lattice
    vectors are `cells` (S, 3, 3) and periodic axes `pbc` (S, 3), in host buffers of
    `buffers` (default: new ones; or where the positions were read in place, see
    engine.lending), padded to at least `least` (rows, structures) and to power-of-two
    sizes (one compilation over a run); positions times `scale` (to Å), and 0 for
    structures that lack them (no pair of theirs is counted, and their results are NaN, see
    run)."""
    from segcli.engine.pipeline import BufferRing, bucket

    buffers = buffers or BufferRing()
    n_atoms = chunk.n_atoms
    s, n = len(n_atoms), int(n_atoms.sum())
    rows, segments = max(least[0], bucket(n)), max(least[1], bucket(s))
    data = chunk.atoms["positions"]
    positions = buffers.holding(data)
    if positions is None or positions.shape != (rows, 3) or positions.dtype != np.float64:
        positions = buffers.take("positions", (rows, 3), np.float64)
        positions[:n] = data
    positions[n:] = 0
    if scale != 1.0:
        positions[:n] *= scale
    have = chunk.present.get("positions", np.ones(s, bool))
    positions[:n][~np.repeat(have, n_atoms)] = 0
    offsets = buffers.take("offsets", (segments + 1,), np.int32)
    offsets[0] = 0
    np.cumsum(n_atoms, out=offsets[1:s + 1])
    offsets[s + 1:] = n
    shape = geometry(path, chunk.structure_numbers, cells, pbc)
    padded = Geometry(*(_padded(buffers, name, array, segments, value) for name, array, value
                        in zip(Geometry._fields, shape, (0.0, 0.0, 1.0, False))))
    return Prepared(path, positions, offsets, _padded(buffers, "present", have, segments),
                    padded, chunk.structure_numbers, n_atoms)


def compute(prepared, cutoffs, device, histogram_bins=0, per_atom=True):
    """The neighbour statistics of a Prepared chunk, for the ascending `cutoffs`: per
    structure n_pairs and mean_neighbors (S, K), min_distance, min_pair_i, min_pair_j (S,);
    with `per_atom`,
    per atom n_neighbors (N, K); for the chunk max_neighbors (K,) and the histogram of pair
    distances below the largest cutoff (histogram_bins,); per structure its fault (0 if none,
    else a key of FAULTS), whose rows are NaN and whose atoms count nowhere."""
    import jax

    from segcli import engine
    from segcli._jax import enable_x64

    p = prepared
    s, n = len(p.n_atoms), int(p.n_atoms.sum())
    rows, segments = len(p.positions), len(p.offsets) - 1
    cutoffs = np.asarray(cutoffs, np.float64)
    scale = np.array([histogram_bins / cutoffs[-1] if histogram_bins else 0.0])
    with enable_x64(True):
        positions, offsets, basis, inverse, periodic = jax.device_put(
            (p.positions, p.offsets, p.geometry.basis, p.geometry.inverse,
             p.geometry.periodic), device)
        wrapped, fractional, low, high, fault = _fractional_program(rows, segments)(
            positions, offsets, basis, inverse, periodic)
        # the grid needs the atoms' span only along non-periodic axes: no round trip for
        # chunks of periodic cells
        spans = ((np.asarray(low)[:s], np.asarray(high)[:s]) if not p.geometry.periodic[:s].all()
                 else (np.zeros((s, 3)), np.ones((s, 3))))
        cells = grid(p.path, p.numbers, Geometry(*(a[:s] for a in p.geometry)), *spans,
                     p.n_atoms, float(cutoffs[-1]))
        n_bins = engine.bucket(cells.n_bins)
        lattice = np.where(p.geometry.periodic[:, :, None], p.geometry.basis, 0.0)
        program = _pairs_program(len(cutoffs), rows, segments, n_bins, max(1, histogram_bins))
        present, *grid_arrays = jax.device_put(
            (p.present, _pad(cells.bins, segments, 1), _pad(cells.reach, segments), periodic,
             _pad(cells.first_bin, segments), lattice, cutoffs, scale), device)
        # a faulty structure's atoms are in no bin: no other structure's answer can change
        out = program(wrapped, fractional, offsets, present & (fault == 0), low, high,
                      *grid_arrays)
        pairs, least, first_i, first_j, counts, most, histogram = out
        statistics = {"n_pairs": pairs, "min_distance": least, "min_pair_i": first_i,
                      "min_pair_j": first_j, "max_neighbors": most, "histogram": histogram,
                      "fault": fault}
        if per_atom:
            statistics["n_neighbors"] = counts
        statistics = {name: np.asarray(a) for name, a in statistics.items()}
    rows_of = {"n_neighbors": n, "histogram": histogram_bins, "max_neighbors": len(cutoffs)}
    statistics = {name: a[:rows_of.get(name, s)] for name, a in statistics.items()}
    statistics["histogram"] = statistics["histogram"].astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN for a structure without atoms
        statistics["mean_neighbors"] = statistics["n_pairs"] / p.n_atoms[:, None].astype(float)
    fine = statistics["fault"] == 0
    return statistics if fine.all() else engine.blanked(
        statistics, {name: o.per for name, o in OUTPUTS.items()}, fine, p.n_atoms)


def lattices(chunk, length_factor=1.0):
    """(cells (S, 3, 3), pbc (S, 3) bool) of a chunk's structures: no cell and no periodic axis
    where it has no `cell` (or `pbc`) field or a structure lacks it (Chunk.present); lengths
    times `length_factor`."""
    s = len(chunk.n_atoms)
    cells = np.zeros((s, 3, 3))
    pbc = np.zeros((s, 3), bool)
    if "cell" in chunk.structures:
        cells[:] = chunk.structures["cell"]
        cells *= length_factor
        if "pbc" in chunk.structures:
            pbc[:] = chunk.structures["pbc"]
        for name, mask in chunk.present.items():
            if name in ("cell", "pbc"):
                pbc[~mask] = False
    return cells, pbc


def run(batch, cutoffs, device, *, chunk_atoms=1 << 21, structures=slice(None), keep=None,
        histogram_bins=0, per_atom=True):
    """Yield (Chunk, statistics) for each chunk of whole structures of `batch` (those `keep`
    marks, if given): see `compute`, for the ascending `cutoffs` in Å; the next chunk read (in
    place, into reused host buffers, pinned for a GPU) and prepared in a background thread
    while this one is computed on `device`. Positions stated in other units (bohr, nm) are
    converted; DataError for positions holding NaN, or a structure with a fault (see
    compute); ValueError for cutoffs that checked_cutoffs refuses."""
    from segcli import engine
    from segcli.io import units

    cutoffs = checked_cutoffs(cutoffs)
    fields = batch.fields
    names = ["positions"] + [n for n in ("cell", "pbc") if n in fields]
    unit = batch.units.get("positions")
    factor = units.known()[unit][1] if unit in units.known() else 1.0

    least = engine.padded_size(batch.n_atoms[structures], chunk_atoms)

    def prepared(buffers):
        chunks = batch.iter_chunks(
            names, chunk_atoms=chunk_atoms, structures=structures, keep=keep,
            into=engine.lending(buffers, {"positions": np.dtype(np.float64)}, fields, least[0]))
        checked = engine.nan_checked(batch.path, chunks, [n for n in names if n != "pbc"],
                                     where_present=True)
        for chunk in checked:
            cells, pbc = lattices(chunk, factor)
            yield chunk, prepare(batch.path, chunk, cells, pbc, buffers, least, factor)

    with engine.buffer_ring(device.platform != "cpu", "neighbors") as buffers:
        items = engine.prefetch(prepared(buffers))
        with contextlib.closing(items):
            for chunk, ready in items:
                statistics = compute(ready, cutoffs, device, histogram_bins, per_atom)
                refuse_faults(batch.path, chunk, statistics.pop("fault"))
                have = chunk.present.get("positions")  # none: NaN rows, not in the Summary
                yield chunk, statistics if have is None else engine.blanked(
                    statistics, {name: o.per for name, o in OUTPUTS.items()}, have,
                    chunk.n_atoms)


def refuse_faults(path, chunk, fault):
    """DataError naming the first structure of `chunk` (of the file `path`) with a fault (see
    compute), and what it is."""
    if fault.any():
        s = int(np.flatnonzero(fault)[0])
        raise DataError(f"{path}: structure {chunk.structure_numbers[s]}: "
                        f"{FAULTS[int(fault[s])]}")


class Summary:
    """The dataset's neighbour statistics, added up chunk by chunk (see `add`)."""

    def __init__(self, cutoffs, histogram_bins=0):
        self.cutoffs = list(cutoffs)
        self.atoms = 0
        self.pairs = np.zeros(len(cutoffs), np.int64)
        self.most = np.zeros(len(cutoffs), np.int64)
        self.nearest = (np.inf, -1, -1, -1)  # distance, structure, i, j
        self.histogram = np.zeros(histogram_bins, np.int64)

    def add(self, chunk, statistics):
        """Add a chunk's statistics (see run); structures with NaN rows do not count."""
        distances = statistics["min_distance"]
        have = ~np.isnan(distances)
        self.atoms += int(chunk.n_atoms[have].sum())
        self.pairs += np.nansum(statistics["n_pairs"], axis=0).astype(np.int64)
        self.most = np.maximum(self.most, statistics["max_neighbors"])
        self.histogram += statistics["histogram"]
        if have.any() and np.nanmin(distances) < self.nearest[0]:
            s = int(np.nanargmin(distances))
            self.nearest = (float(distances[s]), int(chunk.structure_numbers[s]),
                            int(statistics["min_pair_i"][s]), int(statistics["min_pair_j"][s]))

    def as_dict(self):
        """The summary as JSON's values: per cutoff the pairs and the mean and largest
        neighbours per atom, the nearest pair (None if none) and the histogram's edges and
        counts."""
        distance, structure, i, j = self.nearest
        found = structure >= 0
        summary = {"cutoffs": self.cutoffs, "atoms": self.atoms, "pairs": self.pairs.tolist(),
                   "mean_neighbors": (self.pairs / self.atoms).tolist() if self.atoms
                   else [None] * len(self.cutoffs),
                   "max_neighbors": self.most.tolist(),
                   "min_distance": distance if found else None,
                   "min_pair": {"structure": structure, "i": i, "j": j} if found else None}
        if len(self.histogram):
            bins = len(self.histogram)
            summary["histogram"] = {
                "edges": [self.cutoffs[-1] * k / bins for k in range(bins + 1)],
                "counts": self.histogram.tolist()}
        return summary

