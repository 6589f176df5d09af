"""No compiler at run time: segcli's C parts are those built with the package (setup.py), none
is compiled by a command, and where one is missing its fallback gives the same bits and says
so once on stderr."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli import cache_directory, native, stats
from segcli.cli import main

COMPILERS = {"cc", "gcc", "clang", "c++", "g++", "clang++", "ld", "as", "false"}
"""What runs no subprocess of a command may name."""

spawned = []
"""argv[0] of every subprocess started while `watching` (an audit hook, once a process)."""
watching = []


def _audit(event, args):
    if watching and event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"):
        spawned.append(os.path.basename(str(args[1][0] if event != "os.system" else args[0])))


sys.addaudithook(_audit)


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """PATH without any compiler, CC a failing one and an empty cache (Warp's kept where it
    was); the subprocesses started watched: none a compiler, and nothing in segcli's cache."""
    empty = tmp_path / "bin"
    empty.mkdir()
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    monkeypatch.setenv("WARP_CACHE_PATH", os.environ.get("WARP_CACHE_PATH")
                       or os.path.join(home, "warp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CC", "/bin/false")
    spawned.clear()
    watching.append(True)
    yield
    watching.clear()
    assert not COMPILERS & set(spawned), spawned
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
