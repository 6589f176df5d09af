"""segcli's C parts: plain shared libraries built with the package and loaded with ctypes.

Each part is compiled when segcli is installed (setup.py builds every Part of PARTS, each
optional), never at run time. A part that was not built (no C compiler at install) leaves
its caller to its fallback, which gives the same bits, more slowly; one line on stderr says
so, once a process. A part's switch set to 0 (`SEGCLI_NATIVE_STATS=0`) takes the fallback
too, silently. Only the standard library is imported here: setup.py reads PARTS from this
file.

    lib = library(MOMENTS)  # a ctypes.CDLL, or None: take the fallback
"""

import ctypes
import os
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple


class Part(NamedTuple):
    """A C part: its module name (`segcli._moments`, from `segcli/_moments.c`), compiler flags
    and libraries, the environment variable that turns it off, what it is and what its
    fallback does."""

    name: str
    flags: tuple
    libraries: tuple
    switch: str
    what: str
    fallback: str

    @property
    def source(self):
        """The C source, relative to the project's root."""
        return self.name.replace(".", "/") + ".c"

    @property
    def path(self):
        """Where the built library lies (beside its source, named as Python names a built
        extension module, for this interpreter and platform)."""
        return (Path(__file__).parent.parent
                / (self.name.replace(".", "/") + sysconfig.get_config_var("EXT_SUFFIX")))


MOMENTS = Part("segcli._moments", ("-O3", "-fno-math-errno", "-ffp-contract=off"), ("m",),
               "SEGCLI_NATIVE_STATS", "C moments",
               "statistics take their NumPy twin (the same bits, slower)")
"""The moments of `segcli stats`: no operation fused (the same bits on every machine), `sqrt`
inlined."""
ROWS = Part("segcli.io._rows", ("-O2",), (), "SEGCLI_NATIVE_ROWS", "C row copies",
            "selections copy rows by NumPy's indexing (the same rows, slower)")
TEXT = Part("segcli.io._text", ("-O2",), ("m",), "SEGCLI_NATIVE_TEXT", "C text writer",
            "CSV and JSON lines are made by orjson and NumPy passes (the same bytes, slower)")
LAUNCH = Part("segcli.ops._launch", ("-O2",), ("pthread",), "SEGCLI_NATIVE_LAUNCH",
              "C launch handler",
              "Warp kernels launch through Warp's jax_kernel, a Python call each (slower)")
PARTS = (MOMENTS, ROWS, TEXT, LAUNCH)

_announced = set()


class Unavailable(Exception):
    """Why a C part cannot be had."""


def load(part):
    """`part`'s library as built with the package, loaded; Unavailable saying why where its
    switch is 0 or it was not built (the latter said once on stderr, with its fallback)."""
    if os.environ.get(part.switch, "1") == "0":
        raise Unavailable(f"{part.switch}=0")
    try:
        return ctypes.CDLL(str(part.path))
    except OSError as err:
        announce(part, "not built at install: no C compiler?")
        raise Unavailable(f"{part.path.name} was not built with segcli: {err}") from None


def announce(part, why):
    """One line on stderr, once a process for each part: segcli runs without `part`, `why`,
    and what its fallback does."""
    if part.name not in _announced:
        _announced.add(part.name)
        print(f"segcli: note: running without its {part.what} ({why}); {part.fallback}",
              file=sys.stderr)


def library(part):
    """`part`'s library (see load), or None where it cannot be had."""
    try:
        return load(part)
    except Unavailable:
        return None
