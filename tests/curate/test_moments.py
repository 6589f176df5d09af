"""The moments kernel of `segcli stats` (segcli/_moments.c) against NumPy float64 on random
rows: every dtype a field may have, scalars, 3-vectors, wide rows, leaves of 0 rows to many
blocks, up to 256 groups, ties and zero rows; the same bits from its AVX2 clone and its plain
build; and `segcli stats` without it."""

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from batch_reference import write_batch

from segcli import native
from segcli.curate import statistics as stats
from segcli.curate.statistics import MOMENT_NAMES, Moments

SOURCE = Path(native.__file__).with_name("_moments.c")

pytestmark = pytest.mark.skipif(stats._native_moments() is None,
                                reason="no C compiler: stats take the NumPy path")


def native_moments(rows, with_norm, runs, labels=None, n_groups=1):
    """The kernel's moments (L, G, K) of `rows` in leaves of `runs` rows and groups `labels`."""
    rows = stats.as_rows(rows)
    out = Moments.empty(n_groups, rows.shape[1] + with_norm, leaves=len(runs))
    stats._native_moments()(rows, with_norm, np.asarray(runs, np.int64), labels, out,
                            stats._Buffers())
    return out


def reference(rows, with_norm, runs, labels=None, n_groups=1):
    """The same in NumPy float64: each (leaf, group) of rows on its own."""
    columns = stats.as_rows(rows).astype(np.float64)
    if with_norm:
        columns = np.column_stack([columns, np.linalg.norm(columns, axis=1)])
    labels = np.zeros(len(columns), np.int64) if labels is None else labels
    out = Moments.empty(n_groups, columns.shape[1], leaves=len(runs))
    for leaf, (a, b) in enumerate(zip(np.cumsum(runs) - runs, np.cumsum(runs))):
        for g in range(n_groups):
            values = columns[a:b][labels[a:b] == g]
            if len(values):
                out.count[leaf, g] = len(values)
                out.mean[leaf, g] = values.mean(axis=0)
                out.m2[leaf, g] = ((values - values.mean(axis=0)) ** 2).sum(axis=0)
                out.min[leaf, g], out.max[leaf, g] = values.min(axis=0), values.max(axis=0)
    return out


def assert_moments_close(got, wanted, scale, with_norm=True):
    """Counts, and the components' min and max, exactly; the norms' (summed in another order
    by NumPy) to 1e-14; means and M2 to 1e-12 and 1e-11 of NumPy's."""
    np.testing.assert_array_equal(got.count, wanted.count)
    exact = slice(None, -1 if with_norm else None)
    for key in ("min", "max"):
        a, b = getattr(got, key), getattr(wanted, key)
        np.testing.assert_array_equal(a[..., exact], b[..., exact], err_msg=key)
        np.testing.assert_allclose(a, b, rtol=1e-14, err_msg=key)
    np.testing.assert_allclose(got.mean, wanted.mean, rtol=1e-12, atol=1e-13 * scale)
    np.testing.assert_allclose(got.m2, wanted.m2, rtol=1e-11, atol=1e-13 * scale ** 2)


RUNS = [0, 1, 2, 3, 0, 7, 4096, 4097, 9001, 1]
"""Rows per leaf: empty leaves, single rows, odd and even runs, one block and a row more, many
blocks (NATIVE_BLOCK_ROWS is 4096)."""


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.int64, np.bool_])
@pytest.mark.parametrize("shape", [(), (3,), (1,), (2, 3), (7,)])
def test_moments_match_numpy_float64(dtype, shape):
    rng = np.random.default_rng()
    n = sum(RUNS)
    rows = rng.normal(0.5, 2.0, (n, *shape))
    rows = (rows > 0 if dtype is np.bool_ else rows * (1 if dtype in (np.float64, np.float32)
                                                       else 100)).astype(dtype)
    with_norm = bool(shape)
    assert_moments_close(native_moments(rows, with_norm, RUNS),
                         reference(rows, with_norm, RUNS), scale=200, with_norm=with_norm)


@pytest.mark.parametrize("n_groups", [1, 3, 119, 256])
def test_groups_in_any_order_and_groups_without_rows(n_groups):
    rng = np.random.default_rng()
    n = sum(RUNS)
    rows = rng.normal(-1.0, 3.0, (n, 3))
    labels = rng.choice(np.arange(0, n_groups, 2), n).astype(np.uint8)  # odd groups empty
    labels[RUNS[0] + RUNS[1]:][:4096] = n_groups - 1  # a run of one group
    got = native_moments(rows, True, RUNS, labels, n_groups)
    assert_moments_close(got, reference(rows, True, RUNS, labels, n_groups), scale=10)
    empty = Moments.empty(n_groups, 4, leaves=len(RUNS))
    for key in MOMENT_NAMES:  # groups and leaves without rows keep the moments of no rows
        value = getattr(got, key)
        np.testing.assert_array_equal(value[got.count == 0], getattr(empty, key)[got.count == 0])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.uint32, np.int64])
def test_labels_of_any_integer_width_and_labels_that_are_no_group(dtype):
    """Labels as a file stores atomic numbers, of any integer width: the bits of uint8 labels;
    one that is no group (G or more, or negative) makes the moments say so, wherever it is."""
    rng = np.random.default_rng()
    n, n_groups = sum(RUNS), 119
    rows = rng.normal(-1.0, 3.0, (n, 3))
    labels = rng.integers(0, n_groups, n).astype(np.uint8)
    got = native_moments(rows, True, RUNS, labels.astype(dtype), n_groups)
    wanted = native_moments(rows, True, RUNS, labels, n_groups)
    for key in MOMENT_NAMES:
        np.testing.assert_array_equal(getattr(got, key), getattr(wanted, key), err_msg=key)
    assert_moments_close(got, reference(rows, True, RUNS, labels, n_groups), scale=10)
    kernel = stats._native_moments()
    for bad in [n_groups, np.iinfo(dtype).max] + ([-1] if np.iinfo(dtype).min < 0 else []):
        for row in (0, n // 2, n - 1):
            wrong = labels.astype(dtype)
            wrong[row] = bad
            out = Moments.empty(n_groups, 4, leaves=len(RUNS))
            assert not kernel(stats.as_rows(rows), True, np.asarray(RUNS, np.int64), wrong, out,
                              stats._Buffers()), (bad, row)


def test_ties_zero_rows_and_a_constant_leaf():
    rows = np.zeros((5000, 3))
    rows[::2] = [1.5, -2.0, 0.0]  # two rows, each repeated: every component tied
    runs = [4999, 1]
    got = native_moments(rows, True, runs)
    assert_moments_close(got, reference(rows, True, runs), scale=3)
    np.testing.assert_array_equal(got.m2[1], 0.0)  # a leaf of one row
    np.testing.assert_array_equal(got.min[0, 0], [0.0, -2.0, 0.0, 0.0])
    np.testing.assert_array_equal(got.max[0, 0], [1.5, 0.0, 0.0, 2.5])


def test_wide_rows_take_blocks_of_fewer_rows():
    """A row of 20 000 values: blocks of 3 rows (65 536 values at most), merged."""
    rng = np.random.default_rng()
    rows = rng.normal(4.0, 1.0, (23, 20000))
    runs = [10, 13]
    assert_moments_close(native_moments(rows, True, runs), reference(rows, True, runs),
                         scale=600)


def build(tmp_path, *defines):
    """_moments.c built into tmp_path with `defines`, loaded."""
    path = tmp_path / f"moments{len(defines)}.so"
    subprocess.run([os.environ.get("CC", "cc"), *native.MOMENTS.flags, *defines, "-shared", "-fPIC",
                    str(SOURCE), "-o", str(path), "-lm"], check=True)
    return stats.moments_library(ctypes.CDLL(str(path)))


def call(lib, rows, runs, labels, n_groups):
    out = Moments.empty(n_groups, rows.shape[1] + 1, leaves=len(runs))
    scratch = np.empty(lib.segcli_moments_scratch(4096, n_groups, rows.shape[1] + 1) // 8)
    lib.segcli_moments(rows.ctypes.data, 0, rows.shape[1], 1, runs.ctypes.data, len(runs),
                       None if labels is None else labels.ctypes.data,
                       0 if labels is None else labels.itemsize, n_groups, 4096,
                       *(getattr(out, key).ctypes.data for key in MOMENT_NAMES),
                       scratch.ctypes.data)
    return out


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 clone is x86-64's")
def test_the_avx2_clone_and_the_plain_build_give_the_same_bits(tmp_path):
    """The library as built (its AVX2 clone where the CPU has AVX2) and a build without
    clones (SSE2 only): bit for bit."""
    with open("/proc/cpuinfo") as f:
        if " avx2" not in f.read():
            pytest.skip("this CPU has no AVX2: only the plain clone runs")
    rng = np.random.default_rng()
    rows = rng.normal(0.5, 2.0, (sum(RUNS), 3))
    runs = np.array(RUNS, np.int64)
    labels = rng.integers(0, 8, len(rows)).astype(np.uint8)
    cloned, plain = build(tmp_path), build(tmp_path, "-DSEGCLI_NO_CLONES", "-mno-avx")
    for group_labels, n_groups in ((None, 1), (labels, 8)):
        a, b = (call(lib, rows, runs, group_labels, n_groups) for lib in (cloned, plain))
        for key in MOMENT_NAMES:
            np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)


def test_without_the_kernel_stats_take_the_numpy_path(tmp_path):
    """`segcli stats` with the kernel built with the package, and without it
    (SEGCLI_NATIVE_STATS=0), with a compiler that fails and an empty cache: its NumPy twin's
    values (the kernel's bits), and nothing built either way."""
    rng = np.random.default_rng()
    n_atoms = rng.integers(1, 20, 300)
    forces = rng.normal(0.3, 1.0, (int(n_atoms.sum()), 3))
    numbers = rng.choice([1, 6, 8], len(forces))
    path = write_batch(tmp_path / "f.h5", n_atoms, {"forces": forces, "numbers": numbers})
    command = [sys.executable, "-m", "segcli", "stats", str(path), "forces", "--per-element",
               "--json"]
    outputs = {}
    for case, env in (("C", {}), ("NumPy", {"SEGCLI_NATIVE_STATS": "0"})):
        cache = tmp_path / case
        result = subprocess.run(command, capture_output=True, text=True,
                                env={**os.environ, **env, "CC": "false",
                                     "XDG_CACHE_HOME": str(cache)})
        assert result.returncode == 0, result.stderr
        outputs[case] = json.loads(result.stdout)["stats"]
        assert not any(cache.rglob("*.so"))
    for ours, theirs in zip(outputs["C"], outputs["NumPy"], strict=True):
        for key, value in ours.items():
            assert theirs[key] == (pytest.approx(value, rel=1e-12, abs=1e-13)
                                   if isinstance(value, float) else value), key
    assert outputs["C"] == outputs["NumPy"]


def test_threads_sharing_a_chunk_give_its_bits(monkeypatch):
    """A chunk's leaves split among 3 threads (parts of whole leaves): the bits of one."""
    from segcli import threads

    rng = np.random.default_rng()
    rows = rng.normal(0.5, 2.0, (sum(RUNS), 3))
    labels = rng.integers(0, 5, len(rows)).astype(np.uint8)
    alone = native_moments(rows, True, RUNS, labels, 5)
    monkeypatch.setattr(stats, "PART_ROWS", 3)
    threads.set_count(4)  # 3 parts, a core left to the reading thread
    try:
        shared = native_moments(rows, True, RUNS, labels, 5)
    finally:
        threads.set_count(None)
    for key in MOMENT_NAMES:
        np.testing.assert_array_equal(getattr(shared, key), getattr(alone, key), err_msg=key)
