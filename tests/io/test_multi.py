"""Many files as one batch (SPEC §3b): directories, glob patterns and @LISTs as FILE, against
NumPy concatenations of the files' own arrays (written with h5py and ase.io.write)."""

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ase.io
import h5py
import numpy as np
import pytest
from batch_reference import reduce_reference, write_batch
from click.testing import CliRunner

from segcli.cli import main
from segcli.errors import DataError
from segcli.io import MultiBatch, expand_inputs, open_inputs
from segcli.memory import plan_chunks

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"a.h5": [3, 0, 5, 2, 7], "b.h5": [4, 1, 6], "c.h5": [], "d.h5": [2, 9, 0, 3]}


def run(*args, stdin=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=stdin)


def assert_one_line_error(result, code, *needles):
    """Exit `code` with one error line naming the problem (after click's usage lines)."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], result.stderr


def random_members(directory, sizes=SIZES, seed=0):
    """segcli files of random x (N, 3), v (N,) float32 and per-structure s (S,); returns
    {name: (n_atoms, x, v, s)}."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n_atoms in sizes.items():
        n_atoms = np.asarray(n_atoms, np.int64)
        n = int(n_atoms.sum())
        x, v = rng.normal(size=(n, 3)), rng.normal(size=n).astype(np.float32)
        s = rng.normal(size=len(n_atoms))
        write_batch(directory / name, n_atoms, {"x": x, "v": v}, {"s": s})
        out[name] = (n_atoms, x, v, s)
    return out


@pytest.fixture
def shards(tmp_path):
    """tmp_path/shards holding four segcli files (one without structures), a text file and a
    hidden file; returns (directory, {name: (n_atoms, x, v, s)})."""
    directory = tmp_path / "shards"
    directory.mkdir()
    members = random_members(directory)
    (directory / "notes.txt").write_text("not structures\n")
    shutil.copy(directory / "a.h5", directory / ".hidden.h5")
    return directory, members


def joined(members):
    """n_atoms, x, v, s of the members concatenated in name order, and each structure's
    (source, source_index)."""
    parts = [members[name] for name in sorted(members)]
    arrays = [np.concatenate(column) for column in zip(*parts)]
    source = np.repeat(np.arange(len(parts)), [len(p[0]) for p in parts])
    index = np.concatenate([np.arange(len(p[0])) for p in parts])
    return (*arrays, source, index)


def test_a_directory_a_pattern_and_lists_name_the_same_files(shards, tmp_path, monkeypatch):
    directory, members = shards
    expected = [str(directory / name) for name in sorted(members)]
    assert expand_inputs(str(directory)) == expected  # notes.txt and .hidden.h5 skipped
    assert expand_inputs(str(directory / "*.h5")) == expected
    listing = directory / "list.txt"
    listing.write_text("# the shards\n\nd.h5\n  a.h5\n" + str(directory / "b.h5") + "\n")
    assert expand_inputs(f"@{listing}") == [str(directory / n) for n in ("d.h5", "a.h5", "b.h5")]
    monkeypatch.chdir(directory)
    monkeypatch.setattr(sys, "stdin", open(listing))  # noqa: SIM115
    assert expand_inputs("@-") == ["d.h5", "a.h5", str(directory / "b.h5")]
    assert expand_inputs(["a.h5", "b.h5"]) == ["a.h5", "b.h5"]
    result = run("info", "--json", "@-", stdin="b.h5\nd.h5\n")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["sources"] == ["b.h5", "d.h5"]
    assert summary["structures"] == len(SIZES["b.h5"]) + len(SIZES["d.h5"])
    assert [m["structures"] for m in summary["members"]] == [3, 4]


def test_missing_unmatched_and_corrupt_members_are_named(shards, tmp_path):
    directory, _ = shards
    listing = tmp_path / "list.txt"
    listing.write_text("shards/a.h5\nshards/nope.h5\n")
    with pytest.raises(DataError, match="nope.h5: no such file"):
        expand_inputs(f"@{listing}")
    assert_one_line_error(run("info", f"@{listing}"), 1, "shards/nope.h5: no such file")
    assert_one_line_error(run("info", tmp_path / "none*.h5"), 1, "none*.h5: no file matches")
    assert_one_line_error(run("info", f"@{tmp_path / 'absent.txt'}"), 1, "absent.txt: cannot read")
    data = (directory / "a.h5").read_bytes()
    (directory / "z.h5").write_bytes(data[:len(data) // 3])
    assert_one_line_error(run("reduce", directory, "sum", "v"), 1, "z.h5: truncated or corrupt")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x\n")
    assert_one_line_error(run("info", empty), 1, "without a file that segcli reads")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of mode 000")
def test_an_unreadable_member_is_named(shards):
    directory, _ = shards
    os.chmod(directory / "b.h5", 0)
    try:
        assert_one_line_error(run("info", directory), 1, "b.h5: cannot read")
    finally:
        os.chmod(directory / "b.h5", 0o644)


@pytest.mark.parametrize("chunk_atoms", [1, 4, 13, 1000])
def test_chunks_run_across_members(shards, chunk_atoms):
    directory, members = shards
    n_atoms, x, v, s, source, index = joined(members)
    with open_inputs(str(directory)) as batch:
        assert isinstance(batch, MultiBatch) and batch.n_structures == len(n_atoms)
        assert np.array_equal(batch.n_atoms, n_atoms)
        chunks = list(batch.iter_chunks(["x", "v", "s"], chunk_atoms=chunk_atoms))
        got_source, got_index = batch.source_of(slice(None))
        assert got_source.dtype == np.int32 and got_index.dtype == np.int64
        assert np.array_equal(got_source, source) and np.array_equal(got_index, index)
        tail = batch.source_of(slice(6, None))
        assert np.array_equal(tail[0], source[6:]) and np.array_equal(tail[1], index[6:])
    assert [c.start for c in chunks] == plan_chunks(n_atoms, chunk_atoms)[:-1]
    for name, expected in (("x", x), ("v", v)):
        got = np.concatenate([c.atoms[name] for c in chunks])
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
    assert np.array_equal(np.concatenate([c.structures["s"] for c in chunks]), s)
    assert all(not c.present for c in chunks)


@pytest.mark.parametrize("output", ["npy", "h5"])
def test_a_chunk_of_many_members_holds_each_members_own_rows(tmp_path, output):
    """Nine files of a few structures each make one chunk of nine pieces, each read into a
    buffer of its own: the results are the files' own (a ring of four buffers once read
    the fifth piece over the first)."""
    rng = np.random.default_rng(12)
    n_atoms = [rng.integers(1, 4, 2) for _ in range(9)]
    xs = [rng.normal(size=(n.sum(), 3)) for n in n_atoms]
    (tmp_path / "in").mkdir()
    for k, (n, x) in enumerate(zip(n_atoms, xs)):
        write_batch(tmp_path / "in" / f"{k}.h5", n, {"x": x})
    want = np.concatenate([np.add.reduceat(x, np.cumsum(n) - n) for n, x in zip(n_atoms, xs)])
    if output == "npy":
        result = run("reduce", tmp_path / "in", "sum", "x", "--format", "npy")
        assert result.exit_code == 0, result.output
        got = np.load(io.BytesIO(result.stdout_bytes))
    else:
        result = run("reduce", tmp_path / "in", "sum", "x", "-o", tmp_path / "out.h5")
        assert result.exit_code == 0, result.output
        with h5py.File(tmp_path / "out.h5") as f:
            got = f["results/sum_x"][()]
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_reduce_over_many_files_equals_reduce_over_their_conversion(shards, tmp_path):
    directory, members = shards
    n_atoms, x, _v, _s, source, index = joined(members)
    converted = tmp_path / "all.h5"
    assert run("convert", directory / "*.h5", "-o", converted).exit_code == 0
    for op, fields in (("rms_norm", ["x"]), ("mul", ["v", "s"])):
        many, one = tmp_path / f"many_{op}.h5", tmp_path / f"one_{op}.h5"
        result = run("reduce", directory, op, *fields, "-o", many, "--chunk-atoms", 5)
        assert result.exit_code == 0, result.output
        assert run("reduce", converted, op, *fields, "-o", one).exit_code == 0
        name = f"{op}_{'_'.join(fields)}"
        with h5py.File(many) as h5, h5py.File(one) as single:
            assert np.array_equal(h5[f"results/{name}"][()], single[f"results/{name}"][()])
            assert np.array_equal(h5["structures/n_atoms"][()], n_atoms)
            assert h5["structures/source"].dtype == np.int32
            assert np.array_equal(h5["structures/source"][()], source)
            assert h5["structures/source_index"].dtype == np.int64
            assert np.array_equal(h5["structures/source_index"][()], index)
            assert list(h5.attrs["sources"].astype(str)) == expand_inputs(str(directory))
            assert list(single.attrs["sources"].astype(str)) == [str(converted)]
            assert np.array_equal(single["structures/source"][()], np.zeros(len(n_atoms)))
            assert np.array_equal(single["structures/source_index"][()], np.arange(len(n_atoms)))
    expected = reduce_reference("rms_norm", n_atoms, x)
    result = run("reduce", directory / "*.h5", "rms_norm", "x", "--chunk-atoms", 3,
                 "--structures", "2:11")
    lines = result.stdout.splitlines()
    assert lines[0] == "structure,source,source_index,rms_norm_x"
    rows = np.array([[float(c) for c in line.split(",")] for line in lines[1:]])
    assert np.array_equal(rows[:, 0], np.arange(2, 11))
    assert np.array_equal(rows[:, 1:3], np.stack([source, index], axis=1)[2:11])
    np.testing.assert_allclose(rows[:, 3], expected[2:11], rtol=1e-12)
    result = run("reduce", converted, "rms_norm", "x")  # one file: no source columns
    assert result.stdout.splitlines()[0] == "structure,rms_norm_x"


@pytest.mark.parametrize("step", [1, 2, 5, 1 << 20])
def test_sources_written_in_blocks_equal_the_whole_selection(shards, tmp_path, step):
    """ResultWriter.set_sources writes a selection's sources `step` structures at a time,
    blocks crossing from one member into the next."""
    from segcli.io import ResultWriter

    directory, members = shards
    *_, source, index = joined(members)
    with open_inputs(str(directory)) as batch:
        start, stop = 3, batch.n_structures - 2
        with ResultWriter(output_path=tmp_path / "out.h5") as writer:
            writer.set_n_atoms(batch.n_atoms[start:stop])
            writer.set_sources(batch.sources, batch.source_of, start, stop, step=step)
    with h5py.File(tmp_path / "out.h5") as h5:
        assert h5["structures/source"].dtype == np.int32
        np.testing.assert_array_equal(h5["structures/source"][()], source[start:stop])
        assert h5["structures/source_index"].dtype == np.int64
        np.testing.assert_array_equal(h5["structures/source_index"][()], index[start:stop])


def test_per_atom_json_lines_and_gradients_say_where_structures_came_from(shards, tmp_path):
    directory, members = shards
    n_atoms, x, _v, _s, source, index = joined(members)
    result = run("reduce", directory, "mul", "v", "s", "--format", "json", "--chunk-atoms", 4)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    structure = np.repeat(np.arange(len(n_atoms)), n_atoms)
    assert [r["structure"] for r in rows] == structure.tolist()
    assert [r["source"] for r in rows] == source[structure].tolist()
    assert [r["source_index"] for r in rows] == index[structure].tolist()
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    assert [r["atom"] for r in rows] == (np.arange(len(structure)) - offsets[structure]).tolist()
    assert list(rows[0]) == ["structure", "source", "source_index", "atom", "mul_v_s"]
    out = tmp_path / "grad.h5"
    result = run("grad", directory, "sum", "x", "-o", out, "--chunk-atoms", 6)
    assert result.exit_code == 0, result.output
    with h5py.File(out) as h5:
        assert np.array_equal(h5["results/sum_x/d_x"][()], np.ones_like(x))
        assert np.array_equal(h5["structures/source"][()], source)


def test_in_place_takes_one_file(shards):
    directory, _ = shards
    for args in (["reduce", directory, "sum", "v", "--in-place"],
                 ["grad", directory, "sum", "x", "--in-place"],
                 ["fit-e0", directory, "--in-place"]):
        assert_one_line_error(run(*args), 2, "--in-place adds to one file", "is 4 files")
    before = (directory / "a.h5").read_bytes()
    result = run("reduce", directory / "a*.h5", "sum", "v", "--in-place")  # matches one file
    assert result.exit_code == 0, result.output
    assert (directory / "a.h5").read_bytes() != before
    assert "sum_v" in open_inputs(str(directory / "a.h5")).results


def test_mixed_formats_join_when_their_fields_agree(tmp_path, frames):
    first = tmp_path / "first.extxyz"
    ase.io.write(first, frames[:3])
    converted = tmp_path / "first.h5"
    assert run("convert", first, "-o", converted).exit_code == 0
    rest = tmp_path / "rest.extxyz"
    ase.io.write(rest, frames[3:])
    listing = tmp_path / "mixed.txt"
    listing.write_text("first.h5\nrest.extxyz\n")
    with open_inputs(f"@{listing}") as batch:
        assert [m["format"] for m in batch.members] == ["segcli", "extxyz"]
        forces = np.concatenate([c.atoms["forces"] for c in batch.iter_chunks("forces",
                                                                              chunk_atoms=10)])
    images = ase.io.read(first, ":") + ase.io.read(rest, ":")  # as extxyz rounds them
    assert np.array_equal(forces, np.concatenate([a.get_forces() for a in images]))
    result = run("reduce", f"@{listing}", "sum", "forces", "--format", "json")
    got = np.array([json.loads(line)["sum_forces"] for line in result.stdout.splitlines()])
    np.testing.assert_allclose(got, [a.get_forces().sum(axis=0) for a in images], rtol=1e-12)
    assert [json.loads(line)["source"] for line in result.stdout.splitlines()] == \
        [0, 0, 0, 1, 1, 1, 1]
    result = run("info", f"@{listing}")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1] == "files: 2" and lines[2].split()[1:] == ["segcli", "HDF5", "3", "structures",
                                                               "18", "atoms"]


def test_fields_that_disagree_are_no_fields_of_the_batch_and_the_others_work(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_batch(a, [2], {"x": np.zeros((2, 3)), "y": np.ones((2, 3))})
    write_batch(b, [1, 1], {"x": np.zeros((2, 2)), "y": np.full((2, 3), 2.0)})
    why = (f"field 'x' is per atom, shape (2,), float64 in {b} but per atom, shape (3,), float64 "
           f"in {a}, so the batch has no such field (`segcli convert --rename x=NEW` renames it")
    shown = run("info", tmp_path)
    assert shown.exit_code == 0, shown.output
    assert f"not fields (the files disagree):\n  {why}" in shown.stdout
    summary = json.loads(run("info", tmp_path, "--json").stdout)
    assert set(summary["fields"]) == {"y"} and summary["conflicts"]["x"].startswith(why)
    reduced = run("reduce", tmp_path, "sum", "y", "--format", "json")
    assert reduced.exit_code == 0, reduced.output
    rows = [json.loads(line) for line in reduced.stdout.splitlines()]
    assert [row["sum_y"] for row in rows] == [[2.0] * 3, [2.0] * 3, [2.0] * 3]
    for args in (["reduce", tmp_path, "sum", "x"], ["stats", tmp_path, "x"],
                 ["select", tmp_path, "--where", "x > 0", "-o", tmp_path / "out" / "s.h5"]):
        assert_one_line_error(run(*args), 1, why)
    assert not (tmp_path / "out").exists()
    write_batch(b, [1], structures={"x": np.zeros(1)})
    assert_one_line_error(run("stats", tmp_path, "x"), 1,
                          f"field 'x' is per structure, shape (), float64 in {b} but per atom")


def test_the_sample_files_read_as_one_batch():
    """metals.h5 (per-atom energies) and conformers.h5 (per-structure ones): one batch whose
    forces reduce as in each file alone, its bool field filled where a file lacks it."""
    files = [str(ROOT / "sample_data" / name) for name in ("conformers.h5", "metals.h5")]
    together = run("reduce", *files[:0], "@-", "rms_norm", "forces", "--format", "json",
                   stdin="\n".join(files))
    assert together.exit_code == 0, together.output
    alone = [run("reduce", f, "rms_norm", "forces", "--format", "json") for f in files]
    values = [[json.loads(line)["rms_norm_forces"] for line in r.stdout.splitlines()]
              for r in (together, *alone)]
    assert values[0] == values[1] + values[2]
    shown = run("info", "@-", stdin="\n".join(files))
    assert shown.exit_code == 0, shown.output
    assert "field 'energies' is per atom" in shown.stdout
    assert re.search(r"pbc +structure +\(3,\) +bool +present in 199 of 305, filled with false",
                     shown.stdout), shown.stdout


def test_a_field_some_files_lack_is_present_in_their_structures_only(tmp_path):
    write_batch(tmp_path / "a.h5", [2, 1], {"q": np.array([1, 2, 3], np.int32)},
                {"e": np.array([1.0, 2.0])})
    write_batch(tmp_path / "b.h5", [3], {"q": np.array([4.5, 5.5, 6.5])})
    write_batch(tmp_path / "c.h5", [1, 2], structures={"e": np.array([4.0, 8.0])})
    with open_inputs(str(tmp_path)) as batch:
        assert batch.fields["q"].dtype == np.float64  # int32 and float64 promote
        assert batch.present("q").tolist() == [True, True, True, False, False]
        assert batch.present("e").tolist() == [True, True, False, True, True]
        assert np.isnan(batch.fill_value("e")) and batch.fill_value("q") is not None
        chunk, = batch.iter_chunks(["q", "e"])
    assert np.array_equal(chunk.atoms["q"], [1, 2, 3, 4.5, 5.5, 6.5, np.nan, np.nan, np.nan],
                          equal_nan=True)
    assert np.array_equal(chunk.structures["e"], [1, 2, np.nan, 4, 8], equal_nan=True)
    summary = json.loads(run("stats", tmp_path, "e", "--json").stdout)
    assert summary["stats"][0]["count"] == 4 and summary["stats"][0]["mean"] == 15 / 4
    assert "present in 3 of 5" in run("info", tmp_path).stdout
    out = tmp_path / "sel" / "low.h5"
    out.parent.mkdir()
    result = run("select", tmp_path, "--where", "e < 5", "-o", out)
    assert result.exit_code == 0, result.output
    with h5py.File(out) as h5:
        assert h5["structures/n_atoms"][()].tolist() == [2, 1, 1]
        assert h5["structures/source"][()].tolist() == [0, 0, 2]
        assert h5["structures/source_index"][()].tolist() == [0, 1, 0]
        assert list(h5.attrs["sources"].astype(str)) == [str(tmp_path / n)
                                                         for n in ("a.h5", "b.h5", "c.h5")]


LAYOUT_READER = """
import pickle, sys
import numpy as np
from segcli.io import open_inputs
with open(sys.argv[1], "rb") as f:
    layout = pickle.load(f)
with open_inputs(layout) as batch:
    chunks = batch.iter_chunks(["x"], structures=slice(int(sys.argv[2]), int(sys.argv[3])))
    print(batch.n_structures, float(sum(c.atoms["x"].sum() for c in chunks)))
"""


def test_a_layout_reopens_its_unchanged_file_without_reading_its_counts_again(tmp_path):
    """A cluster's tasks open the file again from the client's layout: its n_atoms, read when
    the layout was made, are taken as they are while the file's stamp (device, inode, size,
    modification time) holds, and read again once it changes."""
    path = write_batch(tmp_path / "a.h5", [3, 1, 4], {"x": np.arange(24.0).reshape(8, 3)})
    with open_inputs(str(path)) as batch:
        layout = batch.layout
    before = os.stat(path)
    with h5py.File(path, "r+") as f:  # the same shape and atom total: no check can tell
        f["structures/n_atoms"][:] = [4, 1, 3]
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    with open_inputs(layout) as batch:
        assert batch.n_atoms.tolist() == [3, 1, 4]  # the layout's, not read again
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    with open_inputs(layout) as batch:
        assert batch.n_atoms.tolist() == [4, 1, 3]
        assert [c.n_atoms.tolist() for c in batch.iter_chunks(["x"])] == [[4, 1, 3]]


@pytest.mark.parametrize("largest", [0, 255, 256, 65536, 2**32])
def test_a_pickled_layout_carries_its_counts_in_their_narrowest_type(tmp_path, largest):
    """What a cluster sends every worker: n_atoms as the narrowest unsigned integers that hold
    them (an eighth of the bytes for counts below 256), int64 and equal again once loaded."""
    counts = np.array([0, 1, largest, 7], np.int64)
    with open_inputs(str(write_batch(tmp_path / "a.h5", [2, 1],
                                     {"x": np.ones((3, 3))}))) as batch:
        layout = batch.layout._replace(n_atoms=(counts, counts[:0]))
    loaded = pickle.loads(pickle.dumps(layout))
    assert type(loaded) is type(layout)
    assert loaded[:4] == layout[:4] and loaded[5:] == layout[5:]
    for got, sent in zip(loaded.n_atoms, layout.n_atoms):
        assert got.dtype == np.int64 and got.tolist() == sent.tolist()
    itemsize = np.min_scalar_type(largest).itemsize
    assert len(pickle.dumps(layout._replace(n_atoms=(np.zeros(10**5, np.int64) + largest,)))) \
        < 10**5 * itemsize + 4096


def test_a_layout_reopens_in_another_process_reading_only_touched_files(shards, tmp_path):
    directory, members = shards
    n_atoms, x, *_ = joined(members)
    with open_inputs(str(directory / "*.h5")) as batch:
        layout = batch.layout
    (tmp_path / "layout.pkl").write_bytes(pickle.dumps(layout))
    os.rename(directory / "a.h5", tmp_path / "a.h5")  # the layout needs no look at it
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}

    def read(start, stop):
        return subprocess.run([sys.executable, "-c", LAYOUT_READER, tmp_path / "layout.pkl",
                               str(start), str(stop)], capture_output=True, text=True,
                              env=environment, cwd=tmp_path)

    done = read(5, 12)  # b.h5, c.h5 (no structures) and d.h5 only
    assert done.returncode == 0, done.stderr
    total, value = done.stdout.split()
    assert int(total) == len(n_atoms)
    assert float(value) == pytest.approx(x[offsets[5]:offsets[12]].sum(), rel=1e-12)
    failed = read(4, 6)
    assert failed.returncode != 0 and "a.h5: no such file" in failed.stderr
