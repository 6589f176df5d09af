"""One way to run work over a batch's structures, whichever way it runs: units of whole
structures (runs of leaves, see segcli.shards) → map (a function over one unit) → combine
(the units' results joined in unit order: statistics) or sink (the units' rows written in
structure order through a segcli.io.sinks sink: reduce, grad, neighbors).

A unit is the selection (in this process), one `--shard I/N` of it (in this process, into
its part file) or one of several shards that tasks of a dask.distributed cluster compute
(segcli.cluster gives the client). Units cut only at leaf boundaries, and every result is
joined in leaf order, so the number of units never changes a bit of it.

    units = plan(batch.n_atoms, leaves, client)
    parts = run(units, stats_of_unit, (batch, ["energy"], None, {}), client=client,
                combine=join_leaves)
"""

import contextlib
import itertools
import os
from typing import NamedTuple

import numpy as np

from segcli import cluster
from segcli.io import sinks
from segcli.io.core import Batch, Chunk
from segcli.shards import even_cuts


class Unit(NamedTuple):
    """Unit `index` of `count`: the structures between the leaf boundaries `leaves`
    (structure numbers), `size` of them counted by progress (those a selection keeps); `into`
    where it writes its rows (a sink, a part file's path or a segcli.io.writers.RowsInto;
    None where it returns what it computes)."""

    index: int
    count: int
    leaves: tuple
    size: int
    into: object = None

    @property
    def lo(self):
        return self.leaves[0]

    @property
    def hi(self):
        return self.leaves[-1]

    @property
    def name(self):
        """How messages name the unit: shard 2 of 8."""
        return f"shard {self.index + 1} of {self.count}"


def split(n_atoms, leaves, parts, keep=None):
    """The units cutting the structures between the leaf boundaries `leaves` into at most
    `parts` runs of whole leaves with nearly equal atom counts (see segcli.shards.even_cuts:
    the cuts of segcli.shards.shard_bounds), at least one; `n_atoms` each structure's atoms,
    `keep` ((S,) bool), if given, the structures counted.

    >>> [u.leaves for u in split(np.array([1, 1, 2]), [0, 1, 2, 3], 2)]
    [(0, 1, 2), (2, 3)]
    """
    leaves = np.asarray(leaves, np.int64)
    parts = max(1, min(int(parts), len(leaves) - 1))
    running = np.concatenate([[0], np.cumsum(n_atoms[leaves[0]:leaves[-1]], dtype=np.int64)])
    cuts = even_cuts(np.diff(running[leaves - leaves[0]]), parts)
    runs = [tuple(leaves[a:b + 1].tolist()) for a, b in itertools.pairwise(cuts)]
    sizes = [hi - lo if keep is None else int(np.count_nonzero(keep[lo:hi]))
             for lo, hi in ((run[0], run[-1]) for run in runs)]
    return [Unit(k, len(runs), run, size) for k, (run, size) in enumerate(zip(runs, sizes))]


def plan(n_atoms, leaves, client=None, keep=None):
    """The units of a run over the leaves `leaves` (see split): one here (`client` None), a
    few per worker thread of `client`'s cluster (segcli.cluster.shard_count).

    >>> len(plan(np.array([1, 1, 2]), [0, 1, 2, 3]))
    1
    """
    parts = 1 if client is None else cluster.shard_count(client, len(leaves) - 1)
    return split(n_atoms, leaves, parts, keep)


def run(units, work, args=(), *, client=None, progress=None, combine=None, sink=None):
    """`work(*args, unit, progress)` for each of `units`: here, one after another, each told
    `progress` (it calls `progress.update(n)` as n more structures are done); or as one task
    each on `client`'s cluster, `args` sent once (a Batch among them as its layout, which
    `reading` opens), told None, each unit's `size` counted as its task ends. Each result
    goes to `sink(unit, result)` in unit order, as soon as those before it have come, while
    the others compute. Returns `combine(results in unit order)`, or that list without
    `combine`. The first unit to raise DataError raises it here, in the same words wherever
    it ran; tasks not yet done are cancelled however the run ends (an error, Ctrl-C).

    >>> run(split(np.ones(4, int), [0, 1, 2, 3, 4], 2), lambda unit, progress: unit.size)
    [2, 2]
    """
    done = _as_done(units, work, tuple(args), client, progress)
    with contextlib.closing(done):
        results = []
        for k, result in in_order(done):
            if sink is not None:
                sink(units[k], result)
            results.append(result)
    return combine(results) if combine is not None else results


def _as_done(units, work, args, client, progress):
    """(k, the result of unit k) as each unit ends (see run)."""
    if client is None:
        for k, unit in enumerate(units):
            yield k, work(*args, unit, progress)
        return
    sent = (work, *(a.layout if isinstance(a, Batch) else a for a in args))
    portable = cluster.shared(client, sent)
    calls = [(portable, unit) for unit in units]
    tasks = cluster.shards_as_done(client, _unit_task, calls, [u.name for u in units])
    with contextlib.closing(tasks):  # cancels the tasks left when the run stops early
        for k, result in tasks:
            if progress is not None:
                progress.update(units[k].size)
            yield k, result


def _unit_task(work_args, unit):
    """One unit as a task: `work(*args, unit, None)` of `work_args` (work, *args)."""
    work, *args = work_args
    return work(*args, unit, None)


def in_order(done):
    """The (k, value) pairs of `done`, which come in any order of k = 0, 1, ..., in that
    order: each as soon as every pair before it has come.

    >>> list(in_order([(1, "b"), (0, "a")]))
    [(0, 'a'), (1, 'b')]
    """
    waiting, next_k = {}, 0
    for k, value in done:
        waiting[k] = value
        while next_k in waiting:
            yield next_k, waiting.pop(next_k)
            next_k += 1


@contextlib.contextmanager
def reading(source):
    """The batch a unit reads: `source` itself (here), or the batch its layout describes,
    opened (in a task; see segcli.io.open_inputs).

    >>> with reading(batch) as same:
    ...     same is batch
    True
    """
    if isinstance(source, Batch):
        yield source
        return
    from segcli.io import open_inputs

    with open_inputs(source) as batch:
        yield batch


def write_rows(units, work, args, target, results, batch, attrs, keep=None, client=None,
               progress=None):
    """Run `units` (see run) whose `work(*args, unit, progress)` writes the rows of the
    `results` (a computation: datasets, outputs, attributes) of its structures into
    `unit.into` and returns the label of the device it computed on, so that `target` (a
    segcli.io.sinks.Target) gets what one pass over them writes, `attrs` and the device's
    label its datasets' attributes, `keep` ((S,) bool), if given, the structures computed.
    Here (`client` None), the one unit (see plan) writes into the sink of `target`, which it
    enters and leaves (attrs name the device already). On `client`'s cluster, into an HDF5 file:
    this process makes the output and each task writes its rows straight into it; into a
    stream (or memory): each task writes a part file into a temporary directory beside the
    output, passed on in structure order as it comes, while the others compute. Returns (the
    first unit's device label, the arrays a memory target kept, else None).

        label, arrays = write_rows(plan(batch.n_atoms, leaves), compute_unit, args,
                                   sinks.choose(None, False, None, False), computation,
                                   batch, {"device": "cpu"})
    """
    lo, hi = units[0].lo, units[-1].hi
    if client is None:
        sink = sinks.open_sink(target, results, batch, lo, hi, attrs, keep)
        labels = run([u._replace(into=sink) for u in units], work, args, progress=progress)
        return labels[0], sink.arrays() if isinstance(sink, sinks.Collect) else None
    from segcli.io.outputs import scratch_directory

    bounds = [unit.lo - lo for unit in units] + [hi - lo]
    kept = []
    with contextlib.ExitStack() as opened:
        if target.sink.hdf5:
            sink = opened.enter_context(sinks.open_sink(target, results, batch, lo, hi, attrs,
                                                        keep, placed=True))
            places = sink.rows_of_shards(bounds)
            device = _RowsWritten(sink, lo)
        else:
            parts_dir = opened.enter_context(scratch_directory(
                os.path.dirname(os.path.abspath(target.path)) if target.path else os.getcwd()))
            places = [os.path.join(parts_dir, f"part-{k}.h5") for k in range(len(units))]

            def open_stream(label):
                kept.append(opened.enter_context(sinks.open_sink(
                    target, results, batch, lo, hi, {**attrs, "device": label}, keep)))
                return kept[0]

            device = _PartsPassedOn(results.outputs, keep, open_stream)
        run([u._replace(into=place) for u, place in zip(units, places)], work, args,
            client=client, progress=progress, sink=device)
        device.finish()
    return device.first, kept[0].arrays() if kept and isinstance(kept[0], sinks.Collect) \
        else None


class _RowsWritten:
    """The sink of units that wrote their rows into the file of `sink` (an Hdf5Sink of the
    structures from `start`): they get no fill; the results' attribute `device` is the first
    unit's (`first`)."""

    def __init__(self, sink, start):
        self.sink, self.start, self.first = sink, start, None

    def __call__(self, unit, label):
        if self.first is None:
            self.sink.add_attrs({"device": label})
            self.first = label
        self.sink.written_elsewhere(unit.lo - self.start, unit.hi - self.start)

    def finish(self):
        """Every unit is in."""


class _PartsPassedOn:
    """The sink of units that each wrote a part file (unit.into): checked, its rows written in
    structure order into the stream `open_stream(device label)` opens as the first comes; the
    rows of structures `keep` leaves out dropped. `first`: the first unit's device label."""

    def __init__(self, outputs, keep, open_stream):
        self.outputs, self.keep, self.open_stream = outputs, keep, open_stream
        self.parts, self.stream, self.first = [], None, None

    def __call__(self, unit, label):
        from segcli.io.merge import describe_part, part_rows

        self.parts.append(describe_part(unit.into, like=self.parts[0] if self.parts else None))
        if self.stream is None:
            self.stream, self.first = self.open_stream(label), label
        for start, counts, rows in part_rows([self.parts[-1]], list(self.outputs)):
            chunk = Chunk(start, counts, {}, {})
            if self.keep is not None:
                chunk, rows = _kept_rows(chunk, rows, self.outputs, self.keep)
            if len(chunk.n_atoms):
                self.stream.write(chunk, rows)

    def finish(self):
        from segcli.io.merge import check_cover

        check_cover(self.parts)


def _kept_rows(chunk, rows, outputs, keep):
    """(the chunk's structures that `keep` ((S,) bool) marks, their rows of each dataset of
    `rows`, in its dtype of `outputs`): a part's NaN rows of structures not selected left out."""
    mask = keep[chunk.start:chunk.start + len(chunk.n_atoms)]
    atoms = np.repeat(mask, chunk.n_atoms)
    return chunk.take(mask), {d: r[mask if outputs[d][0] == "structure" else atoms].astype(
        outputs[d][2], copy=False) for d, r in rows.items()}
