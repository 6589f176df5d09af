"""Choosing structures: `--where 'NAME OP VALUE'` conditions on per-structure fields and
results, lists of structure numbers, and the structures (and leaves) that `--structures`,
`--shard` and `--where` select.

A condition holds for a structure when the structure has the field (see Batch.present) and
its value compares true. A NaN value never satisfies a comparison, not even `!=`;
`NAME == nan` holds exactly for the NaN values and `NAME != nan` for the others. VALUE is
rounded to the field's floating-point type before comparing (so `x <= 0.1` holds for a
float32 x printed as 0.1); integer and boolean fields compare exactly with VALUE's decimal
value (`n > 2.5` is `n >= 3`, and a VALUE beyond the dtype's range holds for all or none).
String fields compare with == and != only.
"""

import math
import operator
import re
from decimal import Decimal, InvalidOperation
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError

COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
           "==": operator.eq, "!=": operator.ne}
ORDERING = ("<", "<=", ">", ">=")
_WORD = r"[^\s<>=!\"']+"
_CONDITION = re.compile(
    rf"\s*(?P<name>{_WORD})\s*(?P<op><=|>=|==|!=|<|>)\s*"
    rf"(?:\"(?P<double>[^\"]*)\"|'(?P<single>[^']*)'|(?P<bare>{_WORD}))\s*")
_NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?|inf|infinity|nan)",
                     re.IGNORECASE | re.ASCII)
_LINE_NUMBER = re.compile(rb"-?[0-9]+")


class Condition(NamedTuple):
    """One `NAME OP VALUE`: `value` is VALUE's text (unquoted), `number` its exact value (a
    Decimal) when it is a bare number (else None)."""

    text: str
    name: str
    op: str
    value: str
    number: object

    def holds(self, values):
        """(S_c,) bool: which of a chunk's values satisfy the condition."""
        if values.dtype.kind in "OSU":
            equal = values == self.value
            return equal if self.op == "==" else ~equal
        if values.dtype.kind in "biu":
            return self._holds_exactly(values)
        nan = np.isnan(values)
        if self.number.is_nan():
            return nan if self.op == "==" else ~nan
        with np.errstate(over="ignore"):  # VALUE beyond float16 or float32 rounds to inf
            return COMPARE[self.op](values, float(self.number)) & ~nan

    def _holds_exactly(self, values):
        """holds() for integer or bool `values`, against VALUE's exact decimal value."""
        if values.dtype.kind == "b":
            values = values.view(np.uint8)
        limits, threshold = np.iinfo(values.dtype), self.number
        if threshold.is_nan():
            return np.full(len(values), self.op == "!=")
        if not limits.min <= threshold <= limits.max:  # every value is on one side
            return np.full(len(values), COMPARE[self.op](0, 1 if threshold > 0 else -1))
        whole = math.floor(threshold)
        op = self.op
        if whole != threshold:  # between whole and whole + 1: no value equals it
            if op in ("==", "!="):
                return np.full(len(values), op == "!=")
            op = {"<": "<=", ">=": ">"}.get(op, op)
        return COMPARE[op](values, values.dtype.type(whole))


def parse_condition(text):
    """A Condition from `NAME OP VALUE` (VALUE a number, or a bare or quoted string); ValueError
    naming the text when it is not one. Parsed by a regular expression, never evaluated."""
    match = _CONDITION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not NAME OP VALUE (OP one of < <= > >= == !=, VALUE a "
                         "number or a string)")
    name, op, bare = match["name"], match["op"], match["bare"]
    number = None
    if bare is not None and _NUMBER.fullmatch(bare):
        try:
            number = Decimal(bare)
        except InvalidOperation:  # an exponent of more than 18 digits
            raise ValueError(f"{text!r}: the exponent of {bare!r} is out of range") from None
    value = next(v for v in (match["double"], match["single"], bare) if v is not None)
    if op in ORDERING and number is None:
        raise ValueError(f"{text!r}: {op} compares numbers, and {value!r} is not one (strings "
                         "compare with == and !=)")
    if op in ORDERING and number.is_nan():
        raise ValueError(f"{text!r}: nothing is {op} nan (use {name} == nan or {name} != nan "
                         "to keep or drop NaN values)")
    return Condition(text, name, op, value, number)


def _check(path, condition, fields):
    """DataError unless `condition` can be evaluated on `fields` (name -> FieldInfo)."""
    info = fields.get(condition.name)
    where = f"{path}: --where '{condition.text}':"
    if condition.name in getattr(fields, "conflicts", {}):
        raise DataError(f"{where} {fields.conflicts[condition.name]}")
    if info is None:
        names = sorted(n for n, f in fields.items() if f.per == "structure" and not f.shape)
        raise DataError(f"{where} no field or result '{condition.name}'; the per-structure "
                        f"ones are: {', '.join(names) or '(none)'}")
    if info.per == "atom":
        raise DataError(f"{where} '{condition.name}' is per atom; reduce it to one value per "
                        f"structure first (e.g. segcli reduce {path} max_norm {condition.name} "
                        f"--in-place, then --where 'max_norm_{condition.name} ...')")
    if info.shape:
        raise DataError(f"{where} '{condition.name}' has shape {info.shape} per structure; "
                        "--where compares single values")
    if info.dtype.kind in "OSU" and condition.op in ORDERING:
        raise DataError(f"{where} '{condition.name}' holds strings; compare it with == or !=")
    if info.dtype.kind == "c" and condition.op in ORDERING:
        raise DataError(f"{where} '{condition.name}' is complex; compare it with == or !=")
    if info.dtype.kind not in "OSU" and condition.number is None:
        raise DataError(f"{where} '{condition.name}' holds numbers ({info.dtype}), and "
                        f"{condition.value!r} is not one")


def where_mask(batch, conditions, chunk_atoms=1_000_000, structures=slice(None)):
    """(S,) bool: the structures of `batch` (of the slice `structures`; False outside it) that
    have the named fields and where every condition holds, streamed in chunks of those
    fields."""
    fields = batch.fields
    for condition in conditions:
        _check(batch.path, condition, fields)
    start, stop, _ = structures.indices(batch.n_structures)
    keep = np.zeros(batch.n_structures, bool)
    keep[start:stop] = True
    names = [c.name for c in conditions]
    for chunk in batch.iter_chunks(names, chunk_atoms=chunk_atoms, structures=structures):
        rows = slice(chunk.start, chunk.start + len(chunk.n_atoms))
        for condition in conditions:
            keep[rows] &= condition.holds(chunk.structures[condition.name])
            keep[rows] &= chunk.present.get(condition.name, True)
    return keep


_LINE_BYTES = 1024
"""The longest line a list of structure numbers may have (a number and spaces)."""


def listed_mask(stream, source, n_structures):
    """(S,) bool: the structures listed in the binary `stream` (one structure number per line;
    blank lines skipped). A structure listed twice is taken once; DataError naming `source`,
    the line number and its text for a line that is not a structure number of the file, or
    that runs past _LINE_BYTES (so that /dev/zero is refused, not read without end)."""
    keep = np.zeros(n_structures, bool)
    lines = iter(lambda: stream.readline(_LINE_BYTES + 1), b"")
    for number, line in enumerate(lines, 1):
        if len(line) > _LINE_BYTES:
            raise DataError(f"{source}, line {number}: longer than {_LINE_BYTES} bytes, not a "
                            "structure number (one integer per line)")
        text = line.strip()
        if not text:
            continue
        shown = text.decode("utf-8", "replace")
        if not _LINE_NUMBER.fullmatch(text):
            raise DataError(f"{source}, line {number}: {shown!r} is not a structure number "
                            "(one integer per line)")
        index = int(text)
        if not 0 <= index < n_structures:
            held = f"0 to {n_structures - 1}" if n_structures else "none"
            raise DataError(f"{source}, line {number}: structure {shown} is out of range (the "
                            f"file has {n_structures} structures: {held})")
        keep[index] = True
    return keep
