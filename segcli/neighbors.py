"""Neighbour statistics at cutoffs, streamed over a batch: per structure, the ordered pairs of
atoms (i, j, periodic image) closer than each cutoff, as `ase.neighborlist.neighbor_list`
counts them (an atom with its own image counts, with itself in its own cell not), and the
nearest pair; per atom, its neighbours.

A chunk of structures becomes one cell list (`cell_list`, on the host, vectorised over the
structures): each structure's atoms are wrapped into its cell along its periodic axes and
binned on a grid of its own whose bins are at least the largest cutoff wide, in the basis of
its lattice (mixed, non-orthogonal, partly periodic, or none: Cartesian). A Warp kernel
then visits, for each atom, the bins within reach of its own in every periodic image that
reaches it (several images of the cell when it is thinner than the cutoff), and segcli's
segment ops reduce its per-atom counts and nearest distances per structure. Memory is
bounded by the chunk: no pair list, no N² matrix.
"""

import contextlib
import functools
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError

SLACK = 1e-9
"""Bins are this much (relatively) wider than the cutoff, so that a position's rounding in the
wrap cannot put a pair closer than the cutoff two bins apart."""

MAX_IMAGES = 1_000_000
"""The most bins (bins × periodic images) one atom may have to visit: a cell far thinner than
the cutoff is refused rather than left to run for hours."""

OUTPUTS = {
    "n_pairs": ("structure", np.int64),
    "mean_neighbors": ("structure", np.float64),
    "min_distance": ("structure", np.float64),
    "min_pair_i": ("structure", np.int64),
    "min_pair_j": ("structure", np.int64),
    "n_neighbors": ("atom", np.int64),
}
"""Each result -> (per, dtype); n_pairs, mean_neighbors and n_neighbors are per cutoff."""


def result_names(cutoffs, per_atom):
    """The results of a run: name -> (statistic (a key of OUTPUTS), per, dtype, the index of
    the cutoff it is of, or None for the nearest pair, taken over the largest cutoff). One
    cutoff: the names of OUTPUTS; several: n_pairs_R, mean_neighbors_R (and n_neighbors_R)
    for each cutoff R."""
    names = {}
    for base, (per, dtype) in OUTPUTS.items():
        if per == "atom" and not per_atom:
            continue
        if base in ("n_pairs", "mean_neighbors", "n_neighbors"):
            for k, cutoff in enumerate(cutoffs):
                name = base if len(cutoffs) == 1 else f"{base}_{cutoff:g}"
                names[name] = (base, per, dtype, k)
        else:
            names[base] = (base, per, dtype, None)
    return names


class CellList(NamedTuple):
    """A chunk's atoms binned (see cell_list): per atom in bin order, its wrapped position, its
    row in the chunk, its structure (-1: padding) and its bin's coordinates; where each bin
    starts; per structure, the lattice vectors of its periodic images (rows), its bins and the
    reach (in bins) along each axis, which axes are periodic, its first bin and first row."""

    positions: np.ndarray
    row: np.ndarray
    structure: np.ndarray
    bin_xyz: np.ndarray
    bin_start: np.ndarray
    lattice: np.ndarray
    bins: np.ndarray
    reach: np.ndarray
    periodic: np.ndarray
    first_bin: np.ndarray
    first_row: np.ndarray


def _unit(v):
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def _basis(cells, periodic):
    """(S, 3, 3) rows: each structure's periodic lattice vectors, with unit vectors normal to
    them (and to each other) along its other axes; the identity for a structure with no
    periodic axis. Its fractional coordinates bin the atoms."""
    basis = np.broadcast_to(np.eye(3), cells.shape).copy()
    for pattern in np.unique(periodic, axis=0):
        where = (periodic == pattern).all(axis=1)
        if not where.any() or not pattern.any():
            continue
        cell = cells[where]
        on = np.flatnonzero(pattern)
        out = basis[where]
        out[:, on] = cell[:, on]
        if len(on) == 2:
            off = 3 - on.sum()
            out[:, off] = _unit(np.cross(cell[:, on[0]], cell[:, on[1]]))
        elif len(on) == 1:
            a = cell[:, on[0]]
            helper = np.eye(3)[np.argmin(np.abs(_unit(a)), axis=1)]
            u = _unit(np.cross(a, helper))
            v = _unit(np.cross(a, u))
            out[:, [k for k in range(3) if k != on[0]]] = np.stack([u, v], axis=1)
        basis[where] = out
    return basis


def _per_atom(matrices, structure, vectors):
    """vectors[i] @ matrices[structure[i]] for every row i: (N, 3)."""
    out = np.zeros_like(vectors)
    for j in range(3):
        for k in range(3):
            out[:, k] += vectors[:, j] * matrices[structure, j, k]
    return out


def cell_list(path, numbers, positions, n_atoms, cells, pbc, cutoff):
    """The CellList of a chunk of structures (numbered `numbers` in the file `path`, as errors
    name them): `positions` (N, 3) float64 of structures of `n_atoms`
    atoms, with lattice vectors `cells` (S, 3, 3) (rows) periodic along `pbc` (S, 3) bool,
    binned for pairs closer than `cutoff`. DataError for a cell singular along its periodic
    axes, or far thinner than the cutoff (see MAX_IMAGES)."""
    n_structures = len(n_atoms)
    offsets = np.zeros(n_structures + 1, np.int64)
    np.cumsum(n_atoms, out=offsets[1:])
    structure = np.repeat(np.arange(n_structures, dtype=np.int32), n_atoms)
    periodic = np.asarray(pbc, bool)
    with np.errstate(invalid="ignore"):  # a zero periodic vector: refused below
        basis = _basis(cells, periodic)
        lengths = np.linalg.norm(basis, axis=2)
        volume = np.abs(np.linalg.det(basis))
    singular = ~(volume > 1e-9 * lengths.prod(axis=1))
    if singular.any():
        s = int(np.argmax(singular))
        raise DataError(f"{path}: structure {numbers[s]}: its cell is singular along its "
                        f"periodic axes (pbc {periodic[s].tolist()}, cell "
                        f"{cells[s].tolist()})")
    inverse = np.linalg.inv(basis)
    spacing = 1 / np.linalg.norm(inverse, axis=1)  # between lattice planes, per axis
    fractional = _per_atom(inverse, structure, positions)
    image = np.where(periodic[structure], np.floor(fractional), 0)
    fractional -= image
    wrapped = positions - _per_atom(basis, structure, image)

    filled = n_atoms > 0
    low, high = np.zeros((n_structures, 3)), np.ones((n_structures, 3))
    if filled.any():
        starts = offsets[:-1][filled]
        low[filled] = np.minimum.reduceat(fractional, starts)
        high[filled] = np.maximum.reduceat(fractional, starts)
    low[periodic], high[periodic] = 0, 1
    extent = (high - low) * spacing
    reach_of = cutoff * (1 + SLACK)
    bins = np.maximum(1, np.floor(extent / reach_of)).astype(np.int64)
    most = np.maximum(1, n_atoms)  # a cell of vacuum gets no more bins than atoms
    for _ in range(64):
        over = bins.prod(axis=1) > most
        if not over.any():
            break
        largest = np.argmax(bins, axis=1)
        bins[over, largest[over]] = np.maximum(1, bins[over, largest[over]] // 2)
    width = extent / bins
    with np.errstate(divide="ignore", invalid="ignore"):
        reach = np.where(periodic, np.ceil(reach_of / width), np.minimum(bins - 1, 1))
    images = np.prod(2 * reach + 1, axis=1)
    if (images > MAX_IMAGES).any():
        s = int(np.argmax(images))
        raise DataError(f"{path}: structure {numbers[s]}: its cell is {extent[s].min():.3g} Å "
                        f"thin, and a cutoff of {cutoff:g} Å would visit {int(images[s])} "
                        f"periodic images of its bins for each atom")
    span = np.where(high > low, high - low, 1)
    scaled = (fractional - low[structure]) / span[structure] * bins[structure]
    bin_xyz = np.clip(np.floor(scaled), 0, bins[structure] - 1).astype(np.int64)
    first_bin = np.zeros(n_structures + 1, np.int64)
    np.cumsum(bins.prod(axis=1), out=first_bin[1:])
    if first_bin[-1] >= 2**31 - 1:
        raise DataError(f"{path}: structures {numbers[0]}..{numbers[-1]} need "
                        f"{first_bin[-1]} bins; use a smaller --chunk-atoms")
    key = first_bin[structure] + (bin_xyz[:, 0] * bins[structure, 1] + bin_xyz[:, 1]) \
        * bins[structure, 2] + bin_xyz[:, 2]
    order = np.argsort(key, kind="stable")
    bin_start = np.zeros(first_bin[-1] + 1, np.int64)
    np.cumsum(np.bincount(key, minlength=first_bin[-1]), out=bin_start[1:])
    lattice = np.where(periodic[:, :, None], basis, 0)
    return CellList(wrapped[order], order.astype(np.int32), structure[order],
                    bin_xyz[order].astype(np.int32), bin_start.astype(np.int32), lattice,
                    bins.astype(np.int32), reach.astype(np.int32), periodic.astype(np.int32),
                    first_bin[:-1].astype(np.int32), offsets[:-1].astype(np.int32))


def _padded(cell_list, rows, segments, n_bins):
    """The CellList's arrays padded to `rows` atoms, `segments` structures and `n_bins` bins
    (padding atoms belong to structure -1, padding bins are empty), as the kernel takes them."""
    def pad(array, size, value=0):
        out = np.full((size, *array.shape[1:]), value, array.dtype)
        out[:len(array)] = array
        return out

    c = cell_list
    bin_start = pad(c.bin_start, n_bins + 1, c.bin_start[-1])
    return (pad(c.positions, rows), pad(c.row, rows), pad(c.structure, rows, -1),
            pad(c.bin_xyz, rows), bin_start, pad(c.lattice, segments), pad(c.bins, segments, 1),
            pad(c.reach, segments), pad(c.periodic, segments), pad(c.first_bin, segments),
            pad(c.first_row, segments))


@functools.cache
def _program(n_cutoffs, rows, segments, n_bins, histogram_bins):
    """A jitted function of a padded chunk -> per structure: pairs per cutoff (S, K), the
    nearest distance, the pair attaining it (the lowest i, then j); per atom: neighbours
    per cutoff (N, K); the largest per-atom count per cutoff and the histogram of
    distances."""
    import jax
    import jax.numpy as jnp

    from segcli import ops
    from segcli.ops._kernels import launch

    def program(arrays, offsets, ids, cutoffs, scale):
        counts, nearest, partner, histogram = launch(
            "neighbors", *arrays, cutoffs, scale,
            jnp.zeros((rows, n_cutoffs), jnp.int32), jnp.zeros(rows, jnp.float64),
            jnp.zeros(rows, jnp.int32), jnp.zeros(histogram_bins, jnp.int32),
            dims=rows, in_out=("counts", "nearest", "partner", "histogram"))
        idx = ops.Segments(ids, offsets)
        counts = counts.astype(jnp.int64)
        pairs = ops.segmented_sum(counts, idx, segments, indices_are_sorted=True)
        least = ops.segmented_min(nearest, idx, segments, indices_are_sorted=True)
        atom = jnp.arange(rows) - offsets[jnp.minimum(ids, segments - 1)]
        attains = (nearest == least[jnp.minimum(ids, segments - 1)]) & jnp.isfinite(nearest)
        first_i = ops.segmented_min(jnp.where(attains, atom, rows), idx, segments,
                                    indices_are_sorted=True)
        found = first_i < rows
        first_j = partner[jnp.minimum(offsets[:-1] + first_i, rows - 1)]
        return (pairs, least, jnp.where(found, first_i, -1), jnp.where(found, first_j, -1),
                counts, counts.max(axis=0, initial=0), histogram)

    return jax.jit(program)


class Prepared(NamedTuple):
    """A chunk's cell list padded for the kernel (see prepare)."""

    arrays: tuple
    offsets: np.ndarray
    ids: np.ndarray
    n_bins: int


def prepare(path, chunk, cells, pbc, cutoff):
    """The Prepared chunk (io.core.Chunk holding `positions` in Å) of structures whose lattice
    vectors are `cells` (S, 3, 3) and periodic axes `pbc` (S, 3), binned for `cutoff`, padded
    to power-of-two sizes (few compilations over a run)."""
    from segcli.engine import bucket

    n_atoms = chunk.n_atoms
    positions = np.asarray(chunk.atoms["positions"], np.float64)
    c = cell_list(path, chunk.structure_numbers, positions, n_atoms,
                  np.asarray(cells, np.float64), pbc, cutoff)
    rows, segments = bucket(len(positions)), bucket(len(n_atoms))
    n_bins = bucket(len(c.bin_start) - 1)
    offsets = np.full(segments + 1, len(positions), np.int32)
    offsets[:len(n_atoms) + 1] = np.concatenate([[0], np.cumsum(n_atoms)])
    ids = np.full(rows, segments, np.int32)
    ids[:len(positions)] = np.repeat(np.arange(len(n_atoms), dtype=np.int32), n_atoms)
    return Prepared(_padded(c, rows, segments, n_bins), offsets, ids, n_bins)


def compute(prepared, n_structures, n_rows, cutoffs, device, histogram_bins=0):
    """The neighbour statistics of a Prepared chunk of `n_structures` structures and `n_rows`
    atoms, for the ascending `cutoffs`: per structure n_pairs (S, K), min_distance,
    min_pair_i, min_pair_j (S,); per atom n_neighbors (N, K); for the chunk max_neighbors (K,)
    and the histogram of pair distances below the largest cutoff (histogram_bins,)."""
    import jax

    from segcli._jax import enable_x64

    cutoffs = np.asarray(cutoffs, np.float64)
    scale = np.array([histogram_bins / cutoffs[-1] if histogram_bins else 0.0])
    program = _program(len(cutoffs), len(prepared.ids), len(prepared.offsets) - 1,
                       prepared.n_bins, max(1, histogram_bins))
    with enable_x64(True):
        args = jax.device_put((prepared.arrays, prepared.offsets, prepared.ids, cutoffs, scale),
                              device)
        out = [np.asarray(a) for a in program(*args)]
    pairs, least, first_i, first_j, counts, most, histogram = out
    s, n = n_structures, n_rows
    return {"n_pairs": pairs[:s], "min_distance": least[:s], "min_pair_i": first_i[:s],
            "min_pair_j": first_j[:s], "n_neighbors": counts[:n], "max_neighbors": most,
            "histogram": histogram[:histogram_bins].astype(np.int64)}


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
        histogram_bins=0):
    """Yield (Chunk, statistics) for each chunk of whole structures of `batch` (those `keep`
    marks, if given): see `compute`, for the ascending `cutoffs` in Å; the next chunk read and
    binned in a background thread while this one is computed on `device`. Positions stated in
    other units (bohr, nm) are converted; DataError for positions holding NaN."""
    from segcli import engine
    from segcli.io import units

    cutoffs = np.asarray(cutoffs, np.float64)
    fields = batch.fields
    names = ["positions"] + [n for n in ("cell", "pbc") if n in fields]
    unit = batch.units.get("positions")
    factor = units.known()[unit][1] if unit in units.known() else 1.0

    def prepared():
        chunks = batch.iter_chunks(names, chunk_atoms=chunk_atoms, structures=structures,
                                   keep=keep)
        for chunk in engine.nan_checked(batch.path, chunks, ["positions", *names[1:2]],
                                        where_present=True):
            have = chunk.present.get("positions")
            positions = chunk.atoms["positions"] * factor
            if have is not None:  # structures without positions: no atoms, NaN results
                positions[~np.repeat(have, chunk.n_atoms)] = 0
            cells, pbc = lattices(chunk, factor)
            located = chunk._replace(atoms={**chunk.atoms, "positions": positions})
            yield chunk, prepare(batch.path, located, cells, pbc, float(cutoffs[-1]))

    items = engine.prefetch(prepared())
    with contextlib.closing(items):
        for chunk, ready in items:
            statistics = compute(ready, len(chunk.n_atoms), int(chunk.n_atoms.sum()), cutoffs,
                                 device, histogram_bins)
            have = chunk.present.get("positions")
            yield chunk, statistics if have is None else _blanked(statistics, have,
                                                                  chunk.n_atoms)


def _blanked(statistics, have, n_atoms):
    """The statistics of a chunk with NaN in the rows of the structures (and their atoms)
    that lack positions (`have` False), their integers as float64; the summary counts them
    not."""
    from segcli.engine import nan_dtype

    rows = {len(have): ~have, int(n_atoms.sum()): np.repeat(~have, n_atoms)}
    out = dict(statistics)
    for name in ("n_pairs", "min_distance", "min_pair_i", "min_pair_j", "n_neighbors"):
        array = np.array(statistics[name], nan_dtype(statistics[name].dtype))
        array[rows[len(array)]] = np.nan
        out[name] = array
    return out


def mean_neighbors(n_pairs, n_atoms):
    """Pairs per atom of each structure: NaN for a structure without atoms."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return n_pairs / np.asarray(n_atoms, np.float64)[:, None]

