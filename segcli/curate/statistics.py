"""Dataset statistics that stream and combine exactly, and per-element reference energies.

The moments of each field (segcli.moments.Moments: count, mean, M2, min and max per group and
component) are reduced chunk by chunk and leaf by leaf and combine exactly in any order.
`ReferenceFit` accumulates the least-squares problem of per-element energies as the triangle R
of a QR factorisation of [composition | energy], which combines the same way (a QR of the stacked
triangles) and solves as `numpy.linalg.lstsq` on the whole composition matrix would.

    stats = field_stats(batch, ["forces", "energy"], per_element=True)
    e0, used = solve_e0(batch, "energy", fixed={1: -13.6})
    rmse, mae = residual_errors(batch, "energy", {**e0, 1: -13.6})
"""

import contextlib
import ctypes
import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from segcli import moments_twin, threads
from segcli.errors import DataError
from segcli.fields import held
from segcli.io.core import N_ELEMENTS, are_elements, not_an_element
from segcli.memory import Window
from segcli.moments import (  # noqa: F401  (the statistics' types, for users of this module)
    MOMENT_NAMES,
    FieldStats,
    Moments,
    as_rows,
    component_names,
    join_leaves,
    merge_stats,
)
from segcli.shards import even_cuts

BLOCK_STRUCTURES = 1 << 15
"""Structures whose composition rows are built at a time (bounds memory for tiny structures)."""
MAX_GROUPS = 256
"""The most distinct values a field that `--by` groups by may have (each group's moments are
kept for every leaf)."""
NATIVE_BLOCK_ROWS = 1 << 12
"""Rows of a leaf reduced at a time (see _native_moments), merged in order: with the leaves,
what fixes the bits."""


class _Buffers:
    """Arrays reused from block to block: taking new memory for each (and giving it back)
    can cost more in page faults than the passes over it."""

    def __init__(self):
        self._flat = {}

    def get(self, name, shape, dtype=np.float64):
        """An array of `shape` and `dtype` on the buffer `name`, grown as needed."""
        size, flat = int(np.prod(shape)), self._flat.get(name)
        if flat is None or flat.dtype != dtype or len(flat) < size:
            flat = self._flat[name] = np.empty(size, dtype)
        return flat[:size].reshape(shape)


def _numeric(path, name, info, role):
    if info.dtype.kind not in "biuf":
        raise DataError(f"{path}: field '{name}' holds {held(info.dtype)}, but {role} needs "
                        "real numbers")


def _check_numbers(path, numbers, chunk):
    """DataError naming the first atom of `chunk`, in a structure that has numbers, whose
    number (of `numbers`) is not an atomic number."""
    if len(numbers) and not are_elements(numbers):
        valid = (numbers >= 0) & (numbers < N_ELEMENTS)
        if "numbers" in chunk.present:
            valid |= ~np.repeat(chunk.present["numbers"], chunk.n_atoms)
        if valid.all():
            return
        bad = int(np.argmin(valid))
        raise not_an_element(path, numbers[bad], chunk.structure_of(bad))


def _first_non_finite(chunk, name):
    """(structure, value) of the first NaN or infinite value of field `name` in `chunk` where
    present (see Chunk.present), or None."""
    per_atom = name in chunk.atoms
    rows = as_rows((chunk.atoms if per_atom else chunk.structures)[name])
    bad = ~np.isfinite(rows)
    have = chunk.present.get(name)
    if have is not None:
        bad &= (np.repeat(have, chunk.n_atoms) if per_atom else have)[:, None]
    if not bad.any():
        return None
    row, column = np.unravel_index(np.argmax(bad), bad.shape)
    return (chunk.structure_of(row) if per_atom else int(chunk.structure_numbers[row])), \
        rows[row, column]


def _finite_chunks(batch, energy, chunk_atoms, structures, keep):
    """The chunks of the selection (of the structures `keep` marks, if given) with `energy`
    and numbers, read ahead; DataError naming the first structure whose energy (where present)
    is NaN or infinite (see _refuse_non_finite)."""
    from segcli.engine.pipeline import prefetch

    chunks = batch.iter_chunks([energy, "numbers"], chunk_atoms=chunk_atoms,
                               structures=structures, keep=keep)
    with contextlib.closing(prefetch(chunks)) as chunks:  # its reader stopped, however left
        for chunk in chunks:
            _refuse_non_finite(batch.path, chunk, chunks, [energy],
                               "fit-e0 needs finite energies")
            yield chunk


def _refuse_non_finite(path, chunk, rest, names, need):
    """DataError naming the first field of `names` that holds NaN (with the count over `chunk`
    and the chunks `rest`, see engine.nan_checked) or an infinity (saying what `need`s finite
    values) in `chunk` where present, and the structure; nothing if none does."""
    from segcli.engine.checks import nan_checked

    for name in names:
        found = _first_non_finite(chunk, name)
        if found is None:
            continue
        if np.isnan(found[1]):
            next(nan_checked(path, itertools.chain([chunk], rest), [name], where_present=True))
        raise DataError(f"{path}: field '{name}' is {found[1]} in structure {found[0]}; {need}")


def _overflow(path, name, what):
    """The DataError for finite values of field `name` whose `what` overflows float64."""
    return DataError(f"{path}: field '{name}': its values are too large for {what} in float64 "
                     "(a sum or a sum of squares overflows)")


def refuse_overflow(path, stats):
    """DataError naming the first field of `stats` (name -> FieldStats) whose mean or spread
    overflowed float64 (its values being finite)."""
    for name, s in stats.items():
        if not (np.isfinite(s.moments.mean).all() and np.isfinite(s.moments.m2).all()):
            raise _overflow(path, name, "statistics")


def _require(batch, names, role):
    """The FieldInfo of each name; DataError naming the file and the field if it is missing or
    not numeric."""
    batch.check_fields(names)
    fields = batch.fields
    for name in names:
        _numeric(batch.path, name, fields[name], role)
    return [fields[name] for name in names]


def group_values(batch, by, structures=slice(None), chunk_atoms=1 << 21):
    """The distinct values (sorted, Python ints or strings) of the per-structure integer or
    string field `by` over the structures of the slice `structures` that have it; DataError
    naming the field when it is not such a field or has more than MAX_GROUPS values."""
    info = _require_group_field(batch, by)
    values = set()
    for chunk in batch.iter_chunks([by], chunk_atoms=chunk_atoms, structures=structures):
        column = chunk.structures[by]
        values.update(np.unique(column[chunk.present.get(by, slice(None))]).tolist())
        if len(values) > MAX_GROUPS:
            raise DataError(f"{batch.path}: field '{by}' has more than {MAX_GROUPS} distinct "
                            "values; --by groups by a field of fewer")
    return sorted(values) if info.dtype.kind in "OSU" else sorted(int(v) for v in values)


def _require_group_field(batch, by):
    """The FieldInfo of `by`; DataError unless it holds one integer or string per structure."""
    batch.check_fields([by])
    info = batch.fields[by]
    if info.per != "structure" or info.shape or info.dtype.kind not in "biuOSU":
        raise DataError(f"{batch.path}: --by {by}: field '{by}' is per {info.per} with shape "
                        f"{info.shape} of {held(info.dtype)}, but --by groups by one integer or "
                        "string per structure")
    return info


def leaf_stats(batch, names, leaves, *, per_element=False, per_atom=False, by=None,
               groups=None, keep=None, chunk_atoms=1 << 21, progress=None):
    """FieldStats of each field of `names`, its moments stacked by leaf: one entry for each run
    of structures between consecutive structure numbers `leaves`, computed from that run alone
    (chunks of at most `chunk_atoms` atoms hold whole leaves, a bigger leaf is chunked from its
    start, each leaf reduced in blocks of NATIVE_BLOCK_ROWS rows from its first), so the same
    in any shard. Per-atom fields go over
    all atoms (grouped by `numbers` with `per_element`), per-structure fields over all
    structures (divided by each structure's atom count with `per_atom`, empty structures left
    out). With `by`, every field is grouped by the value of that per-structure field, one
    group per value of `groups` (see group_values). Structures that lack a field
    (Chunk.present), or with `per_element` numbers or with `by` that field, and those that
    `keep` ((S,) bool), if given, leaves out, are left out of it.
    `progress.update(n)` is called with the structures of each chunk done."""
    from segcli.engine.pipeline import prefetch

    if per_element and by is not None:
        raise ValueError("group by element or by a field, not both")
    names = list(dict.fromkeys(names))
    infos = _require(batch, names, "stats")
    shapes = {info.name: info.shape for info in infos}
    out = {info.name: FieldStats(info.name, info.per, component_names(info.shape),
                                 per_element and info.per == "atom",
                                 per_atom and info.per == "structure", by=by,
                                 groups=None if by is None else list(groups)) for info in infos}
    by_element = any(s.by_element for s in out.values())
    if by_element:
        _require(batch, ["numbers"], "--per-element")
    if by is not None:
        _require_group_field(batch, by)
        values = np.array(groups, object if batch.fields[by].dtype.kind in "OSU" else np.int64)
    leaves = np.asarray(leaves, np.int64)
    n_leaves = len(leaves) - 1
    for s in out.values():
        n_groups = N_ELEMENTS if s.by_element else len(groups) if by is not None else 1
        s.moments = Moments.empty(n_groups, len(s.components), leaves=n_leaves)
    read = list(dict.fromkeys(names + ["numbers"] * by_element + [by] * (by is not None)))
    structures = slice(int(leaves[0]), int(leaves[-1]))
    buffers = _Buffers()
    chunks = prefetch(batch.iter_chunks(read, chunk_atoms=chunk_atoms, structures=structures,
                                        breaks=leaves[1:-1], keep=keep, into=_in_place))
    with contextlib.closing(chunks):  # its reader stopped however the loop is left
        for chunk in chunks:
            labels = {}  # per: the group of each row (uint8, or integers the moments check)
            if by_element:
                numbers = chunk.atoms["numbers"]
                if not chunk.present and numbers.dtype.kind in "iu" and numbers.dtype.isnative:
                    labels["atom"] = numbers  # checked by the moments, as they read them
                else:
                    _check_numbers(batch.path, numbers, chunk)
                    labels["atom"] = numbers.astype(np.uint8)
            if by is not None:
                group = np.searchsorted(values, chunk.structures[by]).astype(np.uint8)
                labels = {"structure": group, "atom": np.repeat(group, chunk.n_atoms)}
            first, starts = _leaf_runs(chunk.structure_numbers, leaves)
            parts = [_add_chunk(chunk, s, shapes[s.name], labels.get(s.per), starts, first,
                                buffers) for s in out.values()]
            if any(part is None for part in parts):  # a number that is no atomic number
                _check_numbers(batch.path, chunk.atoms["numbers"], chunk)
            if not all(_finite(chunk, s, part) for s, part in zip(out.values(), parts)):
                _refuse_non_finite(batch.path, chunk, chunks, names, "stats needs finite values")
            if progress is not None:
                progress.update(len(chunk.n_atoms))
    return out


def _leaf_runs(numbers, leaves):
    """(first, starts) for the increasing structure `numbers` (one at least) in the leaves
    between the increasing bounds `leaves`: the leaf of the first number (the index of the last
    bound at or below it, -1 below the first), and where each leaf from it to the last
    number's begins among the numbers, len(numbers) last ((L + 1,)). One search per leaf
    bound, none per number."""
    first, last = (int(leaf) for leaf in
                   np.searchsorted(leaves, numbers[[0, -1]], side="right") - 1)
    inner = np.searchsorted(numbers, leaves[first + 1:last + 1])
    return first, np.concatenate([[0], inner, [len(numbers)]])


def _in_place(name, rows):
    """The `into` of the chunks whose moments are taken: their per-atom rows left in the
    file's pages where its format can (segcli.memory.Window), not copied, as the moments read them
    once and keep nothing."""
    return Window(rows, align=1)


def _add_chunk(chunk, s, shape, labels, starts, first, buffers):
    """The rows of field `s` (FieldStats) in `chunk` added to its moments: those of the
    chunk's structures, leaf j from structure starts[j] (see _leaf_runs), to leaves `first` on
    of s.moments, its rows in groups `labels` (uint8, or integers the moments in C check; for
    a field grouped by element or by `s.by`), in C (`_native_moments`, in `buffers`) or, where
    it was not built, by its NumPy twin (segcli.moments_twin): the same bits. Returns those L
    leaves of s.moments, or None where such a label is no group (the moments then left
    part-way)."""
    per_atom = s.per == "atom"
    array = (chunk.atoms if per_atom else chunk.structures)[s.name]
    keep = chunk.present.get(s.name)
    by = "numbers" if s.by_element else s.by
    if by in chunk.present:  # rows without what they are grouped by have no group
        keep = chunk.present[by] & (True if keep is None else keep)
    rows = chunk.n_atoms if per_atom else np.ones(len(chunk.n_atoms), np.int64)
    if s.per_atom:
        array = array / np.maximum(chunk.n_atoms, 1).reshape(-1, *(1,) * (array.ndim - 1))
        keep = chunk.n_atoms > 0 if keep is None else keep & (chunk.n_atoms > 0)
    if keep is not None:
        rows = rows * keep
        kept = np.repeat(keep, chunk.n_atoms) if per_atom else keep
        array = array[kept]
        labels = labels[kept] if s.grouped else None
    values = as_rows(array)
    count = np.diff(np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])[starts])
    into = s.moments[first:first + len(count)]  # a view: the chunk's leaves
    grouped = labels if s.grouped else None
    native = _native_moments()
    done = (native(values, bool(shape), count, grouped, into, buffers) if native is not None
            else moments_twin.moments(values, bool(shape), count, grouped, into,
                                      NATIVE_BLOCK_ROWS))
    return into if done else None


@functools.cache
def _native_moments():
    """The moments of a chunk's rows in C (`_moments.c`), many times faster than its NumPy
    twin (segcli.moments_twin): moments(rows (n, k), whether to add their norms, rows per leaf
    (L,), integer groups (n,) or None, Moments (L, G, K) to add them to, _Buffers) ->
    whether every group was one of the G (else the moments are left part-way). Each leaf
    is reduced in blocks of NATIVE_BLOCK_ROWS rows from its first, each sum in two chains, the
    blocks merged by Chan's formulas. None where it was not built (see segcli.native) or
    with SEGCLI_NATIVE_STATS=0: its NumPy twin then, which gives the same bits. Either gives
    the same bits in any split into shards."""
    from segcli.native import MOMENTS, library

    lib = library(MOMENTS)
    if lib is None:
        return None
    moments_library(lib)

    def moments(rows, with_norm, count, labels, out, buffers):
        # rows left in the file's pages (read-only, segcli.memory.Window) leave the reading thread
        # little to do: every core takes a share; else one is left to it
        helpers = threads.count() if not rows.flags.writeable else max(1, threads.count() - 1)
        if rows.dtype not in (np.float32, np.float64):
            rows = rows.astype(np.float64)
        rows = np.ascontiguousarray(rows)
        if labels is not None and (labels.dtype.kind not in "iu" or not labels.dtype.isnative):
            labels = labels.astype(np.uint8)
        labels = None if labels is None else np.ascontiguousarray(labels)
        n_groups, k = out.mean.shape[1:]
        block = NATIVE_BLOCK_ROWS
        size = lib.segcli_moments_scratch(block, n_groups, k) // 8
        offsets = np.concatenate([[0], np.cumsum(count)])
        # as many runs of whole leaves as threads, each cut after its share of the rows
        runs = max(1, min(helpers, int(offsets[-1]) // PART_ROWS))
        parts = np.unique(even_cuts(count, runs)).tolist()

        bad = []  # the parts that found a label that is no group

        def part(i, a, b):
            lo, hi = offsets[a], offsets[b]
            scratch = buffers.get(f"scratch {i}", (size,))
            if lib.segcli_moments(rows[lo:hi].ctypes.data, int(rows.dtype == np.float32),
                                  rows.shape[1], int(with_norm), count[a:b].ctypes.data, b - a,
                                  None if labels is None else labels[lo:hi].ctypes.data,
                                  0 if labels is None else labels.itemsize, n_groups, block,
                                  *(getattr(out, key)[a:b].ctypes.data for key in MOMENT_NAMES),
                                  scratch.ctypes.data) >= 0:
                bad.append(i)

        threads.run([functools.partial(part, i, a, b)
                     for i, (a, b) in enumerate(itertools.pairwise(parts))])
        return not bad

    return moments


PART_ROWS = 1 << 18
"""The fewest rows that a thread takes of a chunk's moments (whole leaves): a chunk's leaves
are shared by up to `threads.count()` threads, one fewer where the reading thread copies the
rows (it then takes the last core)."""


def moments_library(lib):
    """`lib` (_moments.c built and loaded) with its functions' C types declared."""
    lib.segcli_moments_scratch.restype = ctypes.c_int64
    lib.segcli_moments_scratch.argtypes = [ctypes.c_int64] * 3
    lib.segcli_moments.restype = ctypes.c_int64
    lib.segcli_moments.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                                   ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                                   ctypes.c_int64, *[ctypes.c_void_p] * 6]
    return lib


def _finite(chunk, s, part):
    """Whether field `s` holds only finite values in `chunk` where present: the means of its
    moments `part` are finite, and, per structure, so is the sum of its values (which `part`
    may leave out); False also where a sum overflows."""
    if s.per == "atom":
        return np.isfinite(part.mean).all()
    values, keep = chunk.structures[s.name], chunk.present.get(s.name)
    return np.isfinite((values if keep is None else values[keep]).sum())


def field_stats(batch, names, *, structures=slice(None), **options):
    """FieldStats of each field of `names` over the selected structures of `batch` (see
    leaf_stats for `options`), reduced leaf by leaf in a fixed tree (segcli.shards): the
    same bits as the merge of any split of the selection into shards."""
    from segcli.shards import leaf_bounds

    start, stop, _ = structures.indices(batch.n_structures)
    stop = max(start, stop)
    leaves = start + leaf_bounds(batch.n_atoms[start:stop])
    return merge_stats([leaf_stats(batch, names, leaves, **options)])


def census(batch, chunk_atoms=1 << 21):
    """(elements, strings) of `batch`, streamed in one pass: elements (2, N_ELEMENTS) the atoms
    of each atomic number and the structures holding one (None without an integer per-atom
    `numbers`), strings a Counter of the values of each per-structure string field, over the
    structures that have the field."""
    import collections

    fields = batch.fields
    numbers = fields.get("numbers")
    counted = numbers is not None and numbers.per == "atom" and not numbers.shape \
        and numbers.dtype.kind in "iu"
    texts = [f.name for f in fields.values()
             if f.per == "structure" and not f.shape and f.dtype.kind == "O"]
    elements = np.zeros((2, N_ELEMENTS), np.int64) if counted else None
    strings = {name: collections.Counter() for name in texts}
    read = ["numbers"] * counted + texts
    for chunk in batch.iter_chunks(read, chunk_atoms=chunk_atoms) if read else ():
        for name in texts:
            strings[name].update(chunk.structures[name][chunk.present.get(name, slice(None))])
        if counted:
            atoms = chunk.atoms["numbers"]
            _check_numbers(batch.path, atoms, chunk)
            structure = np.repeat(np.arange(len(chunk.n_atoms)), chunk.n_atoms)
            if "numbers" in chunk.present:
                have = np.repeat(chunk.present["numbers"], chunk.n_atoms)
                atoms, structure = atoms[have], structure[have]
            elements[0] += np.bincount(atoms, minlength=N_ELEMENTS)
            holds = np.zeros((len(chunk.n_atoms), N_ELEMENTS), bool)
            holds[structure, atoms] = True
            elements[1] += holds.sum(axis=0)
    return elements, strings


def composition(numbers, n_atoms):
    """(S, N_ELEMENTS) counts of each atomic number in each structure, from the atoms' numbers
    (concatenated in structure order) and the structures' atom counts."""
    structure = np.repeat(np.arange(len(n_atoms)), n_atoms)
    counts = np.bincount(structure * N_ELEMENTS + numbers, minlength=len(n_atoms) * N_ELEMENTS)
    return counts.reshape(len(n_atoms), N_ELEMENTS)


@dataclass
class ReferenceFit:
    """The least-squares problem min Σ_s (e_s − Σ_Z c_sZ E0_Z)² over the elements not `fixed`
    (Z -> E0 held), accumulated block by block as the triangle R of QR([C | e − C_fixed E0]):
    RᵀR is the normal matrix, without squaring its condition number."""

    fixed: dict
    elements: list = field(default_factory=list)  # atomic number of each free column
    r: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)))
    structures: int = 0

    def add(self, counts, energies):
        """Add structures: their composition counts (S_b, N_ELEMENTS) and energies (S_b,)."""
        seen = np.flatnonzero(counts.any(axis=0))
        new = [int(z) for z in seen if int(z) not in self.fixed and int(z) not in self.elements]
        if new:
            k = len(self.elements)
            self.r = np.insert(self.r, [k] * len(new), 0.0, axis=1)
            self.elements += new
        held = sorted(self.fixed)
        target = energies - counts[:, held] @ np.array([self.fixed[z] for z in held], float)
        block = np.column_stack([counts[:, self.elements], target])
        self.r = np.linalg.qr(np.vstack([self.r, block]), mode="r")
        self.structures += len(energies)

    def solve(self, path):
        """Z -> E0 of the free elements; DataError naming the elements whose energies the data
        cannot separate (their counts are linearly dependent over the structures)."""
        k = len(self.elements)
        if not k:
            return {}
        a, b = self.r[:, :k], self.r[:, k]
        _, s, vt = np.linalg.svd(a)
        tol = s.max(initial=0.0) * max(self.structures, k) * np.finfo(float).eps
        rank = int(np.count_nonzero(s > tol))
        if rank < k:
            from ase.data import chemical_symbols

            null = vt[rank:]
            tied = [chemical_symbols[z] for z, v in zip(self.elements, np.abs(null).max(axis=0))
                    if v > 1e-8]
            raise DataError(f"{path}: the reference energies of {', '.join(tied)} cannot be "
                            f"separated: their counts are linearly dependent over the "
                            f"{self.structures} structure(s) used (hold some with "
                            "--fixed SYMBOL=VALUE)")
        return dict(zip(self.elements, np.linalg.lstsq(a, b, rcond=None)[0].tolist()))


def _energy_chunks(batch, energy, chunk_atoms, structures, keep, progress):
    """(chunk, its numbers checked (0 in structures without numbers), bool (S_c,) of its
    structures that have an energy and numbers) for each chunk (of the structures `keep`
    marks, if given); `progress.update(n)` is called with the structures of each chunk once
    used."""
    infos = _require(batch, [energy, "numbers"], "fit-e0")
    if infos[0].per != "structure" or infos[0].shape != ():
        raise DataError(f"{batch.path}: field '{energy}' is per {infos[0].per} with shape "
                        f"{infos[0].shape}, but the energy must be one number per structure")
    if infos[1].per != "atom" or infos[1].shape != () or infos[1].dtype.kind not in "iu":
        raise DataError(f"{batch.path}: field 'numbers' must hold one integer per atom")
    with contextlib.closing(_finite_chunks(batch, energy, chunk_atoms, structures,
                                           keep)) as chunks:
        for chunk in chunks:
            numbers = chunk.atoms["numbers"]
            _check_numbers(batch.path, numbers, chunk)
            have = np.ones(len(chunk.n_atoms), bool)
            for name in (energy, "numbers"):
                have &= chunk.present.get(name, True)
            if "numbers" in chunk.present:
                numbers = np.where(np.repeat(chunk.present["numbers"], chunk.n_atoms),
                                   numbers, 0)
            yield chunk, numbers, have
            if progress is not None:
                progress.update(len(chunk.n_atoms))


def solve_e0(batch, energy="energy", *, fixed=None, chunk_atoms=1 << 21,
             structures=slice(None), keep=None, progress=None):
    """(Z -> E0, structures used): the per-element reference energies minimising
    Σ_s (E_s − Σ_Z c_sZ E0_Z)² over the selected structures (of the slice `structures`, and
    those `keep` marks, if given) that have an `energy` and `numbers` (c from them),
    streamed; elements absent from them are left out, those of `fixed` (Z -> E0) held (and
    not returned). `progress.update(n)` is called as n more
    structures are read."""
    fit = ReferenceFit(dict(fixed or {}))
    with contextlib.closing(_energy_chunks(batch, energy, chunk_atoms, structures, keep,
                                           progress)) as chunks:
        for chunk, numbers, have in chunks:
            energies = chunk.structures[energy]
            bounds = np.concatenate([[0], np.cumsum(chunk.n_atoms)])
            for lo in range(0, len(chunk.n_atoms), BLOCK_STRUCTURES):
                hi = min(lo + BLOCK_STRUCTURES, len(chunk.n_atoms))
                use = have[lo:hi]
                counts = composition(numbers[bounds[lo]:bounds[hi]], chunk.n_atoms[lo:hi])
                fit.add(counts[use], np.asarray(energies[lo:hi], float)[use])
    e0 = fit.solve(batch.path)
    if not np.isfinite(list(e0.values())).all():
        raise _overflow(batch.path, energy, "a fit")
    return e0, fit.structures


def residual_errors(batch, energy, e0, *, chunk_atoms=1 << 21, structures=slice(None),
                    keep=None, on_chunk=None, progress=None):
    """(RMSE, MAE) of the per-atom residual (E − Σ_Z c_Z E0_Z) / n over the selected structures
    (as solve_e0 selects them) that have an `energy`, numbers and atoms (NaN if none), `e0`
    mapping Z -> E0; each chunk's
    residual energies go to `on_chunk(chunk, values)` if given (NaN where a structure has no
    energy or numbers);
    `progress.update(n)` is called as n more structures are read."""
    by_number = np.zeros(N_ELEMENTS)
    by_number[list(e0)] = list(e0.values())
    errors = Moments.empty(1, 2)
    with contextlib.closing(_energy_chunks(batch, energy, chunk_atoms, structures, keep,
                                           progress)) as chunks:
        for chunk, numbers, have in chunks:
            structure = np.repeat(np.arange(len(chunk.n_atoms)), chunk.n_atoms)
            reference = np.bincount(structure, weights=by_number[numbers],
                                    minlength=len(chunk.n_atoms))
            values = np.where(have, chunk.structures[energy] - reference, np.nan)
            if on_chunk:
                on_chunk(chunk, values)
            use = have & (chunk.n_atoms > 0)
            per_atom = values[use] / chunk.n_atoms[use]
            errors = errors.merge(Moments.of(np.column_stack([per_atom, np.abs(per_atom)])))
    if not errors.count[0]:
        return float("nan"), float("nan")
    rmse, mae = float(errors.rms[0, 0]), float(errors.mean[0, 1])
    if not np.isfinite([rmse, mae]).all():
        raise _overflow(batch.path, energy, "the residual's errors")
    return rmse, mae

