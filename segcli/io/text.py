"""Tables of numbers as text: CSV (a header line, then a line a row) or JSON lines (an object a
row), made a block of rows at a time with no Python loop over rows.

    out.write(header(shapes)); out.writelines(lines("csv", columns))

Every number is written as Python writes it, so it reads back exactly: a float64 as its repr
(the shortest text that reads back as it), a float32 as the repr of the float64 that its own
shortest text reads back as, an integer as an integer; in CSV NaN (no value: a structure that
lacks a field) as an empty cell and ±inf as `inf`, `-inf`, in JSON all three as `null` (it has
no such numbers): a JSON line is what json.dumps writes for the row's dict, its non-finite
numbers None (see finite_json). How: in C (`_text.c`, built at install, see segcli.native),
which finds each float's shortest round-trip digits itself and writes repr's notation, blocks
of rows made by the threads of segcli.threads side by side (the C lets go of Python's lock).
Where it was not built (or with SEGCLI_NATIVE_TEXT=0), the same bytes from orjson and
NumPy passes: orjson writes a block's numbers, one flat float64 array (a block holding an
integer of 2**53 or more, which float64 does not hold, goes by Python's repr of each number
instead), with the shortest round-trip digits; its text differs from repr only in
notation, fixed here: an integer's `12.0` loses `.0`; `null`, any non-finite value, becomes its
spelling; a one-digit negative exponent gets its zero (`1e-7`, |x| in [1e-9, 1e-5), becomes
`1e-07`) and |x| in [1e-5, 1e-4) goes from positional to scientific (`0.0000123` becomes
`1.23e-05`). The commas after the numbers become the format's separators (see _Layout).
"""

import csv
import ctypes
import functools
import io
import json
import math

import numpy as np
import orjson

from segcli import threads

_BLOCK_CELLS = 1 << 15
"""Numbers formatted at a time: the block's buffers stay in the CPU's caches, and a chunk's
results make blocks enough for every thread."""
_NATIVE_FLOATS = (np.dtype(np.float64), np.dtype(np.float32))
_EXACT = 2 ** 53
_SPELLING = {"csv": (b"", b"inf", b"-inf"), "json": (b"null", b"null", b"null")}
_MARKERS = bytes(b for b in range(256) if not 0x20 <= b <= 0x7f and b != 0x0a)
"""Bytes in no number and no separator (json.dumps escapes control characters and non-ASCII)."""
_TINY, _SMALL, _NOTATION = np.float64(1e-9), np.float64(1e-5), np.float64(1e-4)


def finite_json(value):
    """`value` (dicts, lists and tuples of numbers and strings) as strict JSON: the non-finite
    floats as null, not as the `NaN` and `Infinity` that json.dumps writes by default."""
    return json.dumps(_finite(value), allow_nan=False)


def _finite(value):
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def header(shapes):
    """The CSV header line of columns `shapes` (name -> trailing shape): NAME for a scalar,
    NAME_0, NAME_1, ... for a vector, NAME_0_0, NAME_0_1, ... for an array; a name holding a
    comma, quote or line break quoted as CSV quotes it."""
    names = [name if not shape else f"{name}_{'_'.join(map(str, i))}"
             for name, shape in shapes.items() for i in np.ndindex(*shape)]
    line = io.StringIO()
    csv.writer(line, lineterminator="\n").writerow(names)
    return line.getvalue().encode()


def lines(fmt, columns):
    """Yield the rows of `columns` (name -> integer or float array, rows first, at least one
    number a row) as `fmt` ("csv" or "json") text, blocks of whole lines (bytes-like)."""
    arrays = [_numbers(name, np.asarray(a)) for name, a in columns.items()]
    shapes = {name: a.shape[1:] for name, a in zip(columns, arrays)}
    literals = _csv_literals(shapes) if fmt == "csv" else _json_literals(shapes)
    rows = len(arrays[0])
    flat = [a.reshape(rows, int(np.prod(a.shape[1:]))) for a in arrays]
    is_int = np.concatenate([np.full(a.shape[1], a.dtype.kind in "iu") for a in flat])
    layout = _Layout(literals, is_int, _SPELLING[fmt])
    step = max(1, _BLOCK_CELLS // len(is_int))
    if _native_text() is not None:  # blocks made by the threads, side by side
        ints = [a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64, copy=False)
                for a in flat if a.dtype.kind in "iu"]
        floats = [_widened(a) if a.dtype in _NATIVE_FLOATS else _float64(a)
                  for a in flat if a.dtype.kind == "f"]
        kind = np.concatenate([np.full(a.shape[1], 3 if a.dtype == np.uint64 else 1
                                       if a.dtype.kind in "iu" else
                                       2 if a.dtype == np.float32 else 0, np.uint8)
                               for a in flat])
        yield from threads.ordered(
            functools.partial(layout.native_text, kind, _powers(),
                              _block(ints, lo, min(lo + step, rows), np.int64),
                              _block(floats, lo, min(lo + step, rows), np.float64))
            for lo in range(0, rows, step))
        return
    if any(a.dtype.kind in "iu" and a.size and not _exact_in_float64(a) for a in flat):
        yield from _python_text(literals, _SPELLING[fmt], flat, step)
        return
    flat = [_float64(a) for a in flat]
    for lo in range(0, rows, step):
        yield layout.text(np.concatenate([a[lo:lo + step] for a in flat], axis=1))


def _exact_in_float64(ints):
    """Whether every integer of `ints` is of magnitude below 2**53, so that float64 holds it
    exactly."""
    return bool(np.all((ints < _EXACT) & (ints > -_EXACT)))


def _python_text(literals, spelling, flat, step):
    """The rows of `flat` (each (rows, k)) as text, blocks of `step` rows, the same as the
    other ways make it, by Python's repr of each number (an integer as itself, a float as the
    float64 that _float64 gives): where float64 cannot carry some integer."""
    names = dict(zip(("nan", "inf", "-inf"), (word.decode() for word in spelling)))
    after = literals[1:]
    for lo in range(0, len(flat[0]), step):
        block = [a[lo:lo + step] for a in flat]
        cells = [a.tolist() if a.dtype.kind in "iu" else _float64(a).tolist() for a in block]
        lines = []
        for row in zip(*cells):
            numbers = [n for cell in row for n in cell]
            texts = [names.get(t, t) for t in map(repr, numbers)]
            lines.append(literals[0] + "".join(t + a for t, a in zip(texts, after)))
        yield "".join(lines).encode()


def _block(columns, lo, hi, dtype):
    """Rows lo to hi of `columns` (each (rows, k) of `dtype`) side by side, contiguous."""
    if not columns:
        return np.zeros((hi - lo, 0), dtype)
    if len(columns) == 1:
        return np.ascontiguousarray(columns[0][lo:hi])
    return np.ascontiguousarray(np.concatenate([a[lo:hi] for a in columns], axis=1))


def _numbers(name, array):
    """`array`, checked to be of numbers (floats or integers)."""
    if array.dtype.kind not in "iuf":
        raise TypeError(f"column {name!r}: {array.dtype} is not a number type")
    return array


def _float64(array):
    """`array` as float64; float32 values as the float64 that their shortest text reads back
    as (what repr of them then writes)."""
    if array.dtype.kind != "f" or array.dtype.itemsize == 8:
        return array.astype(np.float64, copy=False)
    out = _widened(array)
    finite = np.isfinite(array)
    text = orjson.dumps(np.ascontiguousarray(array[finite]), option=orjson.OPT_SERIALIZE_NUMPY)
    out[finite] = orjson.loads(text)
    return out


def _widened(array):
    """The floats `array` as float64, exactly (a signalling NaN a NaN, with no warning)."""
    with np.errstate(invalid="ignore"):
        return array.astype(np.float64, copy=False)


def _csv_literals(shapes):
    """The text before each number of a row, and after the last: "", ",", ..., "\\n"."""
    cells = sum(int(np.prod(shape)) for shape in shapes.values())
    return ["", *[","] * (cells - 1), "\n"]


def _json_literals(shapes):
    """The text before each number of a row, and after the last, that json.dumps would write
    around the numbers of the row's dict (key: number or nested list)."""
    literals = ["{"]
    for i, (name, shape) in enumerate(shapes.items()):
        literals[-1] += (", " if i else "") + json.dumps(name) + ": "
        if not all(shape):
            literals[-1] += json.dumps(np.zeros(shape).tolist())
            continue
        literals[-1] += "[" * len(shape)
        sizes = np.cumprod(shape[::-1])[::-1]  # elements per step of each axis
        for j in range(1, int(np.prod(shape))):
            closed = int((j % sizes == 0).sum())
            literals.append("]" * closed + ", " + "[" * closed)
        literals.append("]" * len(shape))
    literals[-1] += "}\n"
    return literals


class _Layout:
    """How a row's numbers (orjson's text of a flat float64 array of a block of rows) become
    its text. Where a number's text must change, the bytes there (the comma after it, an
    integer's `.0,`, a `null`, ...) take the new text in place, padded with bytes to delete
    when it is shorter, its head and a marker byte when it is longer; `bytes.replace` then
    expands each marker and deletes the padding (patterns of one byte: CPython replaces those
    fast)."""

    def __init__(self, literals, is_int, spelling):
        after = [*literals[1:-1], literals[-1] + literals[0]]  # the last: row end, next start
        kinds = {}  # (separator, bytes it replaces) -> the numbers of a row followed by it
        for k, (text, integer) in enumerate(zip(after, is_int)):
            kinds.setdefault((text.encode(), 3 if integer else 1), []).append(k)
        markers = iter(_MARKERS)
        self._delete = bytes([next(markers)])
        self._separators = [(k, *self._fill(text, room, markers))
                            for (text, room), k in kinds.items()]
        self._nonfinite = [self._fill(text, len(b"null"), markers) for text in spelling]
        self._exponent = self._fill(b"-0", 1, markers)  # "1e-7": "-" becomes "-0"
        self._start, self._cells = literals[0].encode(), len(is_int)
        texts = [text.encode() for text in [*after, literals[0]]] + list(spelling)
        self._literals = b"".join(texts)
        self._offsets = np.cumsum([0, *map(len, texts)], dtype=np.int64)

    def _fill(self, text, room, markers):
        """What `room` bytes take in place for `text` (with the next of `markers` if it is
        longer), and the replacements that finish it."""
        if len(text) <= room:
            fill = text + self._delete * (room - len(text))
            return np.frombuffer(fill, np.uint8), {self._delete: b""} if room > len(text) else {}
        marker = bytes([next(markers)])
        return np.frombuffer(text[:room - 1] + marker, np.uint8), {marker: text[room - 1:]}

    def native_text(self, kind, powers, ints, floats):
        """The text of the rows of `ints` ((rows, integers) int64) and `floats` ((rows,
        floats) float64), the cells of each row in the order `kind` gives (1: an integer, 0:
        a float64, 2: a float32 held in float64), made in C with the table _powers()."""
        rows = len(ints)
        room = 30 * floats.size + 20 * ints.size + (rows + 1) * len(self._literals) + 96
        out = bytearray(room)
        size = _native_text()(floats.ctypes.data, ints.ctypes.data, rows, self._cells,
                              kind.ctypes.data, self._literals, self._offsets.ctypes.data,
                              powers.ctypes.data, (ctypes.c_char * room).from_buffer(out),
                              room)
        if size < 0:  # room is a bound: not reached
            raise RuntimeError(f"segcli_text: {room} bytes are not room enough")
        return memoryview(out)[:size]

    def text(self, values):
        """The text of the rows `values` ((rows, numbers) float64), made by NumPy passes."""
        raw = orjson.dumps(values.ravel(), option=orjson.OPT_SERIALIZE_NUMPY)
        buf = np.frombuffer(bytearray(raw), np.uint8)
        ends = np.append(np.flatnonzero(buf == ord(",")), len(buf) - 1)  # after each number
        table = ends.reshape(len(values), self._cells)
        replace = {}
        for k, fill, finish in self._separators:
            _put(buf, table[:, k], fill)
            replace.update(finish)
        self._fix(buf, ends, values.ravel(), replace)
        body = buf[1:].tobytes()  # without the opening bracket
        for pattern, text in replace.items():
            body = body.replace(pattern, text)
        return b"".join((self._start, memoryview(body)[:len(body) - len(self._start)]))

    def _fix(self, buf, ends, values, replace):
        """Rewrite in place, or mark, the numbers whose orjson text is not their repr, adding
        the replacements that finish them to `replace`."""
        magnitude = np.abs(values)
        odd = np.flatnonzero(~(magnitude < np.inf) | ((magnitude < _NOTATION)
                                                     & (magnitude >= _TINY)))
        if not len(odd):
            return
        value, end = values[odd], ends[odd]
        start = np.where(odd > 0, ends[odd - 1], 0) + 1  # the first character of each
        for (fill, finish), which in zip(self._nonfinite, (np.isnan(value), value == np.inf,
                                                           value == -np.inf)):
            if which.any():  # "null"
                _put(buf, start[which] + 3, fill)
                replace.update(finish)
        exponent = np.abs(value) < _SMALL
        if exponent.any():  # "1e-7"
            _put(buf, end[exponent] - 2, self._exponent[0])
            replace.update(self._exponent[1])
        positional = (np.abs(value) >= _SMALL) & (np.abs(value) < _NOTATION)
        if positional.any():  # "0.0000123"
            _scientific(buf, start[positional] + (value[positional] < 0), end[positional],
                        self._delete[0])
            replace[self._delete] = b""


@functools.cache
def _native_text():
    """segcli_text of `_text.c`, loaded; None where it was not built (see segcli.native) or
    with SEGCLI_NATIVE_TEXT=0."""
    from segcli.native import TEXT, library

    lib = library(TEXT)
    if lib is None:
        return None
    function = lib.segcli_text
    function.restype = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_int64]
    return function


@functools.cache
def _powers():
    """The powers of ten of `_text.c`'s to_decimal, exact: for k from -324 to 292, g = floor(β)
    + 1 where 10**-k = β 2**r and 2**125 <= β < 2**126, as (g >> 63, g mod 2**63)."""
    table = np.empty((617, 2), np.uint64)
    for i, k in enumerate(range(-324, 293)):
        if k <= 0:
            power = 10 ** -k
            shift = power.bit_length() - 126
            beta = power >> shift if shift >= 0 else power << -shift
        else:  # 2**s / 10**k, 10**k no power of two: in (2**125, 2**126)
            beta = (1 << (125 + (10 ** k).bit_length())) // 10 ** k
        g = beta + 1
        table[i] = g >> 63, g & (2 ** 63 - 1)
    return table


def _put(buf, last, fill):
    """Write `fill` into `buf` so that it ends at each position of `last`."""
    for i, byte in enumerate(fill[::-1]):
        buf[last - i] = byte


def _scientific(buf, start, end, delete):
    """Rewrite in place each `0.0000D...` in buf[start:end] (a number in [1e-5, 1e-4)) as its
    scientific notation `D.…e-05`, padded to the same length with `delete` bytes."""
    width = 24  # longer than any: 6 + 17 digits
    j = np.arange(width)
    digits = buf[np.minimum(start[:, None] + 6 + j, len(buf) - 1)]  # the significant digits
    more = (end - start - 7)[:, None]  # digits after the first
    out = np.full((len(start), width), delete, np.uint8)
    out[:, :1] = digits[:, :1]
    out[:, 1:2] = np.where(more > 0, ord("."), delete)
    mantissa = (j >= 2) & (j < more + 2)
    out[mantissa] = digits[:, np.maximum(j - 1, 0)][mantissa]
    exponent = j - np.where(more > 0, more + 2, 1)
    fits = (exponent >= 0) & (exponent < 4)
    out[fits] = np.frombuffer(b"e-05", np.uint8)[exponent[fits]]
    inside = j < (end - start)[:, None]
    buf[(start[:, None] + j)[inside]] = out[inside]
