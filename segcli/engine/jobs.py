"""What a run computes: a Job per op over the fields of a file (`plan`), checked against
them, with the dtypes its fields are read in and its outputs' (NaN rows included).

    job = plan("f.h5", OPS["rms_norm"], ["forces"], batch.fields)
    job.read, job.outputs  # ("forces",), {"": ("structure", (), dtype('float64'))}
"""

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError
from segcli.fields import unknown_field
from segcli.registry import Arg, Op

PRECISIONS = ("float32", "float64")


def _describe(info):
    return Arg(info.per, tuple(info.shape)).describe()


def _field(path, name, wanted, fields, needs_float, role):
    """The FieldInfo of `name`, or DataError unless it exists and fits `wanted` (an Arg) as
    `role` ("rms_norm", "dot's second field", "--weights") needs."""
    if name not in fields:
        raise unknown_field(path, name, fields)
    info = fields[name]
    if info.per != wanted.per:
        raise DataError(f"{path}: field '{name}' is per {info.per} {_describe(info)}, but {role} "
                        f"must be per {wanted.per} {wanted.describe()}")
    if wanted.shape is not None and tuple(info.shape) != wanted.shape:
        raise DataError(f"{path}: field '{name}' has shape {_describe(info)}, but {role} must "
                        f"be {wanted.describe()}")
    kinds, what = (("iu", "integer labels") if wanted.kind == "labels"
                   else ("f", "floating-point to be differentiated") if needs_float
                   else ("biuf", "real numbers"))
    if info.dtype.kind not in kinds:
        from segcli.fields import held

        raise DataError(f"{path}: field '{name}' holds {held(info.dtype)}, but {role} must be "
                        f"{what}")
    return info


@dataclass(frozen=True)
class Job:
    """One op (a registry.Op) over named fields of one file, checked against its fields (see
    `plan`), with its static `params` (all of the op's).

    order 0: the op's value; 1: the gradient of Σ_s w_s · OP(...)_s (summed over every entry of
    each structure's result) with respect to each distinct per-atom input field; 2: that
    gradient's derivative along `direction` (a Hessian-vector product), the direction being
    applied to every per-atom input field at once.

    `partial`: some structures lack a field the job reads (see `job_present`); their rows of
    every output are NaN (see `engine.run`), an integer output therefore float64.
    """

    path: str
    spec: Op
    fields: tuple
    infos: tuple
    precision: str = "float64"
    order: int = 0
    weights: str | None = None
    direction: str | None = None
    params: dict = field(default_factory=dict, hash=False)
    partial: bool = False

    @property
    def wrt(self):
        """The distinct per-atom input fields, in order: what gradients are taken against."""
        return tuple(dict.fromkeys(n for n, i in zip(self.fields, self.infos) if i.per == "atom"))

    @property
    def read(self):
        """Every field the job reads: the inputs, then the weights and the direction."""
        return tuple(dict.fromkeys((*self.fields, *filter(None, (self.weights, self.direction)))))

    @property
    def shows_nan(self):
        """Whether a NaN in a per-atom input makes its structure's value NaN (see
        shows_nan)."""
        return shows_nan(self.spec, self.order)

    @property
    def integers(self):
        """The integer input fields the op reduces as integers (its `integers`, or labels),
        which are therefore read as integers (see field_dtypes), not cast to the precision."""
        return tuple(name for name, info, wanted in zip(self.fields, self.infos, self.spec.inputs)
                     if info.dtype.kind in "iu" and (self.spec.integers or wanted.kind == "labels"))

    @property
    def outputs(self):
        """label -> (per, trailing shape, dtype) of what each chunk gives: "" for the op's value,
        "d_FIELD" for the derivative with respect to FIELD."""
        dtype = np.dtype(self.precision)
        if self.order:
            shapes = dict(zip(self.fields, (i.shape for i in self.infos)))
            return {f"d_{name}": ("atom", tuple(shapes[name]), dtype) for name in self.wrt}
        spec = self.spec
        shape = spec.trailing_shape(self.infos[0].shape if self.infos else (), self.params)
        kept = bool(self.fields) and self.fields[0] in self.integers
        dtype = {"float": dtype, "count": np.dtype(np.int64),
                 "input": integer_result(self.infos[0].dtype) if kept else dtype
                 }[spec.output_dtype]
        if self.partial:
            dtype = nan_dtype(dtype)
        return {"": (spec.output_per, shape, dtype)}

    def program(self, read):
        """The job as static data for `program._compiled`, its fields given as indices into `read`
        (the fields of a pass)."""
        where = {name: read.index(name) for name in self.read}
        return _Program(self.spec, tuple(sorted(self.params.items())),
                        tuple(where[n] for n in self.fields),
                        tuple(n in self.integers for n in self.fields), self.precision,
                        self.order, tuple(where[n] for n in self.wrt), where.get(self.weights),
                        where.get(self.direction))


def integer_result(stored):
    """The dtype an integer field stored as `stored` is reduced in and given as: uint64 as
    itself, any other in int64 (which holds every value of them)."""
    return np.dtype(np.uint64 if stored == np.uint64 else np.int64)


def shows_nan(op, order):
    """Whether a NaN in a per-atom input makes its structure's result NaN: so for the value
    (order 0) of every op with a result per structure (tests/engine/test_engine.py checks
    each), whose inputs the engine then looks into for NaN only where a value is NaN (see
    shown_nan)."""
    return order == 0 and op.output_per == "structure"


class _Program(NamedTuple):
    """A job as static data: its op and params, its inputs (indices into the values of a
    pass), which of them stay integers (the others are cast to `precision`), its order, the
    inputs it differentiates against, its weights and its direction (indices or None)."""

    op: Op
    params: tuple
    inputs: tuple
    integers: tuple
    precision: str
    order: int
    wrt: tuple
    weights: int | None
    direction: int | None


def reads(jobs):
    """Every field some job of `jobs` reads, once each, in order."""
    return tuple(dict.fromkeys(name for job in jobs for name in job.read))


def field_dtypes(jobs):
    """name -> the dtype every field some job of `jobs` reads is padded in: for the integer
    fields a job reduces as integers (see Job.integers), int32 where the file stores int32 and
    every such job takes the field as labels (read as stored: the kernels count int32 labels
    as they are), else as integer_result says; the other fields in the jobs' precision."""
    stored, counted = {}, set()
    for job in jobs:
        for name, info, wanted in zip(job.fields, job.infos, job.spec.inputs):
            if name in job.integers:
                stored[name] = info.dtype
                if wanted.kind != "labels":
                    counted.add(name)
    as_stored = {name for name, dtype in stored.items()
                 if name not in counted and dtype == np.int32}
    precision = _precision(jobs)
    return {name: np.dtype(np.int32) if name in as_stored else integer_result(stored[name])
            if name in stored else np.dtype(precision) for name in reads(jobs)}


def plan(path, spec, names, fields, *, precision="float64", order=0, weights=None,
         direction=None, params=None, present=None):
    """A Job running `spec` (a registry.Op) on the fields `names` (one per input) of a file
    whose fields are `fields` (name -> FieldInfo), with `params` overriding the op's static
    params (those it lacks are ignored); DataError naming the file and field when one does not
    fit. `present(name)` (Batch.present) says which structures have a field: the job is
    `partial` when some lack one it reads."""
    names = tuple(names)
    if len(names) != len(spec.inputs):
        raise ValueError(f"{spec.name} takes {len(spec.inputs)} field(s), got {len(names)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    roles = [spec.name] if len(names) == 1 else [f"{spec.name}'s {n} field"
                                                   for n in ("first", "second")]
    infos = tuple(_field(path, name, wanted, fields, order > 0 and wanted.per == "atom", role)
                  for name, wanted, role in zip(names, spec.inputs, roles))
    shared = [(name, info) for name, info, wanted in zip(names, infos, spec.inputs)
              if wanted.shape is None]  # these share one trailing shape *F
    if any(info.shape != shared[0][1].shape for _, info in shared):
        (a, first), (b, second) = shared[:2]
        raise DataError(f"{path}: {spec.name} needs fields of the same shape, but "
                        f"'{a}' is {_describe(first)} and '{b}' is {_describe(second)}")
    params = {**spec.params, **{k: v for k, v in (params or {}).items() if k in spec.params}}
    job = Job(path, spec, names, infos, precision, order, weights, direction, params)
    if weights is not None:
        _field(path, weights, Arg("structure", ()), fields, False, "--weights")
    if direction is not None:
        shape = tuple(fields[job.wrt[0]].shape)
        _field(path, direction, Arg("atom", shape), fields, False,
               f"--direction (the shape of '{job.wrt[0]}')")
    if present is not None and any(present(name) is not None for name in job.read):
        job = dataclasses.replace(job, partial=True)
    return job


def _precision(jobs):
    """The one precision of the jobs of a pass."""
    precisions = {job.precision for job in jobs}
    if len(precisions) != 1:
        raise ValueError(f"the jobs of one pass need one precision, got {sorted(precisions)}")
    return precisions.pop()


def nan_dtype(dtype):
    """`dtype`, or float64 where it is an integer or bool dtype: one whose rows can be NaN."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float64) if dtype.kind in "biu" else dtype


def job_present(have, job):
    """(S,) bool, True where a structure has every field `job` reads, given `have(name)`
    (Batch.present, or a Chunk's present.get); None where all do."""
    from segcli.fields import all_of

    return all_of([have(name) for name in job.read])


def whole_selection(jobs, keep):
    """`keep` where the jobs may compute chunks whole and leave out the results of the
    structures it does not mark (every output per structure, so leaving them out copies
    little), else None."""
    if keep is None or any(per != "structure" for job in jobs
                           for per, _, _ in job.outputs.values()):
        return None
    return keep


def shown_nan(jobs, fields):
    """The per-atom fields (fields: name -> FieldInfo) whose NaN the values of the jobs that
    read them show (Job.shows_nan), every job that reads them: the host looks for NaN in them
    only once a value is NaN (see engine._finished), not in every chunk as it reads it."""
    readers = {}
    for job in jobs:
        for name in job.read:
            readers.setdefault(name, []).append(job)
    return {name for name, some in readers.items()
            if fields[name].per == "atom" and all(job.shows_nan for job in some)}
