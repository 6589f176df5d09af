"""--shard I/N and auto on reduce, grad and stats, and `segcli merge` (copy and --virtual):
every split of a file gives parts whose merge is, dataset by dataset and bit for bit, what one
run writes; gaps, overlaps and parts of other jobs are refused."""

import itertools
import os
import shutil
from fractions import Fraction

import h5py
import numpy as np
import pytest
from batch_reference import reduce_reference, write_batch
from click.testing import CliRunner

from segcli.cli import main
from segcli.io import open_batch
from segcli.io.core import (
    Chunk,
    FieldInfo,
    merge_pieces,
    rechunk,
    segment_bounds,
    segment_runs,
)
from segcli.shards import LAUNCHER_VARIABLES, WORLDS, leaf_bounds, shard_bounds


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def ok(*args, env=None):
    result = run(*args, env=env)
    assert result.exit_code == 0, result.output
    return result


def datasets(path):
    """name -> (values, attributes but `created` and `shard`) of every dataset, and the root
    attributes."""
    out = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            attrs = {k: np.asarray(v).tolist() for k, v in obj.attrs.items()
                     if k not in ("created", "shard")}
            out[name] = (obj[()], obj.dtype, attrs)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
        root = {k: np.asarray(v).tolist() for k, v in f.attrs.items()}
    return out, root


def assert_identical(a, b):
    (got, got_root), (wanted, wanted_root) = datasets(a), datasets(b)
    assert got_root == wanted_root
    assert got.keys() == wanted.keys()
    for name, (values, dtype, attrs) in wanted.items():
        assert got[name][1] == dtype, name
        assert np.array_equal(got[name][0], values, equal_nan=True), name
        assert got[name][2] == attrs, name


@pytest.fixture(scope="module")
def lumpy(tmp_path_factory):
    """Structures of 0 to 12 atoms, some empty, and one of 3000 atoms."""
    rng = np.random.default_rng(11)
    n_atoms = rng.integers(0, 13, 60)
    n_atoms[[0, 7, 8, 59]] = 0
    n_atoms[31] = 3000
    n = int(n_atoms.sum())
    path = tmp_path_factory.mktemp("lumpy") / "lumpy.h5"
    atoms = {"forces": rng.normal(size=(n, 3)), "numbers": rng.integers(1, 6, n),
             "v": rng.normal(size=(n, 3))}
    structures = {"energy": rng.normal(size=len(n_atoms)), "w": rng.uniform(size=len(n_atoms))}
    write_batch(path, n_atoms, atoms, structures)
    return path, n_atoms, {**atoms, **structures}


@pytest.fixture(scope="module")
def even(tmp_path_factory):
    """Structures of 1 to 9 atoms."""
    rng = np.random.default_rng(12)
    n_atoms = rng.integers(1, 10, 50)
    n = int(n_atoms.sum())
    path = tmp_path_factory.mktemp("even") / "even.h5"
    write_batch(path, n_atoms, {"forces": rng.normal(size=(n, 3))})
    return path


@pytest.mark.parametrize("n_atoms", [[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 7, 0], [], [5] * 2000,
                                     [1] * 1500 + [10_000] + [2] * 700])
@pytest.mark.parametrize("shards", [1, 2, 3, 7, 4000])
def test_shards_are_contiguous_whole_structures_on_leaf_boundaries(n_atoms, shards):
    n_atoms = np.array(n_atoms, np.int64)
    bounds = shard_bounds(n_atoms, shards)
    leaves = leaf_bounds(n_atoms)
    assert len(bounds) == shards + 1 and bounds[0] == 0 and bounds[-1] == len(n_atoms)
    assert all(a <= b for a, b in itertools.pairwise(bounds)) and set(bounds) <= set(leaves)
    atoms = [n_atoms[a:b].sum() for a, b in itertools.pairwise(bounds)]
    leaf_atoms = max(np.diff(np.concatenate([[0], np.cumsum(n_atoms)])[leaves]), default=0)
    assert all(abs(a - n_atoms.sum() / shards) <= leaf_atoms for a in atoms)
    assert len(leaves) - 1 == min(len(n_atoms), 1024)


def reference_cuts(counts, parts):
    """By loops: cut k at the boundary nearest to k·total/parts (exactly; the earlier one on a
    tie), then, with at least as many items as parts, moved on (at the end, back) by as few
    items as leave no part empty."""
    running = [0, *itertools.accumulate(int(c) for c in counts)]
    n, cuts = len(counts), [0]
    for k in range(1, parts):
        ideal = Fraction(k * running[-1], parts)
        above = next(b for b, r in enumerate(running) if r >= ideal)
        below = above - 1
        nearer_below = above > 0 and ideal - running[below] <= running[above] - ideal
        cuts.append(below if nearer_below else above)
    cuts.append(n)
    if n >= parts:
        for k in range(1, parts):
            cuts[k] = max(cuts[k], cuts[k - 1] + 1)
        for k in range(parts - 1, 0, -1):
            cuts[k] = min(cuts[k], cuts[k + 1] - 1)
    return cuts


@pytest.mark.parametrize("seed", range(6))
def test_shard_bounds_equal_a_loop_over_leaves_of_structures(seed):
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(0, 3 if seed % 2 else 64, int(rng.integers(0, 3000)))
    if len(n_atoms) and seed % 3 == 0:
        n_atoms[rng.integers(0, len(n_atoms))] = 10**6  # outweighs many leaves
    leaves = (list(range(len(n_atoms) + 1)) if len(n_atoms) <= 1024
              else reference_cuts(n_atoms, 1024))
    assert leaf_bounds(n_atoms).tolist() == leaves
    leaf_atoms = [int(n_atoms[a:b].sum()) for a, b in itertools.pairwise(leaves)]
    for shards in (1, 3, 32, 4000):
        assert shard_bounds(n_atoms, shards) == [leaves[c] for c in
                                                 reference_cuts(leaf_atoms, shards)]


CUTS = [
    *[(["reduce", "rms_norm", "forces"], shards) for shards in (1, 2, 3, 7, 80)],
    *[(command, shards) for shards in (3, 80) for command in (
        ["reduce", "mul", "v", "w"], ["reduce", "sum", "v"],
        ["grad", "max_norm", "forces", "--weights", "w"],
        ["grad", "dot", "forces", "v", "--order", "2", "--direction", "v"])]]


@pytest.mark.parametrize("command, shards", [
    pytest.param(c, n, id=f"{c[0]}-{c[1]}-{n}",
                 marks=pytest.mark.slow if n == 80 and c[1] != "rms_norm" else ())
    for c, n in CUTS])
def test_merged_shards_equal_one_run_bit_for_bit(tmp_path, lumpy, shards, command):
    path, n_atoms, data = lumpy
    verb, *rest = command
    whole = tmp_path / "whole.h5"
    ok(verb, path, *rest, "-o", whole, "--chunk-atoms", "40", "-q")
    for i in range(shards):  # parts/ is made by the first shard that writes there
        ok(verb, path, *rest, "--shard", f"{i}/{shards}", "-o",
           tmp_path / "parts" / "part-{shard}.h5", "-q")
    width = len(str(shards - 1))
    names = sorted(p.name for p in (tmp_path / "parts").glob("part-*.h5"))
    assert names == [f"part-{str(i).zfill(width)}.h5" for i in range(shards)]
    counts = []
    for name in names:  # every part is a complete segcli file, empty ones too
        with h5py.File(tmp_path / "parts" / name, "r") as f:
            counts.append(len(f["structures/n_atoms"]))
            result = f["results"][next(iter(f["results"]))]
            result = result[next(iter(result))] if isinstance(result, h5py.Group) else result
            assert result.attrs["shard"] == f"{names.index(name)}/{shards}"
    assert sum(counts) == len(n_atoms) and (shards < len(n_atoms) or 0 in counts)
    ok("merge", tmp_path / "parts" / "part-*.h5", "-o", tmp_path / "merged.h5", "-q")
    assert_identical(tmp_path / "merged.h5", whole)
    ok("merge", tmp_path / "parts", "-o", tmp_path / "virtual.h5", "--virtual", "-q")
    assert_identical(tmp_path / "virtual.h5", whole)
    if command[1] == "rms_norm":
        values, _, _ = datasets(tmp_path / "merged.h5")[0]["results/rms_norm_forces"]
        np.testing.assert_allclose(values, reduce_reference("rms_norm", n_atoms, data["forces"]),
                                   rtol=1e-12)


@pytest.mark.parametrize("atoms_per_block", [1, 5, 40, 1 << 20])
def test_part_rows_give_each_part_in_whole_structures_in_order(tmp_path, lumpy, atoms_per_block):
    """What a cluster's client writes out: parts' rows of results per structure and per atom,
    alone or together, in blocks of whole structures (at most the atoms asked for, where a
    result is per atom) and in order, empty parts and structures included."""
    from segcli.io.merge import check_parts, part_rows

    path, n_atoms, _ = lumpy
    ok("reduce", path, "rms_norm", "forces", "+", "mul", "forces", "w", "-o", tmp_path / "whole.h5",
       "-q")
    for i in range(3):
        ok("reduce", path, "rms_norm", "forces", "+", "mul", "forces", "w", "--structures",
           "5:", "--shard", f"{i}/3", "-o", tmp_path / "parts" / "p-{shard}.h5", "-q")
    parts = check_parts(sorted((tmp_path / "parts").glob("p-*.h5")))
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    with h5py.File(tmp_path / "whole.h5") as f:
        whole = {name: f[f"results/{name}"][()] for name in ("rms_norm_forces", "mul_forces_w")}
    for names in (["rms_norm_forces"], ["mul_forces_w"], ["mul_forces_w", "rms_norm_forces"]):
        blocks = list(part_rows(parts, names, atoms_per_block))
        assert [b[0] for b in blocks] == sorted(b[0] for b in blocks)
        assert np.concatenate([b[1] for b in blocks]).tolist() == n_atoms[5:].tolist()
        for start, counts, rows in blocks:
            stop = start + len(counts)
            size = counts.sum() if "mul_forces_w" in names else len(counts)  # atoms, or rows
            assert len(counts) == 1 or size <= atoms_per_block
            for name in names:
                per_atom = name == "mul_forces_w"
                lo, hi = (offsets[start], offsets[stop]) if per_atom else (start, stop)
                np.testing.assert_array_equal(rows[name], whole[name][lo:hi])


@pytest.mark.parametrize("shards", [1, 2, 3, 7, pytest.param(80, marks=pytest.mark.slow)])
def test_merged_stats_parts_equal_one_run_bit_for_bit(tmp_path, lumpy, shards):
    path, _, _ = lumpy
    args = [path, "forces", "energy", "--per-element", "--per-atom", "--chunk-atoms", "50"]
    ok("stats", *args, "-o", tmp_path / "whole.h5", "-q")
    ok("stats", *args, "--structures", "2:", "-o", tmp_path / "tail.h5", "-q")
    for i in range(shards):
        ok("stats", *args, "--shard", f"{i}/{shards}", "-o", tmp_path / "p-{shard}.h5", "-q")
        ok("stats", *args, "--structures", "2:", "--shard", f"{i}/{shards}", "-o",
           tmp_path / "t-{shard}.h5", "-q")
    ok("merge", tmp_path / "p-*.h5", "-o", tmp_path / "merged.h5", "-q")
    assert_identical(tmp_path / "merged.h5", tmp_path / "whole.h5")
    ok("merge", tmp_path / "t-*.h5", "-o", tmp_path / "merged-tail.h5", "-q")
    assert_identical(tmp_path / "merged-tail.h5", tmp_path / "tail.h5")


def test_shard_auto_reads_slurm_open_mpi_and_pmi(even):
    path = even
    wanted = ok("reduce", path, "sum", "forces", "--shard", "2/5").stdout
    assert wanted.count("\n") > 1
    bare = dict.fromkeys(LAUNCHER_VARIABLES)
    array = {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10",
             "SLURM_ARRAY_TASK_COUNT": "5"}
    for launcher in [array, *({index: "2", count: "5"} for index, count in WORLDS)]:
        env = {**bare, **launcher}
        assert ok("reduce", path, "sum", "forces", "--shard", "auto", env=env).stdout == wanted
    result = run("reduce", path, "sum", "forces", "--shard", "auto", env=bare)
    assert result.exit_code == 2 and "SLURM_ARRAY_TASK_ID" in result.output
    result = run("reduce", path, "sum", "forces", "--shard", "auto",
                 env={**bare, "PMI_RANK": "5", "PMI_SIZE": "5"})
    assert result.exit_code == 2 and "outside 0 to 4" in result.output


@pytest.mark.parametrize("args, needle", [
    (["--shard", "3/3"], "0 <= I < N"), (["--shard", "1"], "expected I/N"),
    (["--shard", f"{10 ** 20}/{10 ** 23}"], "more than 4194304 shards"),
    (["--shard", "0/2", "--in-place"], "--in-place"),
    (["--shard", "0/2", "--scheduler", "local:2"], "give one of them"),
    (["-o", "part-{shard}.h5"], "which --shard I/N fills")])
def test_bad_shards_are_usage_errors(lumpy, args, needle):
    result = run("reduce", lumpy[0], "sum", "forces", *args)
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output


def test_merge_refuses_gaps_overlaps_and_other_jobs_in_one_line(tmp_path, even):
    path = even
    for i in range(3):
        ok("reduce", path, "rms_norm", "forces", "--shard", f"{i}/3", "-o",
           tmp_path / "r-{shard}.h5", "-q")
    ok("reduce", path, "rms_norm", "forces", "--structures", "5:9", "-o", tmp_path / "mid.h5")
    ok("reduce", path, "sum", "forces", "--shard", "1/3", "--name", "rms_norm_forces", "-o",
       tmp_path / "sum-{shard}.h5")
    ok("reduce", path, "rms_norm", "forces", "--shard", "1/3", "--precision", "float32", "-o",
       tmp_path / "f32-{shard}.h5")
    ok("stats", path, "forces", "--shard", "1/3", "-o", tmp_path / "s-{shard}.h5")
    other = tmp_path / "other.h5"
    shutil.copy(path, other)
    with h5py.File(other, "a") as f:
        f.attrs["touched"] = "a file of the same structures, but another size"
    ok("reduce", other, "rms_norm", "forces", "--shard", "1/3", "-o", tmp_path / "o-{shard}.h5")
    with h5py.File(tmp_path / "r-0.h5", "r") as f:
        first = f["results/rms_norm_forces"].attrs["structures"]
    cut = int(first.split(":")[1])
    cases = [
        (["r-0.h5", "r-2.h5"], [f"parts leave structures {cut}:", "r-0.h5 has 0:"]),
        (["r-0.h5", "r-1.h5", "r-2.h5", "mid.h5"], ["parts overlap on structures", "mid.h5"]),
        (["r-0.h5", "sum-1.h5", "r-2.h5"], ["op='sum'", "'rms_norm'"]),
        (["r-0.h5", "f32-1.h5", "r-2.h5"], ["'float32'", "'float64'"]),
        (["r-0.h5", "s-1.h5", "r-2.h5"], ["segcli-stats"]),
        (["r-0.h5", "o-1.h5", "r-2.h5"], ["source_fingerprint"]),
        (["r-0.h5", "missing.h5"], ["missing.h5"]),
    ]
    for names, needles in cases:
        result = run("merge", *(tmp_path / n for n in names), "-o", tmp_path / "out.h5")
        assert result.exit_code == 1, (names, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert all(n in result.output for n in needles), (needles, result.output)
        assert not (tmp_path / "out.h5").exists()


def test_a_virtual_merge_opens_after_the_parts_move_beside_it(tmp_path, lumpy, monkeypatch):
    path, n_atoms, data = lumpy
    parts = tmp_path / "work"
    parts.mkdir()
    for i in range(3):
        ok("reduce", path, "max_norm", "forces", "--shard", f"{i}/3", "-o",
           parts / "r-{shard}.h5", "-q")
    ok("merge", parts / "r-*.h5", "-o", parts / "all.h5", "--virtual", "-q")
    moved = shutil.move(parts, tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)  # relative paths resolve beside the file, not in the working
    # directory (which is given back after the test)
    with open_batch(os.path.join(moved, "all.h5")) as batch:
        values = np.concatenate([c.structures["max_norm_forces"]
                                 for c in batch.iter_chunks(["max_norm_forces"])])
    np.testing.assert_allclose(values, reduce_reference("max_norm", n_atoms, data["forces"]),
                               rtol=1e-12)
    os.remove(os.path.join(moved, "r-0.h5"))
    result = run("info", os.path.join(moved, "all.h5"))
    assert result.exit_code == 1 and "r-0.h5, which is missing" in result.output


def test_shards_of_many_files_merge_into_one_run(tmp_path):
    rng = np.random.default_rng(13)
    data = tmp_path / "data"
    data.mkdir()
    counts = []
    for k, size in enumerate([40, 0, 25]):
        n_atoms = rng.integers(0, 9, size)
        counts.append(n_atoms)
        forces = rng.normal(size=(n_atoms.sum(), 3))
        write_batch(data / f"shard-{k}.h5", n_atoms, {"forces": forces})
    files = str(data / "shard-*.h5")
    ok("reduce", files, "rms_norm", "forces", "-o", tmp_path / "whole.h5", "-q")
    ok("stats", files, "forces", "-o", tmp_path / "whole-stats.h5", "-q")
    for i in range(4):
        ok("reduce", files, "rms_norm", "forces", "--shard", f"{i}/4", "-o",
           tmp_path / "r-{shard}.h5", "-q")
        ok("stats", files, "forces", "--shard", f"{i}/4", "-o", tmp_path / "s-{shard}.h5", "-q")
    ok("merge", tmp_path / "r-*.h5", "-o", tmp_path / "merged.h5", "-q")
    ok("merge", tmp_path / "s-*.h5", "-o", tmp_path / "merged-stats.h5", "-q")
    assert_identical(tmp_path / "merged.h5", tmp_path / "whole.h5")
    assert_identical(tmp_path / "merged-stats.h5", tmp_path / "whole-stats.h5")
    with h5py.File(tmp_path / "merged.h5", "r") as f:
        np.testing.assert_array_equal(f["structures/source"][()], np.repeat([0, 2], [40, 25]))
        np.testing.assert_array_equal(f["structures/source_index"][()],
                                      np.concatenate([np.arange(40), np.arange(25)]))


@pytest.mark.parametrize("seed", range(20))
def test_chunks_hold_whole_segments_and_copy_only_those_they_join(seed):
    """iter_chunks with breaks: every chunk holds whole segments (the runs between breaks, one
    of more than chunk_atoms atoms split greedily from its start), as many as fit in
    chunk_atoms atoms (or one bigger structure), whatever pieces the reader gave; a chunk
    within one piece is a view of it."""
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(0, 20, rng.integers(0, 60))
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    x = np.arange(offsets[-1], dtype=float)
    chunk_atoms = int(rng.integers(1, 30))
    cuts = sorted({0, len(n_atoms), *rng.integers(0, len(n_atoms) + 1, 6).tolist()})
    schema = {"x": FieldInfo("x", "atom", (), x.dtype)}
    pieces = [Chunk(a, n_atoms[a:b], {"x": x[offsets[a]:offsets[b]]}, {})
              for a, b in itertools.pairwise(cuts)]
    breaks = sorted(set(rng.integers(0, len(n_atoms) + 1, 4).tolist()))
    bounds = segment_bounds(n_atoms, breaks, chunk_atoms)
    wanted, start = [0], 0
    for stop in sorted({*breaks, len(n_atoms)} - {0}):
        while start < stop:  # greedy from the segment's start
            end, room = start, chunk_atoms
            while end < stop and (n_atoms[end] <= room or end == start):
                room -= n_atoms[end]
                end += 1
            wanted.append(end)
            start = end
    assert bounds.tolist() == (wanted if len(n_atoms) else [0])
    runs = segment_runs(n_atoms, breaks, chunk_atoms)
    got = [merge_pieces("f", group, schema) for group in rechunk(iter(pieces), chunk_atoms, runs)]
    starts, stops = [c.start for c in got], [c.start + len(c.n_atoms) for c in got]
    assert starts == [0, *stops[:-1]] and stops[-1:] == [len(n_atoms)][:len(got)]
    assert set(starts + stops) <= set(wanted)
    segment_atoms = np.diff(offsets[bounds])
    for chunk, stop in zip(got, stops):
        assert chunk.n_atoms.sum() <= chunk_atoms or len(chunk.n_atoms) == 1
        if stop < len(n_atoms):  # the next segment would not fit
            following = segment_atoms[np.searchsorted(bounds, stop)]
            assert chunk.n_atoms.sum() + following > chunk_atoms
        np.testing.assert_array_equal(chunk.atoms["x"], x[offsets[chunk.start]:offsets[stop]])
        holder = [p for p in pieces if p.start <= chunk.start and stop <= p.start + len(p.n_atoms)]
        if holder and len(chunk.atoms["x"]):
            assert np.shares_memory(chunk.atoms["x"], holder[0].atoms["x"])


@pytest.mark.parametrize("seed", range(20))
def test_rechunk_of_any_pieces_gives_the_runs_of_plan_chunks(seed):
    """Pieces cut anywhere (empty ones, empty and oversized structures among them) are
    grouped into the chunks plan_chunks gives, each holding its structures' rows in order."""
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(0, 9, int(rng.integers(0, 60)))
    n_atoms[rng.random(len(n_atoms)) < 0.1] = 30  # bigger than a chunk
    chunk_atoms = int(rng.integers(1, 25))
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    x = np.arange(offsets[-1], dtype=np.float64)
    cuts = np.unique(np.concatenate([[0, len(n_atoms)],
                                     rng.integers(0, len(n_atoms) + 1, 6)]))
    pieces = [Chunk(int(a), n_atoms[a:b], {"x": x[offsets[a]:offsets[b]]}, {})
              for a, b in itertools.pairwise(cuts)]
    pieces.insert(1, Chunk(int(cuts[1]) if len(cuts) > 1 else 0, n_atoms[:0], {"x": x[:0]}, {}))
    schema = {"x": FieldInfo("x", "atom", (), x.dtype)}
    chunks = [merge_pieces("f", group, schema) for group in rechunk(iter(pieces), chunk_atoms)]
    from segcli.memory import plan_chunks

    bounds = plan_chunks(n_atoms, chunk_atoms)
    assert [c.start for c in chunks] == bounds[:-1]
    for chunk, (a, b) in zip(chunks, itertools.pairwise(bounds)):
        assert np.array_equal(chunk.n_atoms, n_atoms[a:b])
        assert np.array_equal(chunk.atoms["x"], x[offsets[a]:offsets[b]])
