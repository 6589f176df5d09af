"""The C launch handler (segcli/ops/_native.py, _launch.c): the ops' values through it against
NumPy, bitwise the values of Warp's own jax_kernel, Warp's jax_kernel where the handler was
not built, no cache written, one plan per distinct launch, an unknown plan's
error."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp
from test_ops import assert_close

from segcli import ops
from segcli.ops import _native

pytestmark = pytest.mark.usefixtures("x64")

ROOT = Path(__file__).resolve().parents[2]
N, M, LENGTH, EMPTY = 40, 6, 5, 2
"""Rows, segments and bincount's labels of the inputs, and their segment without rows."""

CALLS = {
    "sum": lambda a: ops.segmented_sum(a["x"], a["idx"], M),
    "mean": lambda a: ops.segmented_mean(a["x"], a["idx"], M),
    "rms_norm": lambda a: ops.segmented_rms_norm(a["x"], a["idx"], M),
    "max_norm": lambda a: ops.segmented_max_norm(a["x"], a["idx"], M),
    "dot": lambda a: ops.segmented_dot(a["x"], a["y"], a["idx"], M),
    "matvec": lambda a: ops.segmented_matvec(a["x"], a["cells"], a["idx"], M),
    "softmax": lambda a: ops.segmented_softmax(a["x"], a["idx"], M),
    "rms_norm grad": lambda a: jax.grad(
        lambda x: jnp.vdot(a["w"], ops.segmented_rms_norm(x, a["idx"], M)))(a["x"]),
}
"""The float ops under test, each on the arrays of `inputs` in one float dtype."""

SCRIPT = """
import json, os, sys
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
from segcli.ops import _native
from test_native import results
reports = []
for i, (env, names) in enumerate(json.loads(sys.argv[3])):
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    _native._library.cache_clear()
    jax.clear_caches()
    np.savez(f"{sys.argv[2]}-{i}.npz", **results(dict(np.load(sys.argv[1])), names))
    reports.append({"available": _native.available(), "unavailable": _native.unavailable()})
print(json.dumps(reports))
"""
"""For each case of argv[3] (a JSON list of [environment variables to set, or with null to
unset; the names of CALLS]), in turn: `results` of the arrays in argv[1] into argv[2]-i.npz,
and whether the handler was used."""


def inputs(seed, sorted_ids=False):
    """Random float64 x, y (N, 3), cells (M, 3, 3), weights w (M,), int32 labels in
    [-1, LENGTH] (the ends dropped) and ids over M segments, segment EMPTY empty and four ids
    out of range; sorted with `sorted_ids`."""
    rng = np.random.default_rng(seed)
    idx = rng.choice([s for s in range(M) if s != EMPTY], N)
    idx[rng.choice(N, 4, replace=False)] = [-1, M, 2**31 - 1, -7]
    return {"x": rng.normal(size=(N, 3)), "y": rng.normal(size=(N, 3)),
            "cells": rng.normal(size=(M, 3, 3)), "w": rng.normal(size=M),
            "labels": rng.integers(-1, LENGTH + 1, N).astype(np.int32),
            "idx": (np.sort(idx) if sorted_ids else idx).astype(np.int32)}


def results(arrays, names=tuple(CALLS)):
    """CALLS `names` on `arrays` in float32 and in float64 (by "name dtype"), and bincount, in
    one program: NumPy arrays."""

    def every(a):
        out = {"bincount": ops.segmented_bincount(a["labels"], a["idx"], M, LENGTH)}
        for dtype in ("float32", "float64"):
            cast = {k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in a.items()}
            out.update({f"{name} {dtype}": CALLS[name](cast) for name in names})
        return out

    return {k: np.asarray(v) for k, v in jax.jit(every)(arrays).items()}


def reference(a):
    """CALLS (by name) and bincount of `a`, in float64 NumPy."""
    x, y, cells, w, labels, idx = (a[k] for k in ("x", "y", "cells", "w", "labels", "idx"))
    rows = np.flatnonzero((idx >= 0) & (idx < M))
    ids = idx[rows]
    counts = np.maximum(np.bincount(ids, minlength=M), 1)

    def total(values):
        out = np.zeros((M, *values.shape[1:]))
        np.add.at(out, ids, values[rows])
        return out

    def per_row(values):
        out = np.zeros_like(x)
        out[rows] = values
        return out

    rms = np.sqrt(total(np.sum(x * x, axis=1)) / counts)
    max_norm = np.zeros(M)
    np.maximum.at(max_norm, ids, np.linalg.norm(x[rows], axis=1))
    exps = np.exp(x)
    bincount = np.zeros((M, LENGTH), np.int32)
    known = (labels[rows] >= 0) & (labels[rows] < LENGTH)
    np.add.at(bincount, (ids[known], labels[rows][known]), 1)
    return {"sum": total(x), "mean": total(x) / counts[:, None], "rms_norm": rms,
            "max_norm": max_norm, "dot": total(np.sum(x * y, axis=1)),
            "matvec": per_row(np.einsum("ij,ijk->ik", x[rows], cells[ids])),
            "softmax": per_row(exps[rows] / total(exps)[ids]),
            "rms_norm grad": per_row((w[ids] / (counts[ids] * rms[ids]))[:, None] * x[rows]),
            "bincount": bincount}


def assert_matches_reference(got, arrays, names=tuple(CALLS)):
    """`results` of `arrays` (CALLS `names`) against `reference`: within each dtype's rounding,
    and exactly 0 where the reference is (the empty segment, rows out of range)."""
    want = reference(arrays)
    np.testing.assert_array_equal(got["bincount"], want["bincount"])
    assert got["bincount"].dtype == np.int32
    assert len(got) == 1 + 2 * len(names)
    for dtype, rtol in (("float32", 2e-6), ("float64", 1e-13)):
        for name in names:
            value = got[f"{name} {dtype}"]
            assert value.dtype == dtype, name
            assert_close(value, want[name], rtol)
            assert np.all(value[want[name] == 0] == 0), name


def start(tmp_path, name, arrays, cases=(({}, tuple(CALLS)),), root=ROOT, **env):
    """A Python process computing `results` of `arrays` once per case of `cases` (SCRIPT)
    with the segcli of `root`, with `env` set over this process's environment (less its CC,
    cache location and SEGCLI_NATIVE_LAUNCH); Warp's kernels from this process's kernel
    cache."""
    np.savez(tmp_path / f"{name}-inputs.npz", **arrays)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("CC", "XDG_CACHE_HOME", "SEGCLI_NATIVE_LAUNCH")}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, tmp_path / f"{name}-inputs.npz", tmp_path / name,
         json.dumps(list(cases))],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**environ, "PYTHONPATH": os.pathsep.join([str(root), str(Path(__file__).parent),
                                                        str(ROOT / "tests" / "support")]),
             "JAX_PLATFORMS": "cpu",
             "WARP_CACHE_PATH": str(Path(wp.config.kernel_cache_dir).parent), **env})


def finish(process, tmp_path, name):
    """[(the report, the results)] of each case of a process of `start`, once it has
    exited."""
    stdout, process.stderr_text = process.communicate(timeout=300)
    assert process.returncode == 0, process.stderr_text
    return [(report, dict(np.load(tmp_path / f"{name}-{i}.npz")))
            for i, report in enumerate(json.loads(stdout.splitlines()[-1]))]


def test_ops_through_the_handler_match_numpy():
    """Unsorted ids, some out of range, one segment empty; float32 and float64; a gradient."""
    assert _native.available() and _native.unavailable() is None
    arrays = inputs(0)
    assert_matches_reference(results(arrays), arrays)


def test_the_handler_gives_the_bits_of_warps_jax_kernel(tmp_path):
    """Sorted ids (reduced in a fixed order): the same bits here as with SEGCLI_NATIVE_LAUNCH=0."""
    arrays = inputs(1, sorted_ids=True)
    fallback = start(tmp_path, "fallback", arrays, SEGCLI_NATIVE_LAUNCH="0")
    ours = results(arrays)
    [(report, theirs)] = finish(fallback, tmp_path, "fallback")
    assert report == {"available": False, "unavailable": "SEGCLI_NATIVE_LAUNCH=0"}
    assert sorted(theirs) == sorted(ours)
    for name, value in ours.items():
        assert theirs[name].dtype == value.dtype, name
        np.testing.assert_array_equal(theirs[name], value, err_msg=name)
    assert_matches_reference(ours, arrays)


def test_without_the_handler_warps_jax_kernel_gives_the_values(tmp_path):
    """A copy of segcli whose handler was not built (nothing compiles it at run time): one
    note on stderr, unavailable() says why, on one line, the values are right, and no cache
    is written."""
    root = tmp_path / "unbuilt"
    shutil.copytree(ROOT / "segcli", root / "segcli",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    arrays = inputs(2)
    process = start(tmp_path, "out", arrays, root=root, XDG_CACHE_HOME=str(tmp_path / "cache"))
    [(report, got)] = finish(process, tmp_path, "out")
    assert report["available"] is False
    assert "\n" not in report["unavailable"] and re.fullmatch(
        r"_launch\.\S+\.so was not built with segcli: .+", report["unavailable"]), \
        report["unavailable"]
    assert_matches_reference(got, arrays)
    assert process.stderr_text.count("segcli: note: running without its C launch handler") == 1
    assert not (tmp_path / "cache").exists()


def test_processes_use_the_built_handler_and_write_no_cache(tmp_path):
    """Two processes at once with a fresh cache location: both use the handler built with the
    package, and neither writes a cache."""
    arrays = inputs(3)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    processes = [start(tmp_path, name, arrays, [({}, ("sum",))], **env) for name in ("a", "b")]
    for process, name in zip(processes, ("a", "b")):
        [(report, got)] = finish(process, tmp_path, name)
        assert report == {"available": True, "unavailable": None}
        assert_matches_reference(got, arrays, ("sum",))
    assert not (tmp_path / "cache").exists()


def test_a_launch_is_planned_once():
    """A program traced again (its caches cleared) reuses its plans; other shapes add some."""
    idx = jnp.asarray(np.repeat(np.arange(3), [5, 0, 8]), jnp.int32)
    f = lambda x: ops.segmented_rms_norm(x, idx, 3)
    plans = lambda x: re.findall(r"plan = (\d+) : i64", jax.jit(f).lower(x).as_text())
    first = plans(jnp.ones((13, 7)))
    size = len(_native._registry().ids)
    jax.clear_caches()  # else JAX reuses its lowering and never asks for the plans again
    assert plans(jnp.ones((13, 7))) == first and len(first) > 1
    assert len(_native._registry().ids) == size
    other = plans(jnp.ones((13, 11)))
    assert len(_native._registry().ids) > size
    assert set(other) - set(first) == {str(i) for i in range(size, len(_native._registry().ids))}


@pytest.mark.parametrize("plan", [10**9, -1])
def test_an_unknown_plan_is_a_jax_error(plan):
    """A call of the handler with a plan never registered: an error raised in Python, and the
    handler still launching after it."""
    x = jnp.ones((4, 2))
    ids = jnp.asarray([0, 0, 1, 1], jnp.int32)
    np.testing.assert_array_equal(ops.segmented_sum(x, ids, 2), [[2, 2], [2, 2]])  # loaded
    call = jax.ffi.ffi_call("segcli_launch", jax.ShapeDtypeStruct((4,), jnp.float32))
    unknown = jax.jit(lambda z: call(z, plan=np.int64(plan)))
    with pytest.raises(RuntimeError, match="segcli: unknown kernel launch plan"):
        unknown(jnp.zeros(4, jnp.float32)).block_until_ready()
    np.testing.assert_array_equal(ops.segmented_sum(2 * x, ids, 2), [[4, 4], [4, 4]])


def test_a_device_without_preloaded_kernels_loads_them_at_the_first_launch():
    """With no device of the default backend preloaded (as for a CPU program on a machine
    whose default is a GPU), the handler asks Python for the kernel on its first launch."""
    code = """
import numpy as np
from segcli import ops
from segcli.ops import _native
_native._default_devices = lambda: ()  # no entry point loaded as plans are made
x = np.arange(12.0).reshape(6, 2)
print(np.asarray(ops.segmented_sum(x, np.array([0, 0, 2, 2, 2, 1], np.int32), 3)).tolist())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                         "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[2.0, 4.0], [10.0, 11.0], [18.0, 21.0]]
