"""The C that only GPUs run (the `__CUDA_ARCH__` branches of the span kernels), compiled here
as plain C++ with stand-ins for CUDA's 16-byte loads and run lane by lane: what a group of
lanes adds up, against NumPy. (The tests of the
ops run these kernels' CPU branches here; this checks the GPU's loops on every machine. Their
compilation for sm_90 is checked by test_ops.test_gpu_kernels_compile_for_cuda.)"""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from segcli.ops import _kernels

LANES = 8

STAND_INS = """
#include <cstdint>
struct uint4 { unsigned x, y, z, w; };
template <class T> T __ldg(const T* p) { return *p; }
struct Array { void* data; int shape[4]; };
namespace wp {
template <unsigned N, class T> struct vec_t {
    T at[N];
    vec_t(T a, T b, T c) : at{a, b, c} {}
};
}
#define __CUDA_ARCH__ 900
"""


def _span(name, dtype, acc, body):
    return f"""
extern "C" double {name}(const {dtype}* p, const {dtype}* q, int n, int lo, int hi, int g,
                         int groups, int k, int lane, int lanes, {dtype} f) {{
    Array x{{(void*)p, {{n}}}}, y{{(void*)q, {{n}}}};
    return [&]() -> {acc} {{
{body}
    }}();
}}"""


def _span3(name, dtype, body):
    return f"""
extern "C" void {name}(const {dtype}* p, int n, int lo, int hi, int lane, int lanes,
                       {dtype} w, double* out) {{
    Array a{{(void*)p, {{n}}}};
    const wp::vec_t<3, {dtype}> v = [&]() -> wp::vec_t<3, {dtype}> {{
{body}
    }}();
    for (int c = 0; c < 3; c++) out[c] = v.at[c];
}}"""


@pytest.fixture(scope="module")
def gpu_loops(tmp_path_factory):
    """The kernels' GPU branches, built with the C++ compiler and loaded."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    assert compiler, "no C++ compiler (c++, g++ or clang++) on the PATH"
    span, span3 = _kernels._SPAN_SUM, _kernels._SPAN3_SUM
    source = "\n".join([
        STAND_INS,
        _span("span_f32", "float", "float", span.replace("ACC", "float")),
        _span("span_f64", "double", "double",
              span.replace("float", "double").replace("ACC", "double")),
        _span("span_wide", "float", "double", span.replace("ACC", "double")),
        _span3("span3_f32", "float", span3),
        _span3("span3_f64", "double", span3.replace("float", "double"))])
    path = tmp_path_factory.mktemp("gpu_c")
    (path / "loops.cpp").write_text(source)
    built = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-o",
                            path / "loops.so", path / "loops.cpp"], capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    lib = ctypes.CDLL(str(path / "loops.so"))
    pointer, i = ctypes.c_void_p, ctypes.c_int
    for name, value in (("span_f32", ctypes.c_float), ("span_f64", ctypes.c_double),
                        ("span_wide", ctypes.c_float)):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [pointer, pointer, *[i] * 8, value]
    for name, value in (("span3_f32", ctypes.c_float), ("span3_f64", ctypes.c_double)):
        getattr(lib, name).argtypes = [pointer, i, i, i, i, i, value, pointer]
    return lib


def _placed(values, skew):
    """values copied `skew` entries past a 64-byte boundary (the array the kernel is given),
    and its address."""
    room = np.zeros(values.size + 64, values.dtype)
    start = (-room.ctypes.data % 64) // values.itemsize + skew
    placed = room[start:start + values.size]
    placed[:] = values
    return placed, placed.ctypes.data


def _spans(n_rows, k, rng):
    """(lo, hi) row ranges of a (n_rows, k) array: empty, one row, every start and end within
    a few blocks, and the whole array (ending at its last entry)."""
    ranges = {(0, 0), (0, n_rows), (n_rows - 1, n_rows)}
    for lo in range(min(n_rows, 9)):
        for hi in range(lo, min(n_rows, lo + 12) + 1):
            ranges.add((lo, hi))
    ranges.update(tuple(sorted(rng.integers(0, n_rows + 1, 2))) for _ in range(20))
    return sorted(ranges)


@pytest.mark.parametrize("name, dtype", [("span_f32", np.float32), ("span_f64", np.float64),
                                         ("span_wide", np.float32)])
@pytest.mark.parametrize("skew", [0, 1])
def test_gpu_span_lanes_take_each_entry_of_the_span_once(gpu_loops, name, dtype, skew):
    """dot_span's and rms_norm_span's loop (G = 1): the 8 lanes' sums of x·f·y add up to the
    span's, for spans starting and ending at every place in a block of 16 bytes, reaching the
    array's last block (cut short where the entries end inside it), on arrays 16-byte aligned
    (blocks) and not (entries one by one). Integer entries: every sum is exact, so an entry
    taken twice or missed changes it."""
    rng = np.random.default_rng(3)
    span = getattr(gpu_loops, name)
    for k, n_rows in ((3, 1), (3, 5), (3, 13), (1, 7), (2, 9), (5, 6)):
        x = rng.integers(-8, 9, n_rows * k).astype(dtype)
        y = rng.integers(-8, 9, n_rows * k).astype(dtype)
        (px, ax), (py, ay) = _placed(x, skew), _placed(y, skew)
        for lo, hi in _spans(n_rows, k, rng):
            lanes = [span(ax, ay, n_rows * k, lo, hi, 0, 1, k, lane, LANES, 2.0)
                     for lane in range(LANES)]
            expected = 2.0 * np.dot(px[lo * k:hi * k].astype(np.float64), py[lo * k:hi * k])
            assert sum(lanes) == expected, (k, n_rows, lo, hi, lanes)


@pytest.mark.parametrize("name, dtype", [("span3_f32", np.float32), ("span3_f64", np.float64)])
@pytest.mark.parametrize("skew", [0, 1, 2])
def test_gpu_span3_lanes_sum_each_feature_once(gpu_loops, name, dtype, skew):
    """sum_span3's and mean_span3's loop: the 8 lanes' sums of each feature (times w) add up to
    the segment's, rows starting and ending anywhere, the last at the array's end, aligned and
    not; integer entries, exact sums."""
    rng = np.random.default_rng(4)
    span3 = getattr(gpu_loops, name)
    out = np.zeros(3)
    for n_rows in (1, 2, 5, 11, 16):
        rows = rng.integers(-8, 9, (n_rows, 3)).astype(dtype)
        placed, address = _placed(rows.reshape(-1), skew)
        rows = placed.reshape(n_rows, 3)
        for lo, hi in _spans(n_rows, 3, rng):
            total = np.zeros(3)
            for lane in range(LANES):
                span3(address, 3 * n_rows, lo, hi, lane, LANES, 0.5, out.ctypes.data)
                total += out
            np.testing.assert_array_equal(total, 0.5 * rows[lo:hi].sum(axis=0, dtype=np.float64),
                                          err_msg=f"{n_rows} rows, {lo}:{hi}")
