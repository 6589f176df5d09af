"""The bodies of the kernels' native functions, from the C++ (.h) and CUDA (.cuh) files beside
this module: each file is a part of a function's body, and a body is its files in order after
a typedef of `real`, the dtype's C type, and the constants it is given."""

import functools
from pathlib import Path

import numpy as np

_HERE = Path(__file__).parent
_C_TYPES = {"float32": "float", "float64": "double", "int32": "wp::int32", "int64": "wp::int64"}


@functools.cache
def _text(name):
    return (_HERE / name).read_text()


def c_literal(value, dtype):
    """`value` rounded to `dtype` ("float32" or "float64") as an exact C literal.

    >>> c_literal(0.1, "float32")
    '0x1.99999a0000000p-4f'
    """
    return float(np.dtype(dtype).type(value)).hex() + ("f" if dtype == "float32" else "")


def body(*files, dtype=None, constants=None, end=""):
    """The body of a native function: `typedef <C type of dtype> real;`, each of `constants` as
    a constexpr (a float as an exact literal of `real`, an int as an int), the files' text in
    order, then `end`.

    >>> print(body("fill_ids.h").splitlines()[-1])
        for (int i = lo; i < hi; i++) p[i] = id;
    """
    lines = [] if dtype is None else [f"typedef {_C_TYPES[dtype]} real;"]
    for name, value in (constants or {}).items():
        lines.append(f"constexpr real {name} = {c_literal(value, dtype)};"
                     if isinstance(value, float) else f"constexpr int {name} = {int(value)};")
    return "".join(f"\n    {line}" for line in lines) + "\n" + "".join(map(_text, files)) + end
