"""The program's start-up: its compiled programs kept across runs (SEGCLI_COMPILATION_CACHE),
the process settings it leaves to callers, and only what a command needs loaded."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from segcli.cli import main

METALS = Path(__file__).resolve().parents[2] / "sample_data" / "metals.h5"
REDUCE = ["reduce", METALS, "rms_norm", "forces"]


def python(*args, **env):
    """A Python process with `env` set, and no cache location of its own from the caller."""
    environ = {k: v for k, v in os.environ.items() if k not in (
        "SEGCLI_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env={**environ, **env}, check=False)


def segcli(*args, **env):
    return python("-m", "segcli", *args, **env)


@pytest.mark.parametrize("command", [REDUCE, pytest.param(["grad", METALS, "max_norm", "forces"],
                                                       marks=pytest.mark.slow)])
def test_a_second_run_takes_its_compiled_programs_from_the_cache(tmp_path, command):
    cache = tmp_path / "cache"
    env = {"SEGCLI_COMPILATION_CACHE": str(cache), "JAX_LOG_COMPILES": "1"}
    first = segcli(*command, **env)
    entries = sorted(cache.iterdir())
    second = segcli(*command, **env)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert entries and sorted(cache.iterdir()) == entries
    assert "Persistent compilation cache hit" not in first.stderr
    hits = second.stderr.count("Persistent compilation cache hit")
    assert hits == second.stderr.count("Compiling ") >= 1, second.stderr
    assert second.stdout == first.stdout


@pytest.mark.parametrize("setting", [None, pytest.param("off", marks=pytest.mark.slow)])
def test_the_cache_is_in_the_user_cache_directory_unless_off(tmp_path, setting):
    # Warp's kernels from where they are already (not built again under tmp_path)
    warp_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "warp"
    env = {"XDG_CACHE_HOME": str(tmp_path),
           "WARP_CACHE_PATH": os.environ.get("WARP_CACHE_PATH", str(warp_cache))}
    if setting:
        env["SEGCLI_COMPILATION_CACHE"] = setting
    result = segcli(*REDUCE, **env)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    made = sorted(tmp_path.rglob("*-cache"))
    assert [p.parent for p in made[:1]] == ([] if setting else [tmp_path / "segcli" / "jax"])


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_an_unwritable_cache_directory_is_passed_over_silently(tmp_path, where):
    if where == "under a file":
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        cache = tmp_path / "cache"
        cache.mkdir(mode=0o500)
    result = segcli(*REDUCE, SEGCLI_COMPILATION_CACHE=str(cache))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == CliRunner().invoke(main, list(map(str, REDUCE))).stdout


@pytest.mark.slow
def test_callers_keep_their_jax_settings_and_garbage_collector(tmp_path):
    code = f"""
import gc, jax, numpy as np
from click.testing import CliRunner
before, frozen = dict(jax.config.values), gc.get_freeze_count()  # a site may freeze some
from segcli import ops
from segcli.cli import main
ops.segmented_rms_norm(np.ones((4, 3)), np.array([0, 0, 1, 1]), 2)
result = CliRunner().invoke(main, ["reduce", {str(METALS)!r}, "rms_norm", "forces"])
assert result.exit_code == 0, result.output
changed = {{k: v for k, v in jax.config.values.items() if before.get(k) != v}}
assert not changed, changed
assert gc.isenabled() and gc.get_freeze_count() == frozen
"""
    result = python("-c", code, XDG_CACHE_HOME=str(tmp_path))
    assert result.returncode == 0, result.stderr
    # no compilation cache of JAX's (the C sources' builds are kept beside, in segcli/)
    assert not (tmp_path / "segcli" / "jax").exists()


def test_an_op_loads_only_the_kernels_it_launches():
    code = r"""
import re, jax, numpy as np, warp as wp
from segcli import ops
from segcli.ops import _native
from segcli.ops.kernels import _registry
assert not _registry._MADE
wp.config.log_level = wp.LOG_INFO
f = jax.jit(lambda x, idx: ops.segmented_rms_norm(x, idx, 2, indices_are_sorted=True))
program = f.lower(np.ones((4, 3), np.float32), np.array([0, 0, 1, 1], np.int32)).as_text()
plans = {int(p) for p in re.findall(r"custom_call @segcli_launch.*plan = (\d+)", program)}
kernels = {_native._registry().kernels[p][0].key for p in plans}
print("launched", *sorted(k.removeprefix("_").removesuffix("_kernel") for k in kernels))
print("made", *sorted(_registry._MADE), "of", len(_registry.KERNELS))
"""
    result = python("-c", code, JAX_PLATFORMS="cpu")
    assert result.returncode == 0, result.stderr
    launched = re.search(r"^launched (.*)$", result.stdout, re.MULTILINE).group(1).split()
    made, total = re.search(r"^made (.*) of (\d+)$", result.stdout, re.MULTILINE).groups()
    loaded = re.findall(r"Module segcli_(\w+) \S+ load on device 'cpu'", result.stdout)
    assert launched and sorted(loaded) == made.split() == launched
    assert len(launched) < int(total)


@pytest.mark.parametrize("args", [["reduce", METALS, "rms_norm", "forces"],
                                  ["select", METALS, "--where", "energy < 0", "-o", "OUT.h5", "-q"],
                                  ["convert", METALS, "-o", "OUT.h5", "-q"]])
def test_hdf5_in_and_out_imports_neither_ase_nor_dask(args, tmp_path):
    args = [str(tmp_path / a) if a == "OUT.h5" else str(a) for a in args]
    code = f"""
import runpy, sys
sys.argv = ["segcli", *{args!r}]
try:
    runpy.run_module("segcli", run_name="__main__")
except SystemExit:
    pass
print(*sorted(m for m in ("ase", "dask", "distributed", "scipy", "tqdm") if m in sys.modules),
      file=sys.stderr)
"""
    result = python("-c", code)
    assert result.returncode == 0 and result.stderr == "\n", result.stderr


def test_an_ase_format_loads_ase_io_before_any_output_exists(tmp_path):
    """Reading an extxyz file loads ase.io (and SciPy under it, most of a second) when the
    file opens, before `convert` creates its temporary output: a signal then interrupts the
    run where it cleans up, not in the middle of an import, which would end in a traceback."""
    code = f"""
import os, runpy, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "ase.io":
            print("outputs when ase.io loads:", os.listdir({str(tmp_path)!r}), file=sys.stderr)
sys.meta_path.insert(0, Watch())
sys.argv = ["segcli", "convert", {str(METALS.with_suffix(".extxyz"))!r}, "-o",
            {str(tmp_path / "out.h5")!r}, "-q"]
try:
    runpy.run_module("segcli", run_name="__main__")
except SystemExit as exit:
    assert not exit.code
"""
    result = python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["outputs when ase.io loads: []"], result.stderr


@pytest.mark.parametrize("args, code, needle", [
    (["reduce", "missing.h5", "sum", "forces"], 1, "missing.h5: no such file"),
    (["reduce", METALS, "sum", "forcez"], 1, "no field 'forcez'"),
    (["reduce", METALS, "summ", "forces"], 2, "unknown op 'summ'"),
    (["reduce", METALS, "sum", "forces", "--structures", "500:"], 1, "selects no structure"),
    (["reduce", METALS, "sum", "forces", "-o", "/nonexistent/x.h5"], 1, "cannot write there"),
    (["grad", METALS, "sum", "forces", "--weights", "nope"], 1, "no field 'nope'"),
    (["stats", METALS, "forcez"], 1, "no field 'forcez'"),
    (["fit-e0", METALS, "--energy", "nope"], 1, "no field 'nope'"),
    (["gradcheck", "missing.h5"], 1, "missing.h5: no such file"),
    (["gradcheck", METALS, "--structures", "500:"], 1, "selects no structure"),
])
def test_errors_that_need_no_computation_come_before_jax_and_warp_load(args, code, needle):
    script = f"""
import runpy, sys
sys.argv = ["segcli", *{[str(a) for a in args]!r}]
try:
    runpy.run_module("segcli", run_name="__main__")
except SystemExit as exit:
    print("exit", exit.code, *sorted(m for m in ("jax", "warp") if m in sys.modules))
"""
    result = python("-c", script)
    assert result.stdout.split() == ["exit", str(code)], result.stdout + result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
