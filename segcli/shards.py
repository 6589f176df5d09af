"""Shards: contiguous ranges of whole structures that runs on several machines or processes
take one each, and what ties their outputs (parts) to the input and to each other.

The split is built on a canonical grid of leaves (at most LEAVES runs of whole structures
with nearly equal atom counts, fixed by the selection alone): shards cut only at leaf
boundaries, and statistics reduce leaf by leaf in a fixed tree, so any split into shards
gives the same bits as one run.

    bounds = shard_bounds(n_atoms, 4)         # 5 structure boundaries
    index, count = shard_from_env()           # --shard auto under SLURM, Open MPI or PMI
"""

import hashlib
import json
import os

import numpy as np

LEAVES = 1024
"""At most this many leaves; a selection of fewer structures has one leaf per structure."""

ENVIRONMENTS = (
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)
"""(index, count) variables that --shard auto reads, first set first (a SLURM array's index
counts from SLURM_ARRAY_TASK_MIN)."""


def even_cuts(n_atoms, parts):
    """The parts + 1 boundaries cutting items of `n_atoms` atoms (structures, or leaves) where
    the running count first reaches k·total/parts."""
    return _even_cuts(np.cumsum(n_atoms, dtype=np.int64), parts)


def _even_cuts(running, parts):
    """even_cuts, given the running counts."""
    total = int(running[-1]) if len(running) else 0
    targets = np.arange(1, parts, dtype=np.int64) * total // parts
    cuts = np.searchsorted(running, targets, side="left") + 1
    return np.array([0, *np.minimum(cuts, len(running)).tolist(), len(running)], np.int64)


def leaf_bounds(n_atoms):
    """Boundaries of the leaves of a selection of structures with `n_atoms` atoms: one leaf per
    structure up to LEAVES structures, else LEAVES runs of nearly equal atom counts (some
    empty where one structure outweighs several leaves)."""
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
    first leaf where the running count reaches (k + 1)·total/shards."""
    running = np.cumsum(n_atoms, dtype=np.int64)
    return _shard_leaves(running, _leaves(running), shards)


def shard_bounds(n_atoms, shards):
    """The shards + 1 structure boundaries splitting structures of `n_atoms` atoms into
    contiguous ranges of whole structures with nearly equal atom counts, at leaf boundaries
    (see shard_leaves): the same split on every machine. More shards than structures leave
    some empty. One array as long as the structures is made (their running counts)."""
    running = np.cumsum(n_atoms, dtype=np.int64)
    leaves = _leaves(running)
    return leaves[_shard_leaves(running, leaves, shards)].tolist()


MOST_SHARDS = 1 << 22
"""The most shards a job is cut into (a SLURM array holds at most 4 Mi tasks)."""


def parse_shard(text, environ=os.environ):
    """(index, count) from "I/N" (0 <= I < N) or "auto" (see ENVIRONMENTS); ValueError
    saying what is wrong."""
    if text == "auto":
        for index_name, count_name in ENVIRONMENTS:
            if index_name in environ and count_name in environ:
                index, count = environ[index_name], environ[count_name]
                first = environ.get("SLURM_ARRAY_TASK_MIN", "0") if index_name.startswith(
                    "SLURM_ARRAY") else "0"
                try:
                    index, count = int(index) - int(first), int(count)
                except ValueError:
                    raise ValueError(f"{index_name}={index!r}, {count_name}={count!r} are not "
                                     "integers") from None
                if not 0 <= index < count:
                    raise ValueError(f"{index_name} gives shard {index}, outside 0 to "
                                     f"{count - 1} ({count_name}={count})")
                if count > MOST_SHARDS:
                    raise ValueError(f"{count_name}={count} is more than {MOST_SHARDS} shards")
                return index, count
        names = ", ".join(f"{i}/{c}" for i, c in ENVIRONMENTS)
        raise ValueError(f"auto needs one of {names} in the environment; none is set")
    index, slash, count = text.partition("/")
    if not slash or not index.isdigit() or not count.isdigit():
        raise ValueError(f"expected I/N (e.g. 3/16) or auto, got {text!r}")
    index, count = int(index), int(count)
    if not 0 <= index < count:
        raise ValueError(f"expected I/N with 0 <= I < N, got {text!r}")
    if count > MOST_SHARDS:
        raise ValueError(f"{text!r} has more than {MOST_SHARDS} shards")
    return index, count


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
