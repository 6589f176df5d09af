"""--shard auto follows the launcher: every task or process a job array, srun, Open MPI or PMI
starts gets a different shard of the same N, and together they do all N; what is malformed or
contradictory is refused. And the split itself: whole structures, balanced by atoms however
lopsided the sizes, the same in every task (that parts of more shards than structures, some
empty, merge into one run is test_shards' test_merged_shards_equal_one_run_bit_for_bit)."""

import bisect
import itertools
from fractions import Fraction

import numpy as np
import pytest
from click.testing import CliRunner

from segcli.cli import main
from segcli.shards import LAUNCHER_VARIABLES, leaf_bounds, parse_shard, shard_bounds, shard_of


def slurm_array(ids, step=1, count=True, last=None):
    """The environments of the tasks of `sbatch --array=ids[0]-last:step` (last defaults to
    the last id, as Slurm sets SLURM_ARRAY_TASK_MAX)."""
    common = {"SLURM_ARRAY_TASK_MIN": str(ids[0]), "SLURM_ARRAY_TASK_MAX": str(last or ids[-1]),
              "SLURM_ARRAY_TASK_STEP": str(step), "SLURM_ARRAY_JOB_ID": "900",
              # what the batch script of any job holds, srun or not
              "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    if count:
        common["SLURM_ARRAY_TASK_COUNT"] = str(len(ids))
    return [{**common, "SLURM_ARRAY_TASK_ID": str(i)} for i in ids]


def sge_array(first, last, step):
    """The environments of the tasks of `qsub -t first-last:step`."""
    common = {"SGE_TASK_FIRST": str(first), "SGE_TASK_LAST": str(last),
              "SGE_TASK_STEPSIZE": str(step)}
    return [{**common, "SGE_TASK_ID": str(i)} for i in range(first, last + 1, step)]


def world(rank, size, n, outer=None):
    """The environments of `n` processes started together, each of the `outer` environments
    (one, empty, by default) running them all."""
    return [{**o, rank: str(r), size: str(n)} for o in outer or [{}] for r in range(n)]


BATCH = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
"""A batch script's own Slurm variables: no srun step (SLURM_STEP_NUM_TASKS is srun's)."""

LAUNCHES = {
    "sbatch --array=0-14:2": (slurm_array(range(0, 15, 2), step=2), 8),
    "sbatch --array=1-8": (slurm_array(range(1, 9)), 8),
    "sbatch --array=3-20:5 (MAX the last id)": (slurm_array(range(3, 21, 5), step=5), 4),
    "sbatch --array=3-20:5 (MAX as given)": (slurm_array(range(3, 21, 5), step=5, last=20), 4),
    "sbatch --array=7": (slurm_array([7]), 1),
    "sbatch --array=2-9:3, Slurm without COUNT": (slurm_array([2, 5, 8], 3, count=False), 3),
    "qsub -t 1-10:3": (sge_array(1, 10, 3), 4),
    "qsub -t 2-11:3": (sge_array(2, 11, 3), 4),
    "srun -n 5": ([{**e, "SLURM_NTASKS": "5"} for e in world(
        "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", 5, [BATCH])], 5),
    "srun --preserve-env -n 4 in an allocation of 8": (world(
        "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", 4, [BATCH]), 4),
    "srun --mpi=pmi2 -n 3": ([{**e, "PMI_RANK": e["SLURM_PROCID"], "PMI_SIZE": "3"} for e in
                              world("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", 3, [BATCH])], 3),
    "mpirun -np 6 in a batch script": (world(
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", 6, [BATCH]), 6),
    "mpiexec (Hydra) -n 3": (world("PMI_RANK", "PMI_SIZE", 3), 3),
    "mpirun -np 2 in an SGE job that is no array": (world(
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", 2, [{"SGE_TASK_ID": "undefined"}]), 2),
    "sbatch --array=1-3 running srun -n 2": (world(
        "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", 2, slurm_array([1, 2, 3])), 6),
    "qsub -t 5-7 running mpirun -np 4": (world(
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", 4, sge_array(5, 7, 1)), 12),
}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_the_tasks_of_a_launch_do_each_shard_once(launch):
    tasks, shards = LAUNCHES[launch]
    places = [parse_shard("auto", environ) for environ in tasks]
    assert {count for _, count in places} == {shards}
    assert [index for index, _ in places] == list(range(shards))  # in launch order, each once


def usage_error(environ):
    """The --shard auto error of `reduce` under `environ` (no other launcher variable set)."""
    env = dict.fromkeys(LAUNCHER_VARIABLES) | environ
    result = CliRunner().invoke(main, ["reduce", "no-such-file.h5", "sum", "forces", "--shard",
                                       "auto"], env=env)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert len(errors) == 1, result.output
    return errors[0]


SLURM = {"SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "14", "SLURM_ARRAY_TASK_STEP": "2",
         "SLURM_ARRAY_TASK_COUNT": "8"}
SGE = {"SGE_TASK_FIRST": "1", "SGE_TASK_LAST": "10", "SGE_TASK_STEPSIZE": "3"}


@pytest.mark.parametrize("environ, needles", [
    *[({**SLURM, "SLURM_ARRAY_TASK_ID": bad}, [f"SLURM_ARRAY_TASK_ID={bad!r}"])
      for bad in ["1_0", "-2", "", "four", " 4", "+4", "\u0664", "4.0", "9" * 19]],
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "16"}, ["SLURM_ARRAY_TASK_ID=16", "8 ids"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "5"}, ["SLURM_ARRAY_TASK_ID=5", "by 2"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "6"},
     ["SLURM_ARRAY_TASK_COUNT=8", "5 tasks"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "3"},
     ["SLURM_ARRAY_TASK_COUNT=3", "SLURM_ARRAY_TASK_STEP=2", "8 tasks"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_STEP": "0"},
     ["SLURM_ARRAY_TASK_STEP=0"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MAX": "-1"},
     ["SLURM_ARRAY_TASK_MAX='-1'"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "3",
      "SLURM_ARRAY_TASK_MAX": "1"}, ["SLURM_ARRAY_TASK_MAX=1", "below SLURM_ARRAY_TASK_MIN=3"]),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "8"}, ["not SLURM_ARRAY_TASK_MIN"]),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0"},
     ["not SLURM_ARRAY_TASK_MAX or SLURM_ARRAY_TASK_COUNT"]),
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "0"},
     ["SLURM_ARRAY_TASK_ID=0", "0 ids"]),
    ({**SGE, "SGE_TASK_ID": "5"}, ["SGE_TASK_ID=5", "by 3"]),
    ({**SGE, "SGE_TASK_ID": "1_0"}, ["SGE_TASK_ID='1_0'"]),
    ({**SGE, "SGE_TASK_ID": "4", "SGE_TASK_LAST": ""}, ["SGE_TASK_LAST=''"]),
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "2"}, ["SLURM_PROCID gives shard 2"]),
    ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, ["SLURM_PROCID='x'"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, ["OMPI_COMM_WORLD_SIZE=0"]),
    ({"PMI_SIZE": "4"}, ["PMI_SIZE is set but not PMI_RANK"]),
    ({"PMI_RANK": "1", "PMI_SIZE": "1_6"}, ["PMI_SIZE='1_6'"]),
    # a multi-node mpirun: ranks inherit the node's srun step, of other numbers
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "OMPI_COMM_WORLD_RANK": "5",
      "OMPI_COMM_WORLD_SIZE": "8"}, ["SLURM_PROCID=1", "OMPI_COMM_WORLD_RANK=5", "--shard I/N"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, ["none is set", "under srun"]),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MAX": "8388606",
      "SLURM_ARRAY_TASK_COUNT": "4194304", "PMI_RANK": "0", "PMI_SIZE": "2"},
     ["4194304 array tasks of 2 processes", "more than 4194304 shards"]),
])
def test_malformed_or_contradicting_launcher_variables_are_one_line_usage_errors(environ,
                                                                                 needles):
    error = usage_error(environ)
    assert all(needle in error for needle in needles), (needles, error)


def brute_force_checks(n_atoms, shards):
    """shard_bounds against what a split must be, checked by loops: whole structures covering
    every one once, at leaf boundaries, each cut at the leaf boundary nearest its ideal unless
    a shard beside it holds a single leaf, none empty unless there are fewer leaves than
    shards, none over twice its share unless one structure (or, past LEAVES shards, one leaf);
    and every task computes the same split."""
    bounds = shard_bounds(n_atoms, shards)
    structures, leaves = len(n_atoms), leaf_bounds(n_atoms).tolist()
    running = [0, *itertools.accumulate(int(a) for a in n_atoms)]
    share = Fraction(running[-1], shards)
    assert bounds[0] == 0 and bounds[-1] == structures and len(bounds) == shards + 1
    covered = [s for a, b in itertools.pairwise(bounds) for s in range(a, b)]
    assert covered == list(range(structures))
    assert set(bounds) <= set(leaves)
    leaf_at = {b: i for i, b in enumerate(leaves)}
    at_leaves = [running[b] for b in leaves]
    for k, cut in enumerate(bounds[1:-1], 1):
        ideal = k * share
        above = bisect.bisect_left(at_leaves, ideal)
        nearest = min(abs(at_leaves[i] - ideal) for i in (above - 1, above)
                      if 0 <= i < len(at_leaves))
        beside = [leaf_at[bounds[j + 1]] - leaf_at[bounds[j]] for j in (k - 1, k)]
        assert abs(running[cut] - ideal) == nearest or 1 in beside, (k, cut)
    for a, b in itertools.pairwise(bounds):
        leaves_in = leaf_at[b] - leaf_at[a]
        assert leaves_in > 0 or len(leaves) - 1 < shards
        atoms = running[b] - running[a]
        assert atoms <= 2 * share or b - a == 1 or (leaves_in == 1 and shards > len(leaves) - 1)
    # each task's own call (16 tasks spread over the shards), from atom counts read as int32
    for i in {*range(0, shards, -(-shards // 16)), shards - 1}:
        own = shard_of(np.asarray(n_atoms, np.int32), 0, (i, shards)).tolist()
        assert own[0] == bounds[i] and own[-1] == bounds[i + 1]
    return bounds


def lopsided(structures, giant_at, giant=10**6, small=(1, 20), seed=0):
    """Structures of `small` atoms but one of `giant` at `giant_at` (a fraction of the way)."""
    n_atoms = np.random.default_rng(seed).integers(*small, structures)
    n_atoms[min(structures - 1, int(giant_at * structures))] = giant
    return n_atoms


SIZES = {
    "giant first": lopsided(300, 0.0),
    "giant in the middle": lopsided(300, 0.5),
    "giant last": lopsided(300, 1.0),
    "all equal": np.full(500, 7),
    "many tiny, one huge": lopsided(5000, 0.3, giant=10**7, small=(1, 3)),
    "two giants side by side": np.array([1] * 50 + [10**5, 10**5] + [1] * 50),
    "empty structures around a giant": np.array([0] * 40 + [10**4] + [0, 1] * 40),
    "no atoms at all": np.zeros(30, np.int64),
    "fewer structures than shards": np.array([5, 1, 900]),
    "no structures": np.zeros(0, np.int64),
}


@pytest.mark.parametrize("sizes", SIZES)
def test_shards_balance_by_atoms_whatever_the_sizes(sizes):
    for shards in (1, 2, 3, 4, 7, 64, 1024, 3000):
        brute_force_checks(SIZES[sizes], shards)


def test_one_giant_structure_leaves_no_shard_empty():
    """Where each ideal cut falls inside one giant, the cuts do not pile up on its edges: the
    structures either side are spread over the other shards."""
    n_atoms = np.array([1] * 1000 + [10**6] + [1] * 1000)
    bounds = brute_force_checks(n_atoms, 4)
    assert bounds == [0, 1000, 1001, 1002, 2001]
