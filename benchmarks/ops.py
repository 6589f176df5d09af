"""Time forward, grad and grad-of-grad of every segment op against pure JAX (and nvalchemiops).

    python benchmarks/ops.py --atoms 10000000 --dtype float32,float64 --out table.md

Implementations, timed side by side in one process on the same inputs:
  segcli         segcli.ops (Warp kernels through JAX primitives)
  jax            segcli.reference (jax.ops.segment_sum / segment_max and jnp)
  nvalchemiops   nvalchemiops.jax.segment_ops, when importable

Every op of segcli.registry.OPS, its inputs made from its argument data: (N, 3) per-atom
fields (any trailing shape is 3), per-structure ones of their own shape, labels random in
[0, length); N atoms in structures of 1..63 atoms (32 on average), sorted ids.
grad is the gradient of Σ w·op(...) (w random, passed as an argument) with respect to its
arguments; grad2 the gradient of <grad, v>. Each cell gives, for a jitted function, its latency
(the median of `--repeats` calls, each followed by block_until_ready) and its throughput time
(the median over `--repeats` bursts of BURST calls back to back with one synchronisation, per
call); the implementations of a cell are called in turns (see `median_seconds`). The floor is
the bytes the call must move (its arguments read once, its result written once) at the rate of
a large elementwise copy measured on the same device. Each dtype's first row, "(a pass)", is
no op: a jitted elementwise pass over one (N, 3) field (read once, written once), timed as the
cells are and shown in the segcli column; its ratio to its floor is what any call that moves
as many bytes pays beyond them (its launch, the gaps between the calls of a burst). "= jax" in
the last column marks a cell whose segcli function XLA compiles to the same program as the
pure-JAX one (their times then differ by the measurement's noise alone).
"""

import argparse
import datetime
import importlib
import inspect
import os
import platform
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from segcli.registry import OPS

MODES = ["fwd", "grad", "grad2"]
BURST = 20
"""Calls back to back per throughput measurement."""


def inputs(n, dtype, seed=0):
    """(rng, ids, number of structures, direction v (n, 3)) for n atoms."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 64, size=n // 16 + 2)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), n) + 1]
    sizes[-1] -= sizes.sum() - n
    m = len(sizes)
    idx = jnp.asarray(np.repeat(np.arange(m, dtype=np.int32), sizes))
    return rng, idx, m, jnp.asarray(rng.normal(size=(n, 3)).astype(dtype))


def arguments(op, rng, n, m, dtype):
    """Random arguments of `op` (a registry.Op) from its argument data."""
    args = []
    for arg in op.inputs:
        shape = ((n,) if arg.per == "atom" else (m,)) + (
            arg.shape if arg.shape is not None else (3,))
        args.append(rng.integers(0, op.params["length"], shape) if arg.kind == "labels"
                    else rng.normal(size=shape).astype(dtype))
    return tuple(jnp.asarray(a) for a in args)


LAYOUTS = {
    "ids": "sorted ids, not promised sorted (each implementation checks or copes)",
    "sorted": "sorted ids promised sorted (indices_are_sorted=True where a function takes it)",
    "segments": "segcli.ops given a Segments (ids and offsets, built once); the others as sorted",
}
"""How the segments are given (`--layout`)."""


def functions(module, op, m, layout="ids"):
    """Jitted fwd, grad and grad-of-grad of `op` (a registry.Op) from `module` (none where it
    has no such function; fwd only for an op that is not differentiable), the segments given
    as `layout` says (LAYOUTS).

    Each takes (w, v, *args, idx, offsets): the weights w of the loss Σ w·op(args), the
    direction v of the second order, the op's arguments, then the ids and their CSR offsets.
    w and v are arguments, not constants, as they are in a training step (XLA would otherwise
    embed them in the program)."""
    f = getattr(module, "segmented_" + op.name, None)
    if f is None:
        return {}
    params = dict(op.params)
    if layout != "ids" and "indices_are_sorted" in inspect.signature(f).parameters:
        params["indices_are_sorted"] = True
    if layout == "segments" and hasattr(module, "Segments"):
        params.pop("indices_are_sorted", None)
        # ids and offsets are arguments, so XLA cannot fold anything that depends on them
        call = lambda *a: f(*a[:-2], module.Segments(a[-2], a[-1]), m, **params)  # noqa: E731
    else:
        call = lambda *a: f(*a[:-2], a[-2], m, **params)  # noqa: E731
    if not op.differentiable:
        return {"fwd": jax.jit(lambda w, v, *a: call(*a))}
    grad = jax.grad(lambda *a, w: jnp.sum(w * call(*a)))
    return {
        "fwd": jax.jit(lambda w, v, *a: call(*a)),
        "grad": jax.jit(lambda w, v, *a: grad(*a, w=w)),
        "grad2": jax.jit(lambda w, v, *a: jax.grad(lambda *b: jnp.vdot(grad(*b, w=w), v))(*a)),
    }


def loss_weights(op, args, idx, m, dtype):
    """Random weights w shaped like op's output (a constant cotangent would let XLA skip reading
    it)."""
    shape = jax.eval_shape(lambda *a: op.reference(*a[:-1], a[-1], m, **op.params), *args,
                           idx).shape
    return jnp.asarray(np.random.default_rng(1).normal(size=shape), dtype)


def call_arguments(op, rng, idx, m, v, offsets, dtype):
    """(w, v, op's random arguments, idx, offsets): what each function of `functions` takes."""
    data = arguments(op, rng, idx.shape[0], m, dtype)
    return (loss_weights(op, data, idx, m, dtype), v, *data, idx, offsets)


def median_seconds(fns, args, repeats, dropped=False):
    """name -> (latency, throughput time) of fns[name](*args) in seconds (or why it fails), and
    with `dropped` a third time: that of a burst whose every result is dropped as the next
    call starts, as a training loop's are (XLA may then hand each call the buffers of the one
    before). The functions are called in turns, one call (or burst) of each per round, so that
    all see the same GPU clocks and load; each is first called twice (compilation) and then
    for `repeats` rounds unmeasured (warming the GPU)."""
    failed = {}
    latency, throughput, without = ({name: [] for name in fns} for _ in range(3))
    for name, fn in fns.items():
        try:
            for _ in range(2):
                jax.block_until_ready(fn(*args))
        except Exception as err:  # noqa: BLE001, PERF203 - nvalchemiops fails on some ops/modes; record it
            failed[name] = f"fails: {type(err).__name__}"
    running = {name: fn for name, fn in fns.items() if name not in failed}
    for measured in (False, True):
        for _ in range(repeats):
            for name, fn in running.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                middle = time.perf_counter()
                jax.block_until_ready([fn(*args) for _ in range(BURST)])
                end = time.perf_counter()
                if dropped:
                    out = None
                    for _ in range(BURST):
                        out = fn(*args)
                    jax.block_until_ready(out)
                if measured:
                    latency[name].append(middle - start)
                    throughput[name].append((end - middle) / BURST)
                    without[name].append((time.perf_counter() - end) / BURST)
    times = (latency, throughput, without) if dropped else (latency, throughput)
    return {**failed, **{name: tuple(statistics.median(t[name]) for t in times)
                         for name in running}}


def copy_rate(dtype, repeats):
    """Bytes per second of a large elementwise pass (read and write) on the default device
    (smaller on a CPU, where a burst of BURST calls holds BURST outputs at once)."""
    a = jnp.ones((1 << (27 if jax.default_backend() != "cpu" else 23),), dtype)
    scale = jax.jit(lambda a: a * 1.5)
    seconds = median_seconds({"copy": scale}, (a,), repeats)["copy"][1]
    return 2 * a.nbytes / seconds


def floor_bytes(fn, args, mode, layout):
    """Bytes a call must move: the arguments it reads (w for grad, w and v for grad2, then the
    op's own, the ids, and the offsets if given) and its result."""
    w, v, *rest, offsets = args
    if layout == "segments":
        rest.append(offsets)
    read = {"fwd": rest, "grad": [w, *rest], "grad2": [w, v, *rest]}[mode]
    out = jax.eval_shape(fn, *args)
    return (sum(a.nbytes for a in read)
            + sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(out)))


def implementations(names=("segcli", "jax", "nvalchemiops")):
    """The implementations of `names` that import here (segcli always)."""
    modules = {"segcli": "segcli.ops", "jax": "segcli.reference",
               "nvalchemiops": "nvalchemiops.jax.segment_ops"}
    return {name: module for name in ("segcli", *names)
            if (module := _imported(modules[name])) is not None}


def _imported(module):
    """The module, or None where it does not import here."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means it is not available here
        return None


def offsets_of(idx, m):
    """The CSR offsets (M+1,) int32 of sorted ids."""
    return jnp.asarray(np.searchsorted(np.asarray(idx), np.arange(m + 1)).astype(np.int32))


def compiled_program(fn, args):
    """The optimised program XLA compiles for fn(*args), without its source locations."""
    text = fn.lower(*args).compile().as_text()
    body = text[re.search(r"^(%|ENTRY)", text, re.MULTILINE).start():]
    return re.sub(r", metadata=\{[^}]*\}", "", body)


def same_program(fns, args):
    """Whether segcli's function and the pure-JAX one compile to the same program (as the
    second order of a linear op does: zeros), so that their times differ by noise alone."""
    return "jax" in fns and compiled_program(fns["segcli"], args) == compiled_program(
        fns["jax"], args)


def run(atoms, dtypes, repeats, ops, layout="ids", modes=MODES, impl_names=None):
    impls = implementations(*([impl_names] if impl_names else []))
    rows = []
    for dtype in dtypes:
        rng, idx, m, v = inputs(atoms, dtype)
        offsets = offsets_of(idx, m)
        rate = copy_rate(dtype, repeats)
        field = jnp.asarray(rng.normal(size=(atoms, 3)), dtype)
        rows.append(("(a pass)", dtype, "fwd", 2 * field.nbytes / rate,
                     median_seconds({"segcli": jax.jit(lambda a: a * 1.5)}, (field,), repeats),
                     False))
        for name in ops:
            op = OPS[name]
            args = call_arguments(op, rng, idx, m, v, offsets, dtype)
            per_impl = {impl: functions(module, op, m, layout) for impl, module in impls.items()}
            for mode in modes:
                fns = {impl: f[mode] for impl, f in per_impl.items() if mode in f}
                if fns:
                    floor = floor_bytes(fns["segcli"], args, mode, layout) / rate
                    rows.append((name, dtype, mode, floor, median_seconds(fns, args, repeats),
                                 same_program(fns, args)))
    return rows, list(impls), m


def fmt(t):
    return f"{t[0] * 1e6:.0f} / {t[1] * 1e6:.0f}" if isinstance(t, tuple) else t


def table(rows, impl_names):
    head = ("| op | dtype | mode | floor µs | " + " | ".join(f"{n} µs" for n in impl_names)
            + " | jax / segcli | segcli / floor | program |")
    lines = [head, "|" + " --- |" * (len(impl_names) + 7)]
    for op, dtype, mode, floor, times, same in rows:
        cells = [fmt(times.get(n, "—")) for n in impl_names]
        ours, theirs = times["segcli"], times.get("jax")
        ratio = (f"{theirs[1] / ours[1]:.2f}"
                 if isinstance(theirs, tuple) and isinstance(ours, tuple) else "—")
        over = f"{ours[1] / floor:.1f}" if isinstance(ours, tuple) else "—"
        lines.append(f"| {op} | {dtype} | {mode} | {floor * 1e6:.0f} | " + " | ".join(cells)
                     + f" | {ratio} | {over} | {'= jax' if same else ''} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=1_000_000)
    parser.add_argument("--dtype", default="float32,float64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
    parser.add_argument("--layout", choices=LAYOUTS, default="ids",
                        help="; ".join(f"{k}: {v}" for k, v in LAYOUTS.items()))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--impls", default="segcli,jax,nvalchemiops",
                        help="comma-separated implementations beside segcli")
    parser.add_argument("--out", help="also write the table (with its heading) to this file")
    args = parser.parse_args()
    dtypes = args.dtype.split(",")
    if "float64" in dtypes:
        jax.config.update("jax_enable_x64", True)
    rows, impl_names, m = run(args.atoms, dtypes, args.repeats, args.ops.split(","), args.layout,
                              args.modes.split(","), args.impls.split(","))
    device = jax.devices()[0]
    heading = (
        f"### {datetime.date.today()} — {device.device_kind} ({device.platform}), "
        f"N = {args.atoms:,} atoms, M = {m:,} structures, jax {jax.__version__}, "
        f"{platform.python_version()}\n\n"
        f"Segments: {LAYOUTS[args.layout]}. XLA_FLAGS: {os.environ.get('XLA_FLAGS') or 'none'}. "
        f"Each cell: latency / throughput time per call (bursts of {BURST}), medians of "
        f"{args.repeats}; ratios of throughput. Command: `python benchmarks/ops.py --atoms "
        f"{args.atoms} --dtype {args.dtype} --repeats {args.repeats} --layout {args.layout} "
        f"--modes {args.modes} --impls {args.impls}`\n\n"
    )
    text = heading + table(rows, impl_names) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
