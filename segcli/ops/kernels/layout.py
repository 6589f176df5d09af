"""Layout kernels: CSR offsets of sorted segment ids, and the ids of CSR offsets.

    layout      idx (N,)                     -> offsets (M+1,)  offsets[s] = first i with
                                                                idx[i] >= s (a binary search per
                                                                segment on GPUs; layout_runs, a
                                                                thread per 4 ids, on CPUs)
    segment_ids  offsets (M+1,)              -> ids (N,)        ids[i] = s for offsets[s] <= i <
                                                                offsets[s+1], -1 ahead of
                                                                offsets[0], M from offsets[M]
                                                                (a thread per run of one id)
"""

import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._registry import ANY, kernel, variants


def _layout_kernel(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # One thread per segment: binary search for the first id >= s. (On a GPU this beats a
    # thread per row writing the offsets at each boundary: 17 µs against 39 at N = 10⁷.)
    s = wp.tid()
    lo = int(0)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    hi = idx.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if idx[mid] < s:
            lo = mid + 1
        else:
            hi = mid
    out[s] = lo


# CPUs: the offsets at the boundaries of a run of 4 ids (see layout_run.h).
@wp.func_native(_c.body("layout_run.h"))
def _layout_run(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32), t: int) -> int:
    ...


def _layout_runs_kernel(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # a thread per run of 4 ids (see layout_run.h), launched (max(1, ceil(N / 4)),)
    _layout_run(idx, out, wp.tid())


@wp.func_native(_c.body("fill_ids.h"))
def _fill_ids(out: wp.array(dtype=wp.int32), lo: int, hi: int, id: int):
    ...


def _segment_ids_kernel(offsets: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # a thread per run of rows of one id, launched (M + 2,): thread 0 the rows ahead of
    # offsets[0] (-1), thread t in 1..M those of segment t - 1, thread M + 1 those from
    # offsets[M] on (M); offsets non-decreasing, clamped to [0, N]. (2 Mi rows in 65 Ki
    # segments on a 2-core VM: 3.1 ms by a loop in Warp, 1.2 ms in C, as NumPy's repeat.)
    t = wp.tid()
    m = offsets.shape[0] - 1
    n = out.shape[0]
    lo = int(0)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    hi = n
    if t > 0:
        lo = wp.clamp(offsets[t - 1], 0, n)
    if t <= m:
        hi = wp.clamp(offsets[t], lo, n)
    _fill_ids(out, lo, hi, t - 1)


_IDS = ("int32",)

LAYOUT = variants(
    # op, step, device, ordering, size, kernel
    ("offsets", "", "gpu", ANY, ANY, kernel("layout", _layout_kernel, dtypes=_IDS)),
    ("offsets", "", "cpu", ANY, ANY, kernel("layout_runs", _layout_runs_kernel, dtypes=_IDS)),
    ("ids", "", "cpu", ANY, ANY, kernel("segment_ids", _segment_ids_kernel, dtypes=_IDS)),
)
"""Ids to offsets (binary searches on GPUs, runs of 4 ids on CPUs) and offsets to ids (CPUs;
GPUs take XLA's cumulative sum)."""
