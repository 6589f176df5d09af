"""`segcli select`: every dataset of the output against NumPy slicing of the input, on fresh
random files holding per-atom and per-structure fields, strings, presence masks and results."""

import shlex
import subprocess
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from segcli.cli import main

PER_STRUCTURE = ("structures", "present")


def run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def write_rich(path, seed=3, n_structures=40):
    """A segcli file written with h5py: per-atom positions (chunked, gzip), forces, numbers,
    charges (float32); per-structure energy (multiples of 0.5: ties), temperature (some NaN),
    step, cell, config_type (strings), spin and stress (present in only some structures);
    results max_norm_forces and score (float32) per structure and grad/d_forces per atom.
    Returns (n_atoms, {name: array}, {name: present mask})."""
    rng = np.random.default_rng(seed)
    s = n_structures
    n_atoms = rng.integers(0, 8, s)
    n_atoms[[0, s // 2]] = 0
    n = int(n_atoms.sum())
    forces = rng.normal(size=(n, 3))
    ids = np.repeat(np.arange(s), n_atoms)
    max_norm = np.zeros(s)
    np.maximum.at(max_norm, ids, np.linalg.norm(forces, axis=1))
    temperature = rng.uniform(100, 900, s)
    temperature[[3, 7, 11]] = np.nan
    present = {"spin": rng.random(s) < 0.6, "stress": rng.random(s) < 0.5}
    data = {
        "positions": rng.normal(size=(n, 3)), "forces": forces,
        "numbers": rng.integers(1, 90, n), "charges": rng.normal(size=n).astype(np.float32),
        "energy": rng.integers(-8, 8, s) * 0.5, "temperature": temperature,
        "step": np.arange(s) * 10, "cell": rng.normal(size=(s, 3, 3)),
        "config_type": rng.choice(["bulk", "slab", "a b", "αβ"], s).astype(object),
        "spin": np.where(present["spin"], rng.integers(-2, 3, s), 0),
        "stress": np.where(present["stress"][:, None], rng.normal(size=(s, 6)), np.nan),
        "max_norm_forces": max_norm,
        "score": rng.choice(np.float32([0.1, 0.2, 0.3]), s),
        "grad/d_forces": rng.normal(size=(n, 3)),
    }
    with h5py.File(path, "w") as f:
        f.attrs.update(format="segcli-batch", version=1, sources=["a.extxyz", "b.extxyz"])
        f["structures/n_atoms"] = n_atoms
        f.create_dataset("atoms/positions", data=data["positions"], chunks=(5, 3),
                         compression="gzip", shuffle=True, maxshape=(None, 3))
        for name in ("forces", "numbers", "charges"):
            f[f"atoms/{name}"] = data[name]
        f.create_dataset("structures/energy", data=data["energy"], chunks=(8,), compression="lzf")
        for name in ("temperature", "step", "cell", "spin", "stress"):
            f[f"structures/{name}"] = data[name]
        f.create_dataset("structures/config_type", data=data["config_type"],
                         dtype=h5py.string_dtype())
        f["structures/energy"].attrs["units"] = "eV"
        for name, fill in (("spin", 0), ("stress", np.nan)):
            f[f"present/{name}"] = present[name]
            f[f"structures/{name}"].attrs["fill_value"] = fill
        for name, per, op in (("max_norm_forces", "structure", "max_norm"),
                              ("score", "structure", "dot"), ("grad/d_forces", "atom", "rms_norm")):
            f[f"results/{name}"] = data[name]
            f[f"results/{name}"].attrs.update(op=op, fields=["forces"], per=per,
                                              precision="float64", created="2025-01-01")
        f["results/grad"].attrs["note"] = "a group attribute"
    return n_atoms, data, present


@pytest.fixture
def rich(tmp_path):
    path = tmp_path / "rich.h5"
    return (path, *write_rich(path))


def read_all(path):
    """{dataset name: (values (strings as str), dtype, chunks, compression, attrs)} and the root
    and group attributes of an HDF5 file."""
    datasets, groups = {}, {}

    def visit(name, obj):
        attrs = {k: repr(np.asarray(v).tolist()) for k, v in obj.attrs.items()}
        if isinstance(obj, h5py.Group):
            groups[name] = attrs
            return
        values = obj.asstr()[()] if h5py.check_string_dtype(obj.dtype) else obj[()]
        datasets[name] = (values, obj.dtype, obj.chunks and obj.chunks[1:], obj.compression,
                          attrs)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
        groups["/"] = {k: repr(np.asarray(v).tolist()) for k, v in f.attrs.items()}
    return datasets, groups


def assert_subset(source, output, kept):
    """Every dataset of `output` is that of `source` sliced to the structures `kept` (per-atom
    rows: their atom ranges), with the same dtype, chunk shape, filters and attributes; the
    root attributes are the source's and selected_from."""
    before, before_groups = read_all(source)
    after, after_groups = read_all(output)
    assert sorted(after) == sorted(before)
    n_atoms = before["structures/n_atoms"][0]
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    rows = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in kept] + [[]]).astype(int)
    for name, (values, *layout) in before.items():
        default = "structure" if name.split("/")[0] in PER_STRUCTURE else "atom"
        per = layout[-1].get("per", repr(default)).strip("'")
        expected = values[kept if per == "structure" else rows]
        got, *got_layout = after[name]
        assert got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
        assert got_layout == layout, name
    assert after_groups.pop("/") == {**before_groups.pop("/"), "selected_from": repr(str(source))}
    assert after_groups == before_groups


def select(source, out, *args, **kwargs):
    result = run("select", source, "-o", out, *args, **kwargs)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


E = 0.5  # an energy that several structures have


@pytest.mark.parametrize("wheres, expected", [
    (["energy < 0.5"], lambda d, p: d["energy"] < E),
    (["energy<=0.5"], lambda d, p: d["energy"] <= E),
    (["energy > 0.5"], lambda d, p: d["energy"] > E),
    (["  energy >=   +5e-1 "], lambda d, p: d["energy"] >= E),
    (["energy == .5"], lambda d, p: d["energy"] == E),
    (["energy != 0.5"], lambda d, p: d["energy"] != E),
    (["step >= 120", "step < 300", "energy <= 0.5"],
     lambda d, p: (d["step"] >= 120) & (d["step"] < 300) & (d["energy"] <= E)),
    (["config_type == bulk"], lambda d, p: d["config_type"] == "bulk"),
    (["config_type != 'a b'"], lambda d, p: d["config_type"] != "a b"),
    (['config_type == "αβ"', "max_norm_forces < 2"],
     lambda d, p: (d["config_type"] == "αβ") & (d["max_norm_forces"] < 2)),
    (["score <= 0.1"], lambda d, p: d["score"] == np.float32(0.1)),
    (["temperature != 500"], lambda d, p: ~np.isnan(d["temperature"])),
    (["temperature < inf"], lambda d, p: ~np.isnan(d["temperature"])),
    (["temperature == nan"], lambda d, p: np.isnan(d["temperature"])),
    (["temperature != NaN", "temperature > 400"], lambda d, p: d["temperature"] > 400),
    (["spin == 0"], lambda d, p: p["spin"] & (d["spin"] == 0)),
    (["spin <= 5"], lambda d, p: p["spin"]),
    (["energy > 100"], lambda d, p: np.zeros(len(d["energy"]), bool)),
])
def test_where_keeps_every_dataset_of_the_matching_structures(rich, tmp_path, wheres, expected):
    path, n_atoms, data, present = rich
    out = tmp_path / "out.h5"
    conditions = [a for w in wheres for a in ("--where", w)]
    result = select(path, out, *conditions)
    with np.errstate(invalid="ignore"):
        kept = np.flatnonzero(expected(data, present))
    if not len(kept):  # said, and nothing written unless asked for
        assert result.stderr == (f"{path}: no structure of {len(n_atoms)} is selected; {out} "
                                 "is not written (--allow-empty writes an empty file)\n")
        assert not out.exists()
        result = select(path, out, *conditions, "--allow-empty")
    assert_subset(path, out, kept)
    assert result.stderr.startswith(f"{out}: {len(kept)} of {len(n_atoms)} structures, "
                                    f"{n_atoms[kept].sum()} atoms")
    from segcli.io import open_batch

    with open_batch(out) as batch:  # a valid segcli file, however many structures it holds
        np.testing.assert_array_equal(batch.n_atoms, n_atoms[kept])


def test_copies_in_small_blocks_and_lists_combine_with_where(rich, tmp_path, monkeypatch):
    """Reading a few rows at a time gives the same file; a list (unordered, repeated, blank
    lines, spaces, from a file or stdin) keeps file order, and ANDs with --where."""
    from segcli.io import subset

    monkeypatch.setattr(subset, "BLOCK_BYTES", 40)
    path, _, data, _ = rich
    listed = "\n 17\n3\t\n\n39\n3\n0\n20\r\n5\n"
    (tmp_path / "list.txt").write_text(listed)
    select(path, tmp_path / "a.h5", "--structures-from", tmp_path / "list.txt", "-q")
    assert_subset(path, tmp_path / "a.h5", [0, 3, 5, 17, 20, 39])
    result = select(path, tmp_path / "b.h5", "--structures-from", "-", "--where", "energy < 0.5",
                    input=listed)
    kept = [s for s in (0, 3, 5, 17, 20, 39) if data["energy"][s] < E]
    assert_subset(path, tmp_path / "b.h5", kept)
    assert f"{len(kept)} of 40 structures" in result.stderr


def assert_error(result, code, *needles):
    """Exit `code`, one line on stderr naming the problem, no traceback."""
    assert result.exit_code == code, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("Error: "), result.stderr
    assert code == 2 or len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


@pytest.mark.parametrize("content, needle", [
    ("1\n2\nabc\n", "line 3: 'abc' is not a structure number"),
    ("12,3.4\n", "line 1: '12,3.4' is not a structure number"),
    ("1\n\n3.0\n", "line 3: '3.0'"),
    ("1\n-1\n", "line 2: structure -1 is out of range (the file has 40 structures: 0 to 39)"),
    ("40\n", "line 1: structure 40 is out of range"),
    ("structure\n1\n", "line 1: 'structure'"),
])
def test_bad_list_lines_exit_1_naming_the_line(rich, tmp_path, content, needle):
    path = rich[0]
    result = run("select", path, "-o", tmp_path / "out.h5", "--structures-from", "-",
                 input=content)
    assert_error(result, 1, "stdin, " + needle)
    (tmp_path / "list.txt").write_text(content)
    result = run("select", path, "-o", tmp_path / "out.h5", "--structures-from",
                 tmp_path / "list.txt")
    assert_error(result, 1, f"{tmp_path / 'list.txt'}, {needle}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.txt", "rich.h5"]


@pytest.mark.parametrize("where, code, needle", [
    ("energy <", 2, "'energy <' is not NAME OP VALUE"),
    ('__import__("os")', 2, "'__import__(\"os\")' is not NAME OP VALUE"),
    ("energy ~ 3", 2, "'energy ~ 3' is not NAME OP VALUE"),
    ("energy = 3", 2, "is not NAME OP VALUE"),
    ("energy < 3 4", 2, "is not NAME OP VALUE"),
    ("", 2, "'' is not NAME OP VALUE"),
    ("energy < abc", 2, "< compares numbers, and 'abc' is not one"),
    ("energy >= nan", 2, "nothing is >= nan (use energy == nan or energy != nan"),
    ("nosuch < 3", 1, ("--where 'nosuch < 3': no field or result 'nosuch'; the per-structure "
                       "ones are: config_type, energy, max_norm_forces, score, spin, step, "
                       "temperature")),
    ("forces < 3", 1, "'forces' is per atom; reduce it to one value per structure first"),
    ("grad/d_forces > 0", 1, "'grad/d_forces' is per atom"),
    ("cell < 3", 1, "'cell' has shape (3, 3) per structure"),
    ("config_type < 3", 1, "'config_type' holds strings; compare it with == or !="),
    ("energy == bulk", 1, "'energy' holds numbers (float64), and 'bulk' is not one"),
])
def test_bad_conditions_exit_2_or_1_and_write_nothing(rich, tmp_path, where, code, needle):
    result = run("select", rich[0], "--where", "energy < 1", "--where", where,
                 "-o", tmp_path / "out.h5")
    assert_error(result, code, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rich.h5"]


def test_usage_and_output_errors(rich, tmp_path):
    path = rich[0]
    out = tmp_path / "out.h5"
    assert_error(run("select", path, "-o", out), 2, "give --where")
    assert_error(run("select", path, "-o", path, "--where", "energy < 1"), 2, "is FILE itself")
    (tmp_path / "link.h5").symlink_to(path)
    assert_error(run("select", tmp_path / "link.h5", "-o", path, "--where", "energy < 1"), 2,
                 "is FILE itself")
    assert_error(run("select", path, "--where", "energy < 1"), 2, "'-o' / '--output'")
    out.write_bytes(b"keep me")
    assert_error(run("select", path, "-o", out, "--where", "energy < 1"), 1,
                 "already exists; use --force")
    assert out.read_bytes() == b"keep me"
    assert_error(run("select", path, "-o", tmp_path / "new.h5", "--structures-from",
                     tmp_path / "none.txt"), 1,
                 "none.txt: cannot read")
    assert_error(run("select", path, "-o", tmp_path / "new.h5", "--structures-from",
                     "/dev/zero"), 1,  # one endless line: refused, not read without end
                 "/dev/zero, line 1: longer than 1024 bytes, not a structure number")
    assert not (tmp_path / "new.h5").exists()
    select(path, out, "--where", "energy < 1", "--force")
    assert_subset(path, out, np.flatnonzero(rich[2]["energy"] < 1))
    result = run("--help")
    assert "select     Copy chosen structures to a new segcli file (or export them)." in \
        result.stdout
    result = run("select", "--help")
    assert "segcli select sample_data/metals.h5 --where 'energy < 1' -o low.h5" in result.stdout


def test_a_failure_while_writing_leaves_no_file(tmp_path):
    """A compressed chunk of the input that no longer inflates, met halfway through the copy:
    one line naming the file, and no output or temporary left."""
    import h5py

    rng = np.random.default_rng()
    path = tmp_path / "damaged.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="segcli-batch", version=1)
        f["structures/n_atoms"] = np.full(400, 5)
        f["structures/energy"] = rng.normal(size=400)
        f.create_dataset("atoms/forces", data=rng.normal(size=(2000, 3)), chunks=(100, 3),
                         compression="gzip")
        chunk = f["atoms/forces"].id.get_chunk_info(15)
    with open(path, "r+b") as raw:
        raw.seek(chunk.byte_offset + 8)
        raw.write(b"\xff" * 32)
    result = run("select", path, "-o", tmp_path / "out.h5", "--where", "energy < 10")
    assert_error(result, 1, str(path), "/atoms/forces")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.h5"]


def test_files_without_structures_or_atoms(tmp_path):
    """N = 0 (structures of no atoms) and S = 0 files give valid files."""
    from batch_reference import write_batch

    path = write_batch(tmp_path / "no_atoms.h5", [0, 0, 0], {"forces": np.zeros((0, 3))},
                       {"energy": np.array([1.0, -2.0, 3.0])})
    select(path, tmp_path / "a.h5", "--where", "energy > 0")
    assert_subset(path, tmp_path / "a.h5", [0, 2])
    path = write_batch(tmp_path / "empty.h5", np.zeros(0, int), {"forces": np.zeros((0, 3))},
                       {"energy": np.zeros(0)})
    result = select(path, tmp_path / "b.h5", "--where", "energy > 0", "--allow-empty")
    assert_subset(path, tmp_path / "b.h5", [])
    assert "0 of 0 structures, 0 atoms" in result.stderr
    assert_error(run("select", path, "-o", tmp_path / "c.h5", "--structures-from", "-",
                     input="0\n"), 1, "stdin, line 1: structure 0 is out of range (the file "
                 "has 0 structures: none)")
    select(path, tmp_path / "c.h5", "--structures-from", "-", "--allow-empty", input="\n")
    assert_subset(path, tmp_path / "c.h5", [])


def test_an_extxyz_file_streams_its_structures(tmp_path, extxyz, ase_reference):
    n_atoms, atoms, structures = ase_reference(extxyz)
    out = tmp_path / "out.h5"
    select(extxyz, out, "--where", "energy < 0.3", "--where", "step != 2")
    kept = np.flatnonzero((structures["energy"] < 0.3) & (structures["step"] != 2))
    rows = np.concatenate([np.arange(n_atoms[:s].sum(), n_atoms[:s + 1].sum()) for s in kept])
    with h5py.File(out, "r") as f:
        assert f.attrs["selected_from"] == str(extxyz)
        np.testing.assert_array_equal(f["structures/n_atoms"][()], n_atoms[kept])
        for name in ("numbers", "positions", "momenta", "forces"):
            np.testing.assert_array_equal(f[f"atoms/{name}"][()], atoms[name][rows])
        for name in ("cell", "pbc", "energy", "stress", "temperature", "step"):
            np.testing.assert_array_equal(f[f"structures/{name}"][()], structures[name][kept])
        assert list(f["structures/label"].asstr()[()]) == [f"frame{s}" for s in kept]


def test_results_stored_by_reduce_and_grad_in_place(tmp_path):
    """--where on a result that `reduce --in-place` stored; a per-atom `grad` result and the
    per-structure one are sliced with the fields."""
    from batch_reference import random_batch, reduce_reference

    path = tmp_path / "r.h5"
    n_atoms, data = random_batch(path, seed=11, n_structures=30)
    assert run("reduce", path, "max_norm", "x", "--in-place", "-q").exit_code == 0
    assert run("grad", path, "rms_norm", "y", "--in-place", "-q").exit_code == 0
    norms = reduce_reference("max_norm", n_atoms, data["x"])
    limit = np.median(norms)
    select(path, tmp_path / "out.h5", "--where", f"max_norm_x < {float(limit)!r}")
    kept = np.flatnonzero(norms < limit)
    assert_subset(path, tmp_path / "out.h5", kept)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert f["results/rms_norm_y/d_y"].attrs["per"] == "atom"
        np.testing.assert_allclose(f["results/max_norm_x"][()], norms[kept], rtol=1e-12)


def test_a_shell_pipeline_from_reduce_through_awk(rich, tmp_path):
    path, n_atoms, data, _ = rich
    limit = float(np.median(data["max_norm_forces"]))
    segcli = f"{shlex.quote(sys.executable)} -m segcli"
    command = (f"{segcli} reduce {path} max_norm forces "
               f"| awk -F, 'NR>1 && $2 < {limit!r} {{print $1}}' "
               f"| {segcli} select {path} --structures-from - -o {tmp_path / 'clean.h5'}")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    kept = np.flatnonzero(data["max_norm_forces"] < limit)
    assert_subset(path, tmp_path / "clean.h5", kept)
    assert result.stderr.endswith(f"clean.h5: {len(kept)} of 40 structures, "
                                  f"{n_atoms[kept].sum()} atoms\n")
