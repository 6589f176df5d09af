"""What a run refuses or blanks, on the host: NaN in the inputs (counted over the run and
named), integer sums that would wrap, float results that overflow though their inputs are
finite, integer results that float64 does not hold exactly, and NaN rows for structures
that lack a field.

    for chunk in nan_checked("f.h5", batch.iter_chunks(["forces"]), ["forces"]):
        ...  # DataError at the end where a chunk held NaN
"""

import numpy as np

from segcli.engine.jobs import integer_result, job_present, nan_dtype
from segcli.errors import DataError


def nan_rows(chunk, name, where_present, keep=None):
    """The rows of field `name` of `chunk` that hold NaN (with `where_present`, only in
    structures that have the field, see Chunk.present; only in those `keep` marks, see
    whole_kept), or None where none does."""
    array = chunk.atoms.get(name, chunk.structures.get(name))
    # the max is NaN where an entry is (never otherwise, where a sum of ±inf is), and takes
    # half the time of a sum
    if array.dtype.kind != "f" or not np.isnan(np.max(array, initial=-np.inf)):
        return None
    rows = np.isnan(array.reshape(len(array), -1)).any(axis=1)
    have = chunk.present.get(name) if where_present else None
    for mask in (have, whole_kept(chunk, keep)):
        if mask is not None:
            rows &= np.repeat(mask, chunk.n_atoms) if name in chunk.atoms else mask
    return rows if rows.any() else None


def whole_kept(chunk, keep):
    """The structures of `chunk` that `keep` ((S,) bool over the file's, or None) marks, where
    the chunk holds them all (computed whole, see pipeline.padded_chunks), else None."""
    if keep is None or chunk.selected is not None:
        return None
    return keep[chunk.start:chunk.start + len(chunk.n_atoms)]


def nan_checked(path, chunks, names, where_present=False, keep=None):
    """The chunks, each given once checked: DataError naming the first of the fields `names`
    that holds NaN (with `where_present`, only in structures that have the field, see
    Chunk.present; only in those `keep` marks of a chunk computed whole, see whole_kept),
    with its count over all the chunks and the first structure."""
    bad = None  # [field, NaN count, first structure]
    for chunk in chunks:
        for name in names if bad is None else [bad[0]]:
            rows = nan_rows(chunk, name, where_present, keep)
            if rows is None:
                continue
            array = chunk.atoms.get(name, chunk.structures.get(name))
            if bad is None:
                first = int(np.argmax(rows))
                first = (chunk.structure_of(first) if name in chunk.atoms
                         else int(chunk.structure_numbers[first]))
                bad = [name, 0, first]
            if name == bad[0]:  # not another field's NaN in the same chunk
                bad[1] += int(np.count_nonzero(np.isnan(array[rows])))
        if bad is None:
            yield chunk
    if bad is not None:
        name, count, first = bad
        raise DataError(f"{path}: field '{name}' holds {count} NaN value(s), the first in "
                        f"structure {first}")


def check_integer_sum(job, chunk, kept=None):
    """DataError naming the first structure of the chunk (of those `kept` marks, None: all)
    whose exact sum of the integer field that `job` sums leaves the range of its result
    (int64, or uint64 for a uint64 field: see integer_result), where the ops would wrap.
    Exact: each value is split into its high and low 32 bits, whose sums over a structure
    (of fewer than 2**31 rows, as a chunk's int32 offsets hold) int64 holds, and the
    sum's high word, their carry included, must fit the result's."""
    if job.order or job.spec.name != "sum" or job.fields[0] not in job.integers:
        return
    filled = np.flatnonzero(chunk.n_atoms)
    if not len(filled):
        return
    name = job.fields[0]
    result = integer_result(job.infos[0].dtype)
    n_rows = int(chunk.n_atoms.sum())
    values = np.asarray(chunk.atoms[name])[:n_rows].reshape(n_rows, -1)
    values = values.view(np.uint64) if result == np.uint64 else values.astype(np.int64)
    high, low = (values >> 32).astype(np.int64), (values & 0xFFFFFFFF).astype(np.int64)
    starts = (np.cumsum(chunk.n_atoms) - chunk.n_atoms)[filled]
    top = np.add.reduceat(high, starts) + (np.add.reduceat(low, starts) >> 32)
    bound = 32 if result == np.uint64 else 31
    wrong = ((top < (0 if result == np.uint64 else -(1 << bound))) | (top >= 1 << bound)).any(1)
    for mask in (kept, job_present(chunk.present.get, job)):
        if mask is not None:
            wrong &= mask[filled]
    if wrong.any():
        first = int(chunk.structure_numbers[filled[np.argmax(wrong)]])
        raise DataError(f"{job.path}: the sum of field '{name}' over structure {first} does "
                        f"not fit in {result} (it would wrap around)")


def check_overflow(job, chunk, outputs, kept=None):
    """DataError naming the first structure (of at least one atom, holding the job's fields,
    and of those `kept` marks, None: all) whose per-structure float value is not finite though
    every value it reads is: a value past its dtype's range (the var of 1e308 and -1e308, a sum
    of 1e308s), refused rather than given as inf or NaN."""
    if job.order:
        return
    bad = np.zeros(len(chunk.n_atoms), bool)
    for label, array in outputs.items():
        per, _, dtype = job.outputs[label]
        if per == "structure" and dtype.kind == "f":
            bad |= ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
    bad &= chunk.n_atoms > 0
    for mask in (kept, job_present(chunk.present.get, job)):
        if mask is not None:
            bad &= mask
    if bad.any():
        bad &= _finite_inputs(job, chunk)
    if bad.any():
        first = int(np.argmax(bad))
        raise DataError(f"{job.path}: the {job.spec.name} of '{job.fields[0]}' over structure "
                        f"{int(chunk.structure_numbers[first])} overflows {job.precision} "
                        "(its values are finite, the result is not)")


def _finite_inputs(job, chunk):
    """(S_c,) bool: True for the chunk's structures whose values of every float field that
    `job` reads are finite."""
    finite = np.ones(len(chunk.n_atoms), bool)
    n_rows = int(chunk.n_atoms.sum())
    filled = chunk.n_atoms > 0
    starts = (np.cumsum(chunk.n_atoms) - chunk.n_atoms)[filled]
    for name in job.read:
        if name in chunk.atoms and n_rows:
            values = np.asarray(chunk.atoms[name])[:n_rows].reshape(n_rows, -1)
            if values.dtype.kind == "f":
                rows = np.isfinite(values).all(axis=1)
                finite[filled] &= np.logical_and.reduceat(rows, starts)
        elif name in chunk.structures:
            values = np.asarray(chunk.structures[name])
            if values.dtype.kind == "f":
                finite &= np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return finite


def blank_absent(job, chunk, outputs):
    """A job's outputs of a chunk with NaN in the rows of structures that lack a field the job
    reads (an integer output as float64, as a `partial` job declares it)."""
    have = job_present(chunk.present.get, job)
    if have is None:
        return outputs
    return blanked(outputs, {label: o[0] for label, o in job.outputs.items()}, have,
                   chunk.n_atoms)


def blanked(outputs, per, have, n_atoms):
    """`outputs` (label -> array of a chunk's rows, per structure or per atom as per[label]
    says; labels not in `per` as they are) with NaN in the rows of the structures where
    `have` is False (and of their atoms), an integer array as float64 (see nan_dtype)."""
    rows = {"structure": ~have, "atom": np.repeat(~have, n_atoms)}
    out = dict(outputs)
    for label, array in outputs.items():
        if label in per:
            out[label] = np.array(array, nan_dtype(array.dtype))
            out[label][rows[per[label]]] = np.nan
    return out


def inexact_in_float64(integers):
    """(rows,) bool: the rows of `integers` (rows, ...) holding a value that float64 does not
    hold exactly (as 2**53 + 1 or 2**64 - 1)."""
    flat = integers.reshape(len(integers), -1)
    wide = flat.astype(np.float64)
    inside = wide < float(np.iinfo(flat.dtype).max) + 1  # 2**63 rounds int64's max up to it
    return (~inside | (np.where(inside, wide, 0).astype(flat.dtype) != flat)).any(axis=1)


def check_float64(path, what, array, numbers):
    """DataError naming the first of the structures `numbers` (one a row of `array`) whose
    integer result `what` float64, the type of an integer result with NaN rows, does not hold
    exactly; nothing for a float `array`."""
    if array.dtype.kind not in "iu" or not array.size:
        return
    wrong = inexact_in_float64(array)
    if wrong.any():
        row = int(np.argmax(wrong))
        raise DataError(f"{path}: {what} in structure {int(numbers[row])} is "
                        f"{array[row].tolist()}, which a float64 result (NaN where a structure "
                        "has no value) does not hold exactly")


def singular(matrices):
    """(S,) bool: whether each of `matrices` (S, 3, 3) is singular as
    `np.linalg.matrix_rank(np.nan_to_num(matrices)) < 3` says. Divided by its largest entry
    (to within float64's rounding, far below what follows), a matrix has rank 3 when
    |det| > 1000 eps (float32's, the larger): its smallest singular value is at least
    |det| / 9, over 30 eps times its largest (at most 3), so far above matrix_rank's
    threshold of 3 eps times the largest. The others, zero matrices aside, are left to
    matrix_rank."""
    matrices = np.nan_to_num(matrices)
    flat = matrices.reshape(len(matrices), 9).astype(np.float64)
    largest = np.abs(flat).max(axis=1, initial=0)
    zero = largest == 0
    a = (flat / np.where(zero, 1, largest)[:, None]).reshape(-1, 3, 3)
    det = (a[:, 0, 0] * (a[:, 1, 1] * a[:, 2, 2] - a[:, 1, 2] * a[:, 2, 1])
           - a[:, 0, 1] * (a[:, 1, 0] * a[:, 2, 2] - a[:, 1, 2] * a[:, 2, 0])
           + a[:, 0, 2] * (a[:, 1, 0] * a[:, 2, 1] - a[:, 1, 1] * a[:, 2, 0]))
    out = zero.copy()
    unsettled = np.flatnonzero(~zero & ~(np.abs(det) > 1000 * np.finfo(np.float32).eps))
    out[unsettled] = np.linalg.matrix_rank(matrices[unsettled]) < 3
    return out
