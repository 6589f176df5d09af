"""No compiler at run time: segcli's C parts are those built with the package (setup.py), none
is compiled by a command, and where one is missing its fallback gives the same bits and says
so once on stderr."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli import cache_directory, moments_twin, native
from segcli.cli import main
from segcli.curate import statistics as stats

COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "clang++", "ld")
"""The names a compiler is run by: traps on the PATH of a test, each logging its call."""


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A PATH of compiler traps only (each logs its call and fails), CC one of them, and an
    empty cache (Warp's kept where it was); after the test, no trap ran and nothing is in
    segcli's cache."""
    traps, log = tmp_path / "bin", tmp_path / "compilers.log"
    traps.mkdir()
    for name in COMPILERS:
        (traps / name).write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\nexit 1\n')
        (traps / name).chmod(0o755)
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    monkeypatch.setenv("WARP_CACHE_PATH", os.environ.get("WARP_CACHE_PATH")
                       or os.path.join(home, "warp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(traps))
    monkeypatch.setenv("CC", str(traps / "cc"))
    yield
    assert not log.exists(), log.read_text()
    assert not any(Path(cache_directory()).rglob("*.so"))


@pytest.fixture
def batch(tmp_path):
    """Forces with ±0 components and atomic numbers, in structures of 0 to 40 atoms."""
    rng = np.random.default_rng(7)
    n_atoms = rng.integers(0, 40, 120)
    forces = rng.normal(0.3, 1.0, (int(n_atoms.sum()), 3))
    forces[rng.random(forces.shape) < 0.1] = 0.0
    forces[rng.random(forces.shape) < 0.1] = -0.0
    numbers = rng.choice([1, 6, 8, 26], len(forces))
    return write_batch(tmp_path / "f.h5", n_atoms, {"forces": forces, "numbers": numbers},
                       {"energy": rng.normal(-5.0, 2.0, len(n_atoms))})


def stats_json(path, monkeypatch, switch):
    """`stats PATH forces energy --per-element --json`, the moments in C (switch "1") or by
    their NumPy twin ("0"): its output, parsed."""
    monkeypatch.setenv("SEGCLI_NATIVE_STATS", switch)
    stats._native_moments.cache_clear()
    try:
        assert (stats._native_moments() is not None) == (switch == "1")
        result = CliRunner().invoke(main, ["stats", str(path), "forces", "energy",
                                           "--per-element", "--json"])
    finally:
        stats._native_moments.cache_clear()
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_stats_without_a_compiler_give_the_bits_of_the_built_moments(batch, no_compiler,
                                                                     monkeypatch):
    """No compiler and an empty cache: the moments in C (the library built with the package),
    and their NumPy twin, print the same bits (text), and nothing is compiled or cached."""
    built, twin = (stats_json(batch, monkeypatch, switch) for switch in ("1", "0"))
    assert json.dumps(built) == json.dumps(twin)
    assert any(row["component"] == "norm" for row in built["stats"])


def test_the_twin_gives_the_bits_of_the_c_moments(monkeypatch):
    """Random chunks in sequence into the same leaves (float64 and float32 rows, ±0 values,
    1 to 20 000 components, integer groups of every width, blocks of 1 to 4096 rows): the
    moments in C and their NumPy twin, bit for bit (signs of zeros too)."""
    kernel = stats._native_moments()
    assert kernel is not None
    rng = np.random.default_rng(11)
    cases = [(rng.integers(1, 6), rng.integers(1, 5), rng.integers(1, 6), rng.integers(1, 9),
              dtype, labels) for dtype in (np.float64, np.float32)
             for labels in (np.uint8, np.uint16, np.int32, np.int64) for _ in range(3)]
    cases += [(1, 20000, 2, 4096, np.float64, np.uint8), (8, 3, 3, 64, np.float32, np.uint8)]
    for groups, k, leaves, block, dtype, labels_dtype in cases:
        monkeypatch.setattr(stats, "NATIVE_BLOCK_ROWS", int(block))
        ours, twin = (stats.Moments.empty(groups, k + 1, leaves=leaves) for _ in range(2))
        for _ in range(3):
            n = int(rng.integers(0, 400 // k + 2))
            rows = rng.normal(0.5, 2.0, (n, k)).astype(dtype)
            rows[rng.random(rows.shape) < 0.2] = 0.0
            rows[rng.random(rows.shape) < 0.2] = -0.0
            count = np.diff(np.concatenate([[0], np.sort(rng.integers(0, n + 1, leaves - 1)),
                                            [n]]))
            labels = rng.integers(0, groups, n).astype(labels_dtype) if groups > 1 else None
            assert kernel(rows, True, count, labels, ours, stats._Buffers())
            assert moments_twin.moments(rows, True, count, labels, twin, int(block))
        for key in stats.MOMENT_NAMES:
            a, b = getattr(ours, key), getattr(twin, key)
            assert np.array_equal(a, b) and np.array_equal(np.signbit(a), np.signbit(b)), key
    bad = np.array([0, 1, 7, 1], np.int64)  # 7 is no group of 4
    assert not moments_twin.moments(np.ones((4, 3)), True, np.array([4]), bad,
                                    stats.Moments.empty(4, 4, leaves=1), 4096)


def test_the_c_parts_are_the_built_ones(batch, no_compiler):
    """Each C part loads from beside its source, as built at install (none from a cache), and
    `reduce` through the launch handler runs no compiler."""
    from segcli.ops import _native

    for part in native.PARTS:
        assert native.library(part)._name == str(part.path), part.name
    assert _native.available(), _native.unavailable()
    assert _native._library()[0]._name == str(native.LAUNCH.path)
    result = CliRunner().invoke(main, ["reduce", str(batch), "sum", "forces"])
    assert result.exit_code == 0, result.output


def test_a_part_not_built_is_said_once(capfd):
    """A part whose library is not there: Unavailable each time, one line on stderr."""
    absent = native.MOMENTS._replace(name="segcli._not_built")
    for _ in range(2):
        with pytest.raises(native.Unavailable, match=r"_not_built\..*so was not built"):
            native.load(absent)
        assert native.library(absent) is None
    err = capfd.readouterr().err
    assert err == ("segcli: note: running without its C moments (not built at install: no C "
                   "compiler?); "
                   "statistics take their NumPy twin (the same bits, slower)\n")
