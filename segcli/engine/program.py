"""The device side of a run: one jitted program per set of jobs (`_compiled`), started on a
padded chunk (`launch`) and waited for (`finish`); which devices take turns (`peers`).

    launched = launch(jobs, padded, jax.devices("cpu")[0])
    outputs, nan = finish(launched, chunk.structure_numbers)
"""

import functools

import numpy as np

from segcli.engine.checks import check_float64
from segcli.engine.jobs import reads, shows_nan


def runs_on(device):
    """Whether the kernels can run on `device` (a jax.Device): a Warp build without its CPU
    backend runs them on GPUs only."""
    from segcli.ops import kernels

    return device.platform != "cpu" or kernels.cpu_available()


def peers(device):
    """The devices that take turns at a run's chunks on `device`: for a CPU, the CPU devices
    of the process, as many as the threads it uses (threads.count(): a cluster worker its
    share) — one, unless XLA was started with several (the segcli program starts it with one
    a thread, up to HOST_DEVICES, see cli.common.device); else `device` alone."""
    import jax

    from segcli import threads

    if device.platform != "cpu":
        return [device]
    return jax.devices("cpu")[:threads.count()]


HOST_DEVICES = 4
"""The most CPU devices the segcli program starts XLA with: chunks in flight at once on a
CPU, each holding its buffers and results."""


def launch(jobs, padded, device):
    """Start computing the jobs' outputs for one padded chunk on `device` (a jax.Device), by
    one program, and return at once; `finish` waits for them. The NaN check runs there only
    for a chunk the host has not checked (see pipeline._Padded)."""
    import jax

    from segcli._jax import enable_x64

    read = reads(jobs)
    function = _compiled(tuple(job.program(read) for job in jobs), padded.device_checks_nan,
                         _pinned_outputs(device))
    with enable_x64(True):
        values, offsets = jax.device_put(
            (tuple(padded.arrays[name] for name in read), padded.offsets), device,
            may_alias=True)
        return jobs, padded, function(values, offsets, rows=padded.rows,
                                      num_segments=padded.segments)


def finish(launched, numbers, kept=None):
    """(Each job's outputs (label -> NumPy array, see Job.outputs), whether an input holds
    NaN) of a `launch` of the structures `numbers`; DataError where an integer result that a
    job gives as float64 (see Job.partial) is one that float64 does not hold exactly, in a
    structure that `kept` marks (None: any)."""
    jobs, padded, (out, nan) = launched
    out = [[np.asarray(o) for o in outputs] for outputs in out]
    rows = {"atom": slice(padded.skip, padded.skip + padded.n_rows),
            "structure": slice(padded.n_structures)}
    given = []
    for job, arrays in zip(jobs, out):
        given.append({})
        for (label, (per, _, dtype)), array in zip(job.outputs.items(), arrays):
            array = array[rows[per]]
            if dtype.kind == "f" and per == "structure":
                mask = slice(None) if kept is None else kept
                check_float64(job.path, f"the {job.spec.name} of '{job.fields[0]}'",
                              array[mask], numbers[mask])
            given[-1][label] = array.astype(dtype, copy=False)
    return tuple(given), bool(nan)


@functools.cache
def _pinned_outputs(device):
    """`device` where a chunk's program on it writes its outputs into its pinned host memory
    (see _compiled's `host_outputs`): an accelerator whose runtime offers that memory; else
    None (on CPUs the outputs are in host memory already)."""
    takes = device.platform != "cpu" and "pinned_host" in {
        memory.kind for memory in device.addressable_memories()}
    return device if takes else None


@functools.cache
def _compiled(programs, on_device=False, host_outputs=None):
    """A jitted function (values, offsets, rows, num_segments) -> (a tuple of outputs per
    program, see Job.program; whether a value holds NaN): the op's value (order 0), or the
    gradient (order 1) or Hessian-vector product along values[direction] (order 2) of
    Σ_s w_s · op_s, w = values[weights] or 1, with respect to the values `wrt`, over the
    segments of `offsets` (their ids expanded there, where a program reads them: XLA drops
    them where none does). With `on_device` the values are checked for NaN there; else the NaN
    flag says whether a value of a program that shows its inputs' NaN (Job.shows_nan) is
    NaN. With `host_outputs` (a device that offers it, see _pinned_outputs), the program
    writes its outputs into that device's pinned host memory itself: on an H100, a chunk's
    three results of 65 Ki structures come back in 0.1 ms, against 1.7 ms copied one by one
    into pageable NumPy arrays (benchmarks/RESULTS.md)."""
    import jax
    import jax.numpy as jnp

    from segcli import ops

    def outputs(program, values, idx, num_segments):
        spec, params, inputs, integers, precision, order, wrt, weights, direction = program

        def value(moving):
            given = dict(zip(wrt, moving))
            arrays = [given.get(k, values[k]) for k in inputs]
            unsigned = spec.integers and arrays[0].dtype == jnp.uint64
            out = spec.apply(*(_signed(a, spec) if unsigned and not i else a if kept
                               else a.astype(precision)
                               for i, (a, kept) in enumerate(zip(arrays, integers))),
                             idx=idx, num_segments=num_segments, indices_are_sorted=True,
                             **dict(params))
            return _unsigned(out, spec) if unsigned else out

        moving = tuple(values[k] for k in wrt)
        if order == 0:
            return (value(moving),)
        w = values[weights] if weights is not None else jnp.ones(num_segments, moving[0].dtype)

        def objective(moving):
            out = value(moving)
            if spec.output_per == "atom":
                return jnp.sum(ops.segmented_mul(out, w, idx, num_segments))
            return jnp.sum(out * w.reshape(-1, *(1,) * (out.ndim - 1)))

        if order == 1:
            return jax.grad(objective)(moving)
        return jax.jvp(jax.grad(objective), (moving,), ((values[direction],) * len(wrt),))[1]

    def all_outputs(values, offsets, rows, num_segments):
        idx = ops.segments_of_offsets(offsets, rows)
        together = _reduced_together(programs, values, idx, num_segments)
        out = tuple(together[i] if i in together else outputs(p, values, idx, num_segments)
                    for i, p in enumerate(programs))
        seen = values if on_device else [o for p, results in zip(programs, out)
                                         if shows_nan(p.op, p.order) for o in results
                                         if jnp.issubdtype(o.dtype, jnp.floating)]
        nan = jnp.any(jnp.stack([jnp.isnan(v).any() for v in seen])) if seen \
            else jnp.zeros((), bool)
        return out, nan

    placed = {} if host_outputs is None else {"out_shardings": jax.sharding.SingleDeviceSharding(
        host_outputs, memory_kind="pinned_host")}
    return jax.jit(all_outputs, static_argnames=("rows", "num_segments"), **placed)


def _reduced_together(programs, values, idx, num_segments):
    """{index: (value,)} of the programs (see _compiled) that are plain reductions among
    ops.REDUCTIONS (order 0, no parameters) of a float field in a precision that two or more
    of them reduce: each such group by one ops.segmented_reductions, which reads the rows once
    for all of them on CPUs, with the bits each op gives alone."""
    from segcli import ops

    groups = {}
    for i, p in enumerate(programs):
        if (p.order == 0 and not p.params and p.op.name in ops.REDUCTIONS
                and not any(p.integers)):
            groups.setdefault((p.inputs[0], p.precision), []).append(i)
    together = {}
    for (name, precision), members in groups.items():
        if len(members) > 1:
            results = ops.segmented_reductions(
                values[name].astype(precision), idx, num_segments,
                tuple(programs[i].op.name for i in members), indices_are_sorted=True)
            together.update({i: (result,) for i, result in zip(members, results)})
    return together


_SIGN = -(2 ** 63)


def _signed(x, op):
    """uint64 `x` as the int64 that the op (sum, max or min: the library reduces signed
    integers) reduces in its place: its bits for the sum (which wraps alike), its bits with
    the sign bit flipped (the order kept) for the others; _unsigned undoes it."""
    import jax

    bits = jax.lax.bitcast_convert_type(x, np.int64)
    return bits if op.name == "sum" else bits ^ _SIGN


def _unsigned(out, op):
    """The uint64 result of `op` over the uint64 values `_signed` gave it as int64."""
    import jax

    return jax.lax.bitcast_convert_type(out if op.name == "sum" else out ^ _SIGN, np.uint64)
