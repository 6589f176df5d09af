"""The kernels' tables of variants: every kernel in one, the specific rows picked first, and
the native files each kernel's C is made of shipped with the package."""

import fnmatch
import json
import re
from pathlib import Path

import pytest

from segcli.ops import kernels
from segcli.ops.kernels import _c

ROOT = Path(__file__).parents[2]
HERE = ROOT / "segcli" / "ops" / "kernels"


def test_every_kernel_has_one_row_and_every_row_a_registered_kernel():
    rows = [row for table in kernels.TABLES.values() for row in table]
    named = [row.kernel.name for row in rows]
    assert sorted(named) == sorted(kernels.KERNELS)
    assert all(kernels.KERNELS[row.kernel.name] is row.kernel for row in rows)
    keys = [(row.op, row.step, row.device, row.ordering, row.size) for row in rows]
    assert len(set(keys)) == len(keys)


def test_pick_takes_the_first_row_that_matches_what_is_asked():
    def name(*args, **kwargs):
        return kernels.pick(*args, **kwargs).kernel.name

    assert name(kernels.GATHERS, "scale", device="cpu", ordering="offsets", size=3) == (
        "scale3_ordered")
    assert name(kernels.GATHERS, "scale", device="gpu", ordering="offsets", size=3) == "scale3"
    assert name(kernels.GATHERS, "scale", device="cpu", ordering="ids") == "scale"
    assert name(kernels.REDUCTIONS, "sum", device="cpu", size=3) == "sum3"
    assert name(kernels.REDUCTIONS, "sum", device="gpu", size=3) == "sum"
    assert name(kernels.SEARCHES, "max_norm", "ordered", device="gpu") == "max_norm_lanes"
    assert name(kernels.SEARCHES, "max", "ordered", device="cpu") == "max_cpu_ordered"
    assert name(kernels.GATHERS, "put", device="gpu", size=3, dtype="float64") == "put3"
    # put3 is made for float64 alone: float32 takes the next row that matches
    assert name(kernels.GATHERS, "put", device="gpu", size=3, dtype="float32") == "put"
    with pytest.raises(LookupError, match="segment_ids|ids"):
        kernels.pick(kernels.LAYOUT, "ids", device="gpu")


def test_a_native_body_is_its_files_after_the_dtype_and_its_constants():
    body = _c.body("fill_ids.h", dtype="float64", constants={"LOW": 0.1, "BITS": 3})
    lines = body.strip().splitlines()
    assert lines[:3] == ["typedef double real;", "    constexpr real LOW = 0x1.999999999999ap-4;",
                         "    constexpr int BITS = 3;"]
    assert body.endswith((HERE / "fill_ids.h").read_text())
    assert _c.c_literal(0.1, "float32") == "0x1.99999a0000000p-4f"


def test_every_native_file_is_used_and_ships_with_the_package():
    table = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    patterns = json.loads(re.search(r'^"segcli\.ops\.kernels" = (\[.*\])$', table, re.M)[1])
    files = sorted(p.name for p in HERE.iterdir() if p.suffix in (".h", ".cuh"))
    modules = "".join(p.read_text() for p in HERE.glob("*.py"))
    assert len(files) > 20
    assert [f for f in files if f'"{f}"' not in modules] == []
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []
