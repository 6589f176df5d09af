"""Shards: contiguous ranges of whole structures that runs on several machines or processes
take one each, and what ties their outputs (parts) to the input and to each other.

The split is built on a canonical grid of leaves (at most LEAVES runs of whole structures
with nearly equal atom counts, fixed by the selection alone): shards cut only at leaf
boundaries, and statistics reduce leaf by leaf in a fixed tree, so any split into shards
gives the same bits as one run.

    bounds = shard_bounds(n_atoms, 4)         # 5 structure boundaries
    index, count = parse_shard("auto")       # from SLURM, SGE, Open MPI or PMI
"""

import hashlib
import json
import os

import numpy as np

LEAVES = 1024
"""At most this many leaves; a selection of fewer structures has one leaf per structure."""

ARRAYS = (
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX",
     "SLURM_ARRAY_TASK_STEP", "SLURM_ARRAY_TASK_COUNT"),
    ("SGE_TASK_ID", "SGE_TASK_FIRST", "SGE_TASK_LAST", "SGE_TASK_STEPSIZE", None),
)
"""Job arrays that --shard auto follows, first set first: (task id, first id, last id, step,
number of tasks) variables. Task ids first, first + step, … are shards 0, 1, …; the last id or
the number of tasks must be set, and where both are they must agree. A task id "undefined"
(SGE's outside an array job) is none."""

WORLDS = (
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)
"""Processes started together that --shard auto follows: (rank, size) variables of an srun
step (not the batch script, which srun's SLURM_STEP_NUM_TASKS leaves out), Open MPI and PMI
(MPICH, Intel MPI), each present where its size is set; where several are, they must agree."""

LAUNCHER_VARIABLES = tuple(name for names in ARRAYS + WORLDS for name in names if name)
"""Every variable --shard auto reads."""


def even_cuts(n_atoms, parts):
    """The parts + 1 boundaries cutting items of `n_atoms` atoms (structures, or leaves) into
    contiguous runs of nearly equal atom counts (see _even_cuts)."""
    return _even_cuts(np.cumsum(n_atoms, dtype=np.int64), parts)


def _even_cuts(running, parts):
    """even_cuts, given the running counts: cut k at the item boundary nearest to k·total/parts
    atoms (exactly, the earlier one on a tie), then, where there are at least as many items as
    parts, moved on (near the end, back) just far enough that no run is empty. So a run holds
    at most twice its share of atoms unless it is one item, and runs are empty only where the
    items are fewer than the parts. Cheap: one search per part in the running counts."""
    n, total = len(running), int(running[-1]) if len(running) else 0
    if n == 0:
        return np.zeros(parts + 1, np.int64)
    k = np.arange(1, parts, dtype=np.int64)
    # k·total/parts = whole + part/parts, without forming k·total
    whole = k * (total // parts) + k * (total % parts) // parts
    part = k * (total % parts) % parts
    # the first boundary at or past the ideal cut (boundary b has running[b - 1] atoms before)
    above = np.searchsorted(running, whole + (part > 0), side="left") + 1
    above = np.minimum(above, n)
    below_atoms = np.where(above > 1, running[np.maximum(above - 2, 0)], 0)
    above_atoms = running[above - 1]
    # nearer the boundary below when 2·ideal <= its atoms + the boundary above's atoms
    nearer_below = 2 * whole - below_atoms - above_atoms <= -((2 * part + parts - 1) // parts)
    cuts = np.concatenate([[0], above - nearer_below, [n]]).astype(np.int64)
    if n >= parts:
        steps = np.arange(parts + 1, dtype=np.int64)
        cuts = steps + np.minimum(np.maximum.accumulate(cuts - steps), n - parts)
    return cuts


def leaf_bounds(n_atoms):
    """Boundaries of the leaves of a selection of structures with `n_atoms` atoms: one leaf per
    structure up to LEAVES structures, else LEAVES runs of nearly equal atom counts (see
    even_cuts: none empty, none over twice its share unless one structure)."""
    return _leaves(np.cumsum(n_atoms, dtype=np.int64))


def _leaves(running):
    """leaf_bounds, given the running counts."""
    if len(running) <= LEAVES:
        return np.arange(len(running) + 1, dtype=np.int64)
    return _even_cuts(running, LEAVES)


def _shard_leaves(running, leaves, shards):
    """shard_leaves, given the running counts and the leaves: one pass over the leaves, none
    over the structures."""
    ends = running[leaves[1:] - 1] if len(running) else np.zeros(0, np.int64)
    return even_cuts(np.diff(ends, prepend=0), shards)


def shard_leaves(n_atoms, shards):
    """The shards + 1 leaf numbers splitting the leaves (see leaf_bounds) of structures of
    `n_atoms` atoms into contiguous ranges with nearly equal atom counts: range k ends at the
    leaf boundary nearest to (k + 1)·total/shards atoms (see even_cuts)."""
    running = np.cumsum(n_atoms, dtype=np.int64)
    return _shard_leaves(running, _leaves(running), shards)


def shard_bounds(n_atoms, shards):
    """The shards + 1 structure boundaries splitting structures of `n_atoms` atoms into
    contiguous ranges of whole structures with nearly equal atom counts, at leaf boundaries
    (see shard_leaves): the same split on every machine. Only more shards than leaves (than
    structures, or than LEAVES) leave some empty. One array as long as the structures is made
    (their running counts)."""
    running = np.cumsum(n_atoms, dtype=np.int64)
    leaves = _leaves(running)
    return leaves[_shard_leaves(running, leaves, shards)].tolist()


MOST_SHARDS = 1 << 22
"""The most shards a job is cut into (a SLURM array holds at most 4 Mi tasks)."""


def parse_shard(text, environ=os.environ):
    """(index, count) from "I/N" (0 <= I < N) or "auto" (see _launcher_shard); ValueError
    saying what is wrong."""
    if text == "auto":
        return _launcher_shard(environ)
    index, slash, count = text.partition("/")
    if not slash or not index.isdigit() or not count.isdigit():
        raise ValueError(f"expected I/N (e.g. 3/16) or auto, got {text!r}")
    index, count = int(index), int(count)
    if not 0 <= index < count:
        raise ValueError(f"expected I/N with 0 <= I < N, got {text!r}")
    if count > MOST_SHARDS:
        raise ValueError(f"{text!r} has more than {MOST_SHARDS} shards")
    return index, count


def _launcher_shard(environ):
    """(index, count) for --shard auto: this task's place in its job array (ARRAYS) and this
    process's among those started together (WORLDS), either or both: task a of A running
    processes r of W does shard a·W + r of A·W. Every launched process gets a different shard,
    and together they do all of them; ValueError naming the variable where one is missing,
    malformed or contradicts another."""
    array, world = _array_task(environ), _world(environ)
    if array is None and world is None:
        names = ", ".join([names[0] for names in ARRAYS] + [f"{r}/{s}" for r, s in WORLDS])
        raise ValueError(f"auto needs one of {names} in the environment; none is set "
                         "(SLURM_PROCID counts under srun only)")
    (task, tasks), (rank, size) = array or (0, 1), world or (0, 1)
    if tasks * size > MOST_SHARDS:
        raise ValueError(f"auto gives {tasks} array tasks of {size} processes: more than "
                         f"{MOST_SHARDS} shards")
    return task * size + rank, tasks * size


def _whole(environ, name):
    """The number in variable `name`: ASCII digits only (no sign, space or '_'), at most 18."""
    text = environ[name]
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        raise ValueError(f"{name}={text[:40]!r} is not a whole number below 10^18")
    return int(text)


def _array_task(environ):
    """(shard, shards) of this task in the first job array of ARRAYS whose task id is set, or
    None."""
    for task_id, first, last, step, count in ARRAYS:
        if environ.get(task_id, "undefined") == "undefined":
            continue
        given = {name: _whole(environ, name) for name in (task_id, first, last, step, count)
                 if name and name in environ}
        if first not in given or not ({last, count} & given.keys()):
            needs = first if first not in given else " or ".join(filter(None, (last, count)))
            raise ValueError(f"{task_id} is set but not {needs}")
        low, stride = given[first], given.get(step, 1)
        if stride == 0:
            raise ValueError(f"{step}=0 is no step")
        if last in given and given[last] < low:
            raise ValueError(f"{last}={given[last]} is below {first}={low}")
        tasks = (given[last] - low) // stride + 1 if last in given else given[count]
        if count in given and given[count] != tasks:
            by = f"{step}={stride}" if step in given else "step 1"
            raise ValueError(f"{count}={given[count]}, but {first}={low}, {last}={given[last]} "
                             f"and {by} make {tasks} tasks (ids not evenly spaced?)")
        ident = given[task_id]
        if tasks == 0 or not low <= ident <= low + stride * (tasks - 1) or (ident - low) % stride:
            raise ValueError(f"{task_id}={ident} is not one of the {tasks} ids from {first}={low} "
                             f"by {stride}")
        return (ident - low) // stride, tasks
    return None


def _world(environ):
    """(rank, size) of this process among those started together (WORLDS), or None."""
    found = []
    for rank_name, size_name in WORLDS:
        if size_name not in environ:
            continue
        if rank_name not in environ:
            raise ValueError(f"{size_name} is set but not {rank_name}")
        rank, size = _whole(environ, rank_name), _whole(environ, size_name)
        if not rank < size:
            raise ValueError(f"{rank_name} gives shard {rank}, outside 0 to {size - 1} "
                             f"({size_name}={size})")
        found.append(((rank, size), f"{rank_name}={rank}, {size_name}={size}"))
    for place, said in found[1:]:
        if place != found[0][0]:
            raise ValueError(f"{found[0][1]} but {said}: which launcher started this process? "
                             "Give --shard I/N")
    return found[0][0] if found else None


def part_path(pattern, index, count):
    """`pattern` with {shard} replaced by `index`, zero-padded to the width of count - 1."""
    return pattern.replace("{shard}", str(index).zfill(len(str(count - 1))))


def fingerprint(paths, n_atoms):
    """A short hash identifying the input: its files' real paths, sizes and modification times
    (in ns), and the atoms of every structure (what parts of one input must share). It changes
    when a file is rewritten or touched; nothing but the structures' sizes is read."""
    files = [(os.path.realpath(p), (info := os.stat(p)).st_size, info.st_mtime_ns)
             for p in paths]
    digest = hashlib.sha256(json.dumps(files).encode())
    digest.update(np.ascontiguousarray(n_atoms, np.int64))  # its buffer, not a copy
    return digest.hexdigest()[:32]


def shard_of(n_atoms, start, shard=None):
    """The leaf boundaries (structure numbers, from `start`) of shard (I, N) of a selection of
    structures with `n_atoms` atoms starting at structure `start`, or of all of it."""
    leaves = start + leaf_bounds(n_atoms)
    if shard is None:
        return leaves
    index, count = shard
    cuts = shard_leaves(n_atoms, count)
    return leaves[cuts[index]:cuts[index + 1] + 1]
