"""A merge of parts (results or statistics) is complete or refused: every shard of the job and
every structure of the input once, parts of one version of the input, rows that match their
structures; --partial joins fewer on purpose and names what lacks."""

import os
import shutil

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from invoke import ok, run

SHARDS = 4
OPS = ["rms_norm", "forces", "+", "mul", "forces", "w"]




def refused(tmp_path, args, *needles):
    """Run segcli with `args` writing tmp_path/out.h5: exit 1, one line naming `needles`, no
    output file."""
    out = tmp_path / "out.h5"
    result = run(*args, "-o", out)
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert all(n in result.output for n in needles), (needles, result.output)
    assert not out.exists()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A file of 30 structures (some empty), its shards' parts (results and statistics) and
    one run's results: (directory, n_atoms, arrays)."""
    rng = np.random.default_rng(5)
    n_atoms = rng.integers(0, 7, 30)
    n_atoms[[0, 11]] = 0
    n = int(n_atoms.sum())
    here = tmp_path_factory.mktemp("job")
    arrays = {"forces": rng.normal(size=(n, 3)), "w": rng.uniform(0.5, 2.0, len(n_atoms))}
    write_batch(here / "data.h5", n_atoms, {"forces": arrays["forces"]}, {"w": arrays["w"]})
    ok("reduce", here / "data.h5", *OPS, "-o", here / "whole.h5", "-q")
    for i in range(SHARDS):
        ok("reduce", here / "data.h5", *OPS, "--shard", f"{i}/{SHARDS}", "-o",
           here / "parts" / "r-{shard}.h5", "-q")
        ok("stats", here / "data.h5", "forces", "--shard", f"{i}/{SHARDS}", "-o",
           here / "stats" / "s-{shard}.h5", "-q")
    return here, n_atoms, arrays


def parts(job, *indices, kind="parts/r"):
    return [job[0] / f"{kind}-{i}.h5" for i in indices]


def bounds(job):
    """The structures [start, stop) of each result part."""
    out = []
    for path in parts(job, *range(SHARDS)):
        with h5py.File(path, "r") as f:
            out.append(tuple(map(int, f["results/rms_norm_forces"].attrs["structures"].split(
                ":"))))
    return out


@pytest.mark.parametrize("kind", ["parts/r", "stats/s"])
@pytest.mark.parametrize("lost", [0, 1, SHARDS - 1])
def test_a_job_that_lacks_its_first_middle_or_last_part_is_refused(tmp_path, job, lost, kind):
    given = [i for i in range(SHARDS) if i != lost]
    a, b = bounds(job)[lost]
    refused(tmp_path, ["merge", *parts(job, *given, kind=kind)],
            f"parts leave structures {a}:{b} uncovered", f"shard {lost} of {SHARDS} missing",
            "--partial")


def test_an_empty_shard_missing_is_refused_though_no_structure_lacks(tmp_path, job):
    data = job[0] / "data.h5"
    for i in range(5):  # 3 structures in 5 shards: two are empty
        ok("reduce", data, "rms_norm", "forces", "--structures", "3:6", "--shard", f"{i}/5",
           "-o", tmp_path / "p-{shard}.h5", "-q")
    sizes = {}
    for i in range(5):
        with h5py.File(tmp_path / f"p-{i}.h5", "r") as f:
            sizes[i] = len(f["structures/n_atoms"])
    empty = min(i for i, size in sizes.items() if size == 0)
    given = [tmp_path / f"p-{i}.h5" for i in range(5) if i != empty]
    refused(tmp_path, ["merge", *given], f"parts lack shard {empty} of 5")
    ok("merge", *given, tmp_path / f"p-{empty}.h5", "-o", tmp_path / "all.h5", "-q")
    with h5py.File(tmp_path / "all.h5", "r") as f:
        assert f["results/rms_norm_forces"].attrs["structures"] == "3:6"
        assert "missing" not in f.attrs


def test_a_part_given_twice_or_empty_is_refused(tmp_path, job):
    r0, r1, r2, r3 = parts(job, *range(SHARDS))
    copy = shutil.copy(r1, tmp_path / "copy-of-1.h5")
    refused(tmp_path, ["merge", r0, r1, r1, r2, r3], "r-1.h5: given twice")
    refused(tmp_path, ["merge", r0, r1, copy, r2, r3], "shard 1/4, as is", "counts once")
    folder = tmp_path / "folder"
    shutil.copytree(job[0] / "parts", folder)
    (folder / "r-9.h5").touch()  # a task that failed while its file was made
    refused(tmp_path, ["merge", folder], "r-9.h5: empty file (0 bytes)")
    refused(tmp_path, ["merge", folder / "*.h5"], "r-9.h5: empty file (0 bytes)")
    os.remove(folder / "r-9.h5")
    (folder / "slurm-9.out").write_text("killed\n")
    refused(tmp_path, ["merge", folder], "slurm-9.out: not a part")


def test_a_part_whose_rows_are_not_its_structures_is_refused(tmp_path, job):
    for name, per in (("rms_norm_forces", "structure"), ("mul_forces_w", "atom")):
        bad = shutil.copy(parts(job, 2)[0], tmp_path / "r-2.h5")
        with h5py.File(bad, "a") as f:
            ds = f[f"results/{name}"]
            rows, attrs = ds[:-1], dict(ds.attrs)
            del f[f"results/{name}"]
            f[f"results/{name}"] = rows
            f[f"results/{name}"].attrs.update(attrs)
        refused(tmp_path, ["merge", *parts(job, 0, 1), bad, *parts(job, 3)],
                f"r-2.h5: /results/{name} has {len(rows)} rows", f"{len(rows) + 1} {per}s")


@pytest.mark.parametrize("change", ["touch", "n_atoms"])
def test_parts_of_another_version_of_the_input_are_refused(tmp_path, job, change):
    data = shutil.copy2(job[0] / "data.h5", tmp_path / "data.h5")
    for i in range(SHARDS - 1):
        ok("reduce", data, "sum", "forces", "--shard", f"{i}/{SHARDS}", "-o",
           tmp_path / "p-{shard}.h5", "-q")
    before = os.stat(data)
    if change == "touch":
        os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    else:  # the same sizes and time, other structures
        with h5py.File(data, "a") as f:
            f["structures/n_atoms"][...] = f["structures/n_atoms"][()][::-1]
        os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(data).st_size == before.st_size
    last = SHARDS - 1
    ok("reduce", data, "sum", "forces", "--shard", f"{last}/{SHARDS}", "-o",
       tmp_path / "p-{shard}.h5", "-q")
    refused(tmp_path, ["merge", *(tmp_path / f"p-{i}.h5" for i in range(SHARDS))],
            f"p-{last}.h5: sum_forces has source_fingerprint=", "different jobs or inputs")


def test_a_partial_merge_holds_the_present_structures_and_names_the_rest(tmp_path, job):
    here, n_atoms, arrays = job
    (a, b), (c, d) = bounds(job)[1], bounds(job)[3]
    out = tmp_path / "some.h5"
    result = ok("merge", *parts(job, 0, 2), "--partial", "-o", out)
    assert f"{out}: lacks structures {a}:{b},{c}:{d} (--partial)" in result.stderr
    present = np.r_[0:a, b:c]
    atoms = np.repeat(np.isin(np.arange(len(n_atoms)), present), n_atoms)
    ids = np.repeat(np.arange(len(n_atoms)), n_atoms)
    squares = np.bincount(ids, (arrays["forces"] ** 2).sum(axis=1), len(n_atoms))
    rms = np.sqrt(squares / np.maximum(n_atoms, 1))  # an empty structure's is 0
    wanted = {"rms_norm_forces": rms[present],
              "mul_forces_w": (arrays["forces"] * np.repeat(arrays["w"], n_atoms)[:, None])[atoms]}
    with h5py.File(out, "r") as f, h5py.File(here / "whole.h5", "r") as whole:
        assert f.attrs["missing"] == f"{a}:{b},{c}:{d}"
        np.testing.assert_array_equal(f["structures/n_atoms"][()], n_atoms[present])
        for name, values in wanted.items():
            got = f[f"results/{name}"][()]
            np.testing.assert_allclose(got, values, rtol=1e-12, atol=1e-300)
            one_run = whole[f"results/{name}"][()]
            np.testing.assert_array_equal(got, one_run[present if name[0] == "r" else atoms])
    stats = tmp_path / "stats.h5"
    result = ok("merge", *parts(job, 0, 1, 2, kind="stats/s"), "--partial", "-o", stats)
    assert f"lacks structures {c}:{d}" in result.stderr
    assert_stats_of(stats, arrays["forces"][np.repeat(np.arange(len(n_atoms)) < c, n_atoms)])
    with h5py.File(stats, "r") as f:
        assert f.attrs["missing"] == f"{c}:{d}"


def assert_stats_of(path, forces):
    """The statistics file `path` holds count, mean and max of `forces` (and of their norm)."""
    values = np.column_stack([forces, np.linalg.norm(forces, axis=1)])
    with h5py.File(path, "r") as f:
        group = f["stats/forces"]
        assert group["count"][()].tolist() == [len(forces)]
        np.testing.assert_allclose(group["mean"][0], values.mean(axis=0), rtol=1e-12)
        np.testing.assert_array_equal(group["max"][0], values.max(axis=0))


def test_statistics_files_count_each_structure_once(tmp_path, job):
    here, n_atoms, arrays = job
    data = here / "data.h5"
    ok("stats", data, "forces", "--structures", "0:20", "-o", tmp_path / "head.h5", "-q")
    ok("stats", data, "forces", "--structures", "15:", "-o", tmp_path / "tail.h5", "-q")
    ok("stats", data, "forces", "--structures", "20:", "-o", tmp_path / "rest.h5", "-q")
    twice = tmp_path / "twice.txt"
    twice.write_text(f"{tmp_path / 'head.h5'}\n{tmp_path / 'rest.h5'}\n{tmp_path / 'head.h5'}\n")
    refused(tmp_path, ["stats", f"@{twice}"], "head.h5: given twice")
    listed = tmp_path / "overlap.txt"
    listed.write_text(f"{tmp_path / 'head.h5'}\n{tmp_path / 'tail.h5'}\n")
    refused(tmp_path, ["stats", f"@{listed}"], "parts overlap on structures 15:20")
    head_alone = tmp_path / "alone.h5"  # a range chosen with --structures, not a shard
    assert "lacks" not in ok("stats", tmp_path / "head.h5", "-o", head_alone).stderr
    assert_stats_of(head_alone, arrays["forces"][:int(n_atoms[:20].sum())])
    whole = tmp_path / "whole.h5"
    ok("stats", tmp_path / "[hr]e*.h5", "-o", whole, "-q")
    assert_stats_of(whole, arrays["forces"])
    refused(tmp_path, ["stats", f"@{twice}"], "head.h5: given twice")
    both = tmp_path / "both.txt"  # the merged file covers what head.h5 does
    both.write_text(f"{whole}\n{tmp_path / 'head.h5'}\n")
    refused(tmp_path, ["stats", f"@{both}"], "parts overlap on structures 0:20")
    folder = tmp_path / "shards"
    shutil.copytree(here / "stats", folder)
    last = sorted(folder.iterdir(), key=lambda p: int(p.stem.split("-")[1]))[-1]
    with h5py.File(last, "r") as f:
        start = int(f.attrs["structures"].split(":")[0])
    last.rename(tmp_path / last.name)
    refused(tmp_path, ["stats", folder], f"parts leave structures {start}:30 uncovered")
    head = tmp_path / "head-only.h5"
    result = ok("stats", folder, "--partial", "-o", head)
    assert f"lacks structures {start}:30" in result.stderr
    assert_stats_of(head, arrays["forces"][:int(n_atoms[:start].sum())])
    with h5py.File(head, "r") as f:
        assert f.attrs["missing"] == f"{start}:30"
    (tmp_path / last.name).rename(last)
    (folder / "s-9.h5").touch()
    refused(tmp_path, ["stats", folder], "s-9.h5: empty file (0 bytes)")


def test_a_virtual_merge_is_read_to_the_end_and_not_merged_again(tmp_path, job):
    """A file of virtual datasets (merge --virtual) is read by a whole segcli process, which
    ends with exit 0, not a signal at its exit; merged again, it is refused (its rows lie in
    its parts: merge them)."""
    import subprocess
    import sys

    here, n_atoms, _ = job
    virtual = here / "virtual.h5"
    if not virtual.exists():
        ok("merge", here / "parts", "-o", virtual, "--virtual", "-q")
    out = tmp_path / "kept.h5"
    child = subprocess.run([sys.executable, "-m", "segcli", "select", virtual, "--where",
                            "rms_norm_forces > 0", "-o", out, "-q"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.returncode == 0, child.stderr
    with h5py.File(out) as f:
        np.testing.assert_array_equal(f["structures/n_atoms"][()], n_atoms[n_atoms > 0])
    refused(tmp_path, ["merge", virtual], "is a virtual dataset (of merge --virtual)")
