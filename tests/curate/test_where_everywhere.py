"""Selection everywhere (SPEC §3c): --where on reduce, grad, stats and fit-e0 equal to the same
command on the file `select --where` writes; stats --by against NumPy per group; info's
element and string-value counts against collections.Counter. Random files written by h5py,
and a file written by ASE."""

import collections
import csv
import glob
import io
import json

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from invoke import ok, run

KINDS = np.array(["bulk", "slab", "mol", "a b"], dtype=object)




def random_file(path, seed, n_structures=60):
    """A random segcli file: per atom x (N, 3), numbers (N,); per structure s, kind (ints),
    config_type (strings) and t (some NaN). Returns (n_atoms, {name: array})."""
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(0, 7, n_structures)
    n = int(n_atoms.sum())
    atoms = {"x": rng.normal(size=(n, 3)), "numbers": rng.integers(1, 6, n)}
    structures = {"s": rng.normal(size=n_structures), "kind": rng.integers(-1, 3, n_structures),
                  "t": np.where(rng.random(n_structures) < 0.2, np.nan,
                                rng.normal(size=n_structures)),
                  "config_type": rng.choice(KINDS, n_structures)}
    write_batch(path, n_atoms, atoms, {**structures, "config_type": np.array(
        structures["config_type"], dtype=h5py.string_dtype())})
    return n_atoms, {**atoms, **structures}


def ase_file(path, seed, n_structures=24):
    """An extxyz file written by ASE: energies, forces and config_type; returns its path."""
    import ase.io
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(n_structures):
        n = int(rng.integers(1, 6))
        atoms = Atoms(numbers=rng.choice([1, 6, 8], n), positions=rng.normal(0, 2, (n, 3)))
        atoms.info["config_type"] = str(rng.choice(KINDS[:3]))
        atoms.calc = SinglePointCalculator(atoms, energy=float(rng.normal()),
                                           forces=rng.normal(size=(n, 3)))
        frames.append(atoms)
    ase.io.write(path, frames, format="extxyz")
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """FILE arguments: one segcli file, two read as one batch (a glob) and an extxyz file."""
    root = tmp_path_factory.mktemp("where")
    random_file(root / "one.h5", 1)
    (root / "two").mkdir()
    for k in range(2):
        random_file(root / "two" / f"part-{k}.h5", 10 + k, 30)
    return {"h5": root / "one.h5", "glob": f"{root / 'two'}/*.h5",
            "ase": ase_file(root / "frames.extxyz", 4)}


def table(stdout):
    """A csv table as its header and rows."""
    rows = list(csv.reader(io.StringIO(stdout)))
    return rows[0], rows[1:]


def kept_numbers(inputs, which):
    """The numbers of the structures that CONDITIONS[which] keep, evaluated with NumPy on the
    data as h5py or ASE reads it."""
    if which == "ase":
        import ase.io

        return [k for k, atoms in enumerate(ase.io.read(inputs["ase"], ":"))
                if atoms.info["config_type"] == "bulk"]
    paths = [inputs["h5"]] if which == "h5" else sorted(glob.glob(inputs["glob"]))
    columns = collections.defaultdict(list)
    for path in paths:
        with h5py.File(path) as h5:
            for name in ("s", "kind", "t", "config_type"):
                columns[name].append(h5[f"structures/{name}"][()])
    c = {name: np.concatenate(arrays) for name, arrays in columns.items()}
    keep = ((c["config_type"] != b"mol") & (c["s"] < 0.7) if which == "h5"
            else (c["kind"] >= 0) & ~np.isnan(c["t"]))
    return np.flatnonzero(keep).tolist()


CONDITIONS = {"h5": ["--where", "config_type != mol", "--where", "s < 0.7"],
              "glob": ["--where", "kind >= 0", "--where", "t != nan"],
              "ase": ["--where", "config_type == bulk"]}
COMMANDS = {"h5": [("reduce", "rms_norm", "x", "+", "count"), ("grad", "rms_norm", "x"),
                   ("stats", "x", "s", "--per-element"), ("fit-e0", "--energy", "s")],
            "glob": [("reduce", "dot", "x", "x", "--precision", "float32"),
                     ("stats", "x", "t", "--by", "config_type")],
            "ase": [("reduce", "sum", "forces"), ("stats", "forces", "energy", "--per-atom"),
                    ("fit-e0",)]}


@pytest.mark.parametrize("which, command", [(w, c) for w, cs in COMMANDS.items() for c in cs])
def test_where_equals_the_command_on_the_selected_file(tmp_path, inputs, which, command):
    path, conditions = inputs[which], CONDITIONS[which]
    chosen = tmp_path / "chosen.h5"
    ok("select", path, *conditions, "-o", chosen, "-q")
    name, *rest = command
    device = ["--device", "cpu"] if name in ("reduce", "grad") else []
    json_out = [] if name in ("reduce", "grad") else ["--json"]
    picked = ok(name, path, *rest, *conditions, *device, *json_out).stdout
    wanted = ok(name, chosen, *rest, *device, *json_out).stdout
    if name in ("reduce", "grad"):
        header, rows = table(picked)
        their_header, theirs = table(wanted)
        numbers = kept_numbers(inputs, which)
        assert numbers and len(numbers) < len(table(ok("reduce", path, "count").stdout)[1])
        values = [c for c in header if c not in ("structure", "source", "source_index")]
        columns = [header.index(c) for c in values]
        assert [c for c in their_header if c not in ("structure", "source", "source_index")] \
            == values
        theirs_columns = [their_header.index(c) for c in values]
        assert [[row[k] for k in columns] for row in rows] == \
            [[row[k] for k in theirs_columns] for row in theirs]  # bits, via repr
        assert [numbers[int(row[0])] for row in theirs] == [int(row[0]) for row in rows]
        return
    mine, reference = json.loads(picked), json.loads(wanted)
    if name == "fit-e0":
        assert mine["structures"] == reference["structures"]
        np.testing.assert_allclose([e["e0"] for e in mine["e0"]],
                                   [e["e0"] for e in reference["e0"]], rtol=1e-9, atol=1e-12)
        assert [e["number"] for e in mine["e0"]] == [e["number"] for e in reference["e0"]]
        return
    assert (mine["structures"], mine["atoms"]) == (reference["structures"], reference["atoms"])
    assert len(mine["stats"]) == len(reference["stats"])
    for a, b in zip(mine["stats"], reference["stats"]):
        exact = {k: v for k, v in a.items() if k not in ("mean", "std", "rms")}
        assert exact == {k: v for k, v in b.items() if k not in ("mean", "std", "rms")}
        np.testing.assert_allclose([a[k] for k in ("mean", "std", "rms")],
                                   [b[k] for k in ("mean", "std", "rms")], rtol=1e-12, atol=1e-15)


def test_where_into_hdf5_gives_nan_rows_and_shards_merge_to_one_run(tmp_path):
    path = tmp_path / "f.h5"
    n_atoms, data = random_file(path, 3, 40)
    where = ["--where", "config_type == bulk"]
    kept = data["config_type"] == "bulk"
    for op in (["rms_norm", "x"], ["count"]):
        whole = tmp_path / f"{op[0]}.h5"
        ok("reduce", path, *op, *where, "-o", whole, "--device", "cpu", "-q")
        for k in range(3):
            ok("reduce", path, *op, *where, "-o", tmp_path / f"{op[0]}-{{shard}}.h5", "--shard",
               f"{k}/3", "--device", "cpu", "-q")
        merged = tmp_path / f"{op[0]}-merged.h5"
        ok("merge", *(tmp_path / f"{op[0]}-{k}.h5" for k in range(3)), "-o", merged)
        name = "_".join(op)
        stdout = table(ok("reduce", path, *op, *where, "--device", "cpu").stdout)[1]
        with h5py.File(whole) as a, h5py.File(merged) as b:
            rows = a[f"results/{name}"][()]
            assert rows.dtype == np.float64 and list(a[f"results/{name}"].attrs["where"]) == \
                ["config_type == bulk"]
            np.testing.assert_array_equal(b[f"results/{name}"][()], rows)
        assert np.isnan(rows[~kept]).all()
        assert [repr(float(v)) for v in rows[kept]] == [repr(float(r[1])) for r in stdout]
        if op == ["count"]:
            np.testing.assert_array_equal(rows[kept], n_atoms[kept])
        else:
            norms = rows
    ok("reduce", path, "rms_norm", "x", *where, "--in-place", "--device", "cpu", "-q")
    with h5py.File(path) as h5:
        np.testing.assert_array_equal(h5["results/rms_norm_x"][()], norms)


@pytest.mark.parametrize("command, code", [
    (["reduce", "rms_norm", "x", "--device", "cpu"], 0), (["grad", "rms_norm", "x"], 0),
    (["stats", "x"], 1), (["fit-e0", "--energy", "s"], 1)])
def test_where_that_selects_nothing(inputs, command, code):
    name, *rest = command
    result = run(name, inputs["h5"], *rest, "--where", "s > 100")
    assert result.exit_code == code, result.output
    line = (f"{inputs['h5']}: --where 's > 100' selects none of the 60 structure(s)"
            + ("; nothing to compute" if code else ""))
    assert result.stderr.strip() == ("Error: " + line if code else line)
    assert result.stdout == ("" if code else
                             {"reduce": "structure,rms_norm_x\n",
                              "grad": "structure,atom,d_x_0,d_x_1,d_x_2\n"}[name])


def reference_groups(values, groups):
    """field, group, component -> (count, mean, std, min, max) in NumPy float64."""
    out = {}
    for g in np.unique(groups):
        rows = values[groups == g].reshape(int(np.sum(groups == g)), -1)
        columns = [rows[:, k] for k in range(rows.shape[1])]
        if rows.shape[1] > 1:
            columns.append(np.linalg.norm(rows, axis=1))
        for k, column in enumerate(columns):
            out[g, k] = (len(column), column.mean(), column.std(), column.min(), column.max())
    return out


@pytest.mark.parametrize("by", ["config_type", "kind"])
def test_stats_by_a_field_equals_numpy_per_group_and_merges_exactly(tmp_path, by):
    path = tmp_path / "f.h5"
    n_atoms, data = random_file(path, 7, 50)
    result = json.loads(ok("stats", path, "x", "s", "--by", by, "--json").stdout)
    assert result["by"] == by
    per_atom = np.repeat(data[by], n_atoms)
    for name, groups in (("x", per_atom), ("s", data[by])):
        wanted = reference_groups(data[name], groups)
        rows = [r for r in result["stats"] if r["field"] == name]
        assert len(rows) == len(wanted)
        for k, row in enumerate(rows):
            component = k % (4 if name == "x" else 1)
            count, mean, std, low, high = wanted[row["group"], component]
            assert (row["count"], row["min"], row["max"]) == (count, low, high)
            np.testing.assert_allclose([row["mean"], row["std"]], [mean, std], rtol=1e-12,
                                       atol=1e-15)
    ok("stats", path, "x", "s", "--by", by, "-o", tmp_path / "one.h5", "-q")
    for k in range(3):
        ok("stats", path, "x", "s", "--by", by, "--shard", f"{k}/3", "-o",
           tmp_path / "part-{shard}.h5", "-q")
    ok("merge", *(tmp_path / f"part-{k}.h5" for k in range(3)), "-o", tmp_path / "merged.h5")
    with h5py.File(tmp_path / "one.h5") as a, h5py.File(tmp_path / "merged.h5") as b:
        for name in ("x", "s"):
            for key in ("count", "mean", "m2", "min", "max", "group"):
                np.testing.assert_array_equal(b[f"stats/{name}/{key}"][()],
                                              a[f"stats/{name}/{key}"][()])
    table_text = ok("stats", path, "s", "--by", by).stdout.splitlines()
    assert table_text[0].split()[:3] == ["field", by, "component"]


@pytest.mark.parametrize("which", ["h5", "ase"])
def test_info_counts_elements_and_string_values(tmp_path, inputs, which):
    import ase.io

    path = inputs[which]
    if which == "h5":
        path = tmp_path / "f.h5"
        n_atoms, data = random_file(path, 2, 80)
        labels = np.arange(80) % 25  # 25 distinct values: the 20 most common, then 5 more
        with h5py.File(path, "a") as h5:
            h5["structures/label"] = np.array([f"L{k}" for k in labels],
                                              dtype=h5py.string_dtype())
        numbers = np.split(data["numbers"], np.cumsum(n_atoms)[:-1])
        strings = {"config_type": list(data["config_type"]), "label": [f"L{k}" for k in labels]}
    else:
        frames = ase.io.read(path, ":")
        numbers = [a.numbers for a in frames]
        strings = {"config_type": [a.info["config_type"] for a in frames]}
    summary = json.loads(ok("info", "--json", path).stdout)
    atoms = collections.Counter(int(z) for n in numbers for z in n)
    holding = collections.Counter(int(z) for n in numbers for z in set(n.tolist()))
    assert [(e["number"], e["atoms"], e["structures"]) for e in summary["elements"]] == \
        [(z, atoms[z], holding[z]) for z in sorted(atoms)]
    assert set(summary["values"]) == set(strings)
    for name, values in strings.items():
        counts = collections.Counter(values)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:20]
        assert summary["values"][name] == {"distinct": len(counts), "most_common": dict(ranked)}
    text = ok("info", path).stdout
    assert "elements:" in text and f"values of config_type: {len(set(strings['config_type']))} " \
        "distinct" in text
    if which == "h5":
        assert "  … and 5 more" in text.splitlines()
