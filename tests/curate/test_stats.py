"""`segcli stats` and `segcli fit-e0` against NumPy float64 (and numpy.linalg.lstsq) on fresh
random files, edge cases, and their errors."""

import itertools
import json

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli import shards
from segcli.cli import main
from segcli.curate import statistics as stats
from segcli.curate.statistics import MOMENT_NAMES, Moments, field_stats, leaf_stats, merge_stats
from segcli.io import open_batch

REL = 1e-12


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def stats_json(*args):
    result = run("stats", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def assert_one_line_error(result, code, *needles):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


def reference_rows(name, values, element=None):
    """The expected rows of one field: each component, then the norm of vector rows."""
    values = np.asarray(values, np.float64)
    rows = values.reshape(len(values), -1)
    columns = [rows[:, k] for k in range(rows.shape[1])]
    names = ([""] if values.ndim == 1 else
             ["_".join(map(str, i)) for i in np.ndindex(*values.shape[1:])])
    if values.ndim > 1:
        columns.append(np.linalg.norm(rows, axis=1))
        names.append("norm")
    out = []
    for component, column in zip(names, columns):
        row = {"field": name, "component": component, "count": len(column)}
        if element is not None:
            row["element"] = element
        if len(column):
            row.update(mean=np.mean(column), std=np.std(column),
                       rms=np.sqrt(np.mean(column * column)), min=column.min(), max=column.max())
        else:
            row.update(dict.fromkeys(("mean", "std", "rms", "min", "max")))
        out.append(row)
    return out


def assert_rows_match(got, wanted):
    assert len(got) == len(wanted)
    for g, w in zip(got, wanted):
        for key in ("field", "component", "count", "element"):
            assert g.get(key) == w.get(key), (g, w)
        for key in ("min", "max"):  # exactly, but for norms computed in another order
            assert g[key] == (w[key] if g["component"] != "norm" else
                              pytest.approx(w[key], rel=1e-15)), (key, g, w)
        for key in ("mean", "std", "rms"):
            if w[key] is None:
                assert g[key] is None
            else:
                assert g[key] == pytest.approx(w[key], rel=REL, abs=1e-300), (key, g, w)


@pytest.fixture(params=["C", "NumPy"])
def both_paths(request, monkeypatch):
    """The moments in C (_moments.c) and, where the C source cannot be had, by NumPy's passes:
    each case once each way."""
    monkeypatch.setenv("SEGCLI_NATIVE_STATS", "1" if request.param == "C" else "0")
    stats._native_moments.cache_clear()
    assert (stats._native_moments() is not None) == (request.param == "C")
    yield request.param
    stats._native_moments.cache_clear()


@pytest.fixture
def random_file(tmp_path):
    return make_random_file(tmp_path)


def make_random_file(tmp_path):
    """Random structures (some empty) with per-atom float64 vectors, float32 and integer
    scalars, atomic numbers, and per-structure energy and stress: (path, n_atoms, arrays)."""
    rng = np.random.default_rng()
    n_atoms = rng.integers(0, 12, 70)
    n_atoms[[3, 40]] = 0
    n = int(n_atoms.sum())
    atoms = {"forces": rng.normal(0.5, 2.0, (n, 3)),
             "charges": rng.normal(-1.0, 0.3, n).astype(np.float32),
             "tags": rng.integers(-5, 9, n).astype(np.int32),
             "numbers": rng.choice([1, 6, 8, 29], n)}
    structures = {"energy": rng.normal(-50.0, 10.0, len(n_atoms)),
                  "stress": rng.normal(0.2, 0.1, (len(n_atoms), 6))}
    path = write_batch(tmp_path / "random.h5", n_atoms, atoms, structures)
    return path, n_atoms, {**atoms, **structures}


@pytest.mark.parametrize("chunk_atoms", [1, 13, 1 << 21])
def test_stats_match_numpy_float64(random_file, chunk_atoms, both_paths):
    path, _, data = random_file
    names = ["forces", "charges", "tags", "energy", "stress"]
    got = stats_json(path, *names, "--chunk-atoms", chunk_atoms)
    wanted = [row for name in names for row in reference_rows(name, data[name])]
    assert_rows_match(got["stats"], wanted)
    assert got["structures"] == len(data["energy"]) and got["atoms"] == len(data["forces"])


def test_per_element_and_per_atom(random_file):
    path, n_atoms, data = random_file
    got = stats_json(path, "forces", "energy", "--per-element", "--per-atom", "--chunk-atoms", 9)
    numbers = data["numbers"]
    wanted = [row for z in np.unique(numbers)
              for row in reference_rows("forces", data["forces"][numbers == z], int(z))]
    has_atoms = n_atoms > 0
    wanted += reference_rows("energy", data["energy"][has_atoms] / n_atoms[has_atoms])
    assert_rows_match(got["stats"], wanted)
    assert {row["symbol"] for row in got["stats"] if "symbol" in row} == {"H", "C", "O", "Cu"}


def test_structure_ranges_combine_exactly(random_file):
    """Statistics of disjoint structure ranges (as shards compute them) merged with Chan's
    formulas equal those of the whole file, grouped or not."""
    path, _, _ = random_file
    with open_batch(path) as batch:
        whole = field_stats(batch, ["forces", "energy"], per_element=True)
        cuts = [0, 11, 12, 45, batch.n_structures]
        parts = [field_stats(batch, ["forces", "energy"], per_element=True, chunk_atoms=7,
                             structures=slice(a, b)) for a, b in itertools.pairwise(cuts)]
    for name in ("forces", "energy"):
        merged = parts[0][name].moments
        for part in reversed(parts[1:]):  # any order
            merged = part[name].moments.merge(merged)
        expected = whole[name].moments
        np.testing.assert_array_equal(merged.count, expected.count)
        np.testing.assert_array_equal(merged.min, expected.min)
        np.testing.assert_array_equal(merged.max, expected.max)
        # a mean near 0 (one run in a few thousand: 6e-5 of values near 1) rounds as the
        # values it sums do, not as itself
        scale = np.abs(expected.rms[expected.count > 0]).max()
        for key in ("mean", "std", "rms"):
            np.testing.assert_allclose(getattr(merged, key)[merged.count > 0],
                                       getattr(expected, key)[expected.count > 0], rtol=REL,
                                       atol=REL * scale)


def test_moments_of_groups_and_merge_with_empty():
    values = np.array([[1.0, -2.0], [3.0, 4.0], [5.0, 0.0]])
    m = Moments.of(values, np.array([2, 0, 2]), n_groups=3)
    np.testing.assert_array_equal(m.count, [1, 0, 2])
    np.testing.assert_array_equal(m.mean[[0, 2]], [[3.0, 4.0], [3.0, -1.0]])
    np.testing.assert_array_equal(m.m2[2], [8.0, 2.0])
    empty = Moments.empty(3, 2)
    for merged in (m.merge(empty), empty.merge(m)):
        for key in ("count", "mean", "m2", "min", "max"):
            np.testing.assert_array_equal(getattr(merged, key), getattr(m, key))


def test_edge_cases_ties_zero_vectors_one_structure_and_no_atoms(tmp_path):
    path = write_batch(tmp_path / "ties.h5", [4], {"forces": np.zeros((4, 3)),
                                                   "q": np.full(4, 2.5, np.float32)},
                       {"energy": [-3.0]})
    rows = stats_json(path, "forces", "q", "energy")["stats"]
    assert all(row["std"] == 0.0 for row in rows)
    assert [row["rms"] for row in rows] == [0.0] * 4 + [2.5, 3.0]
    assert [row["min"] for row in rows] == [row["max"] for row in rows]
    empty = write_batch(tmp_path / "empty.h5", [0, 0], {"forces": np.zeros((0, 3))},
                        {"energy": [1.0, 2.0]})
    got = stats_json(empty, "forces", "energy", "--per-atom")
    assert [row["count"] for row in got["stats"]] == [0, 0, 0, 0, 0]
    assert all(row["mean"] is None for row in got["stats"])
    table = run("stats", empty, "forces").output
    assert table.splitlines()[0].split() == ["field", "component", "count", "mean", "std",
                                             "rms", "min", "max"]
    assert table.splitlines()[1].split() == ["forces", "0", "0", "-", "-", "-", "-", "-"]


def test_partial_fields_leave_out_absent_structures(tmp_path):
    """A field that only some structures have (NaN where filled) counts only where present."""
    n_atoms = np.array([2, 3, 1, 2])
    stress = np.random.default_rng().normal(size=(4, 6))
    stress[[1, 2]] = np.nan
    path = write_batch(tmp_path / "partial.h5", n_atoms, {}, {"stress": stress})
    with h5py.File(path, "r+") as f:
        f["structures/stress"].attrs["fill_value"] = np.nan
        f["present/stress"] = np.array([True, False, False, True])
    assert_rows_match(stats_json(path, "stress")["stats"], reference_rows("stress", stress[[0, 3]]))
    stress[3, 2] = np.nan
    with h5py.File(path, "r+") as f:
        f["structures/stress"][3] = stress[3]
    assert_one_line_error(run("stats", path, "stress"), 1, "'stress' holds 1 NaN", "structure 3")


def test_stats_of_a_stored_result_and_to_a_file(tmp_path, random_file):
    path, _, data = random_file
    assert run("reduce", path, "max_norm", "forces", "--in-place").exit_code == 0
    with h5py.File(path) as f:
        stored = f["results/max_norm_forces"][()]
    assert_rows_match(stats_json(path, "max_norm_forces")["stats"],
                      reference_rows("max_norm_forces", stored))
    out = tmp_path / "stats.h5"
    assert run("stats", path, "forces", "--per-element", "-o", out).exit_code == 0
    with h5py.File(out) as f:
        assert f.attrs["format"] == "segcli-stats" and f.attrs["structures"] == "0:70"
        group = f["stats/forces"]
        numbers = data["numbers"]
        np.testing.assert_array_equal(group["element"][()], np.unique(numbers))
        np.testing.assert_array_equal(group["count"][()], np.bincount(numbers)[np.unique(numbers)])
        np.testing.assert_array_equal(group["max"][0, :3], data["forces"][numbers == 1].max(axis=0))
    assert_one_line_error(run("stats", path, "forces", "-o", out), 1, "already exists")


@pytest.mark.parametrize("args, code, needles", [
    (["nope"], 1, ["no field 'nope'"]),
    (["forces", "--per-element", "--structures", "99:"], 1, ["selects no structure"]),
    (["--per-element", "forces"], 0, []),
    (["forces", "--chunk-atoms", "0"], 2, ["--chunk-atoms"]),
    (["energy", "stress", "--per-element"], 2,
     ["--per-element applies to per-atom fields; energy, stress are not"]),
    (["forces", "--per-atom"], 2, ["--per-atom applies to per-structure fields; forces is not"]),
])
def test_stats_errors(random_file, args, code, needles):
    path, _, _ = random_file
    assert_one_line_error(run("stats", path, *args), code, *needles)


def test_stats_refuses_nan_bad_numbers_and_missing_numbers(tmp_path):
    forces = np.ones((5, 3))
    forces[[1, 4], 0] = np.nan
    path = write_batch(tmp_path / "nan.h5", [2, 3],
                       {"forces": forces, "numbers": [1, 2, 3, 200, 1]})
    assert_one_line_error(run("stats", path, "forces"), 1, "'forces' holds 2 NaN", "structure 0")
    assert_one_line_error(run("stats", path, "numbers", "--per-element"), 1, "200",
                          "structure 1", "not an atomic number")
    bare = write_batch(tmp_path / "bare.h5", [2], {"forces": np.ones((2, 3))})
    assert_one_line_error(run("stats", bare, "forces", "--per-element"), 1, "no field 'numbers'")


@pytest.mark.parametrize("dtype, bad", [(np.int64, -3), (np.int32, 119), (np.uint8, 255),
                                        (np.int8, -1), (np.uint16, 1000)])
def test_a_number_that_is_no_atomic_number_is_named_in_any_chunk(tmp_path, both_paths, dtype,
                                                                 bad):
    """Numbers as a file stores them, checked as the moments read them (in C) or before (the
    NumPy passes): the first bad one is named, in the first chunk or a later one."""
    rng = np.random.default_rng(8)
    n_atoms = rng.integers(1, 9, 300)
    numbers = rng.integers(1, 100, n_atoms.sum()).astype(dtype)
    first = int(n_atoms[:250].sum()) + 1
    numbers[first], numbers[-1] = bad, bad
    path = write_batch(tmp_path / "numbers.h5", n_atoms,
                       {"forces": rng.normal(size=(n_atoms.sum(), 3)), "numbers": numbers})
    for chunk_atoms in (50, 1 << 21):
        assert_one_line_error(run("stats", path, "forces", "--per-element", "--chunk-atoms",
                                  chunk_atoms), 1, f"holds {bad} in structure 250",
                              "not an atomic number")


def test_a_refused_run_leaves_no_reading_thread_behind(tmp_path):
    """stats and fit-e0 refusing a later chunk (a bad atomic number, a NaN energy) stop and
    join the thread that reads ahead before the error leaves them, even while the error (and
    its traceback, holding their frames) is kept: none is left for the garbage collector to
    join later, wherever it runs (a collection inside an h5py call, joining a reader that
    waits for h5py's lock, hung a process)."""
    import threading

    from segcli.errors import DataError

    rng = np.random.default_rng(9)
    n_atoms = rng.integers(1, 9, 300)
    numbers = rng.integers(1, 100, n_atoms.sum())
    energy = rng.normal(size=300)
    energy[250] = np.nan
    bad_numbers = numbers.copy()
    bad_numbers[int(n_atoms[:250].sum())] = 119
    path = write_batch(tmp_path / "bad.h5", n_atoms, {
        "forces": rng.normal(size=(n_atoms.sum(), 3)), "numbers": bad_numbers})
    nan_energy = write_batch(tmp_path / "energy.h5", n_atoms, {"numbers": numbers},
                             {"energy": energy})
    def readers():
        return {t.ident for t in threading.enumerate() if t.name == "segcli-prefetch"}

    before, kept = readers(), []
    for file, run_it in (
            (path, lambda b: field_stats(b, ["forces"], per_element=True, chunk_atoms=50)),
            (nan_energy, lambda b: stats.solve_e0(b, chunk_atoms=50))):
        with open_batch(file) as batch:
            with pytest.raises(DataError) as refused:
                run_it(batch)
            kept.append(refused.value)
            assert readers() <= before
    assert "not an atomic number" in str(kept[0]) and "NaN" in str(kept[1])


# --- leaves of many structures, chunks of many leaves, blocks of the cache -----------------

def stats_rows(path, names, **options):
    with open_batch(path) as batch:
        return [row for s in field_stats(batch, names, **options).values() for row in s.rows()]


def per_element_rows(name, values, numbers):
    return [row for z in np.unique(numbers)
            for row in reference_rows(name, values[numbers == z], int(z))]


@pytest.fixture
def many_leaves(monkeypatch):
    """Few leaves of many structures each, and blocks of a few rows: leaves of many blocks."""
    monkeypatch.setattr(shards, "LEAVES", 6)
    monkeypatch.setattr(stats, "NATIVE_BLOCK_ROWS", 5)


@pytest.mark.parametrize("chunk_atoms", [7, 60, 1 << 21])
def test_leaves_of_many_structures_match_numpy(random_file, many_leaves, chunk_atoms, both_paths):
    path, n_atoms, data = random_file
    got = stats_rows(path, ["forces", "charges", "tags", "energy", "stress"], per_element=True,
                     per_atom=True, chunk_atoms=chunk_atoms)
    numbers, has_atoms = data["numbers"], n_atoms > 0
    wanted = [row for name in ("forces", "charges", "tags")
              for row in per_element_rows(name, data[name], numbers)]
    wanted += reference_rows("energy", data["energy"][has_atoms] / n_atoms[has_atoms])
    wanted += reference_rows("stress", data["stress"][has_atoms] / n_atoms[has_atoms, None])
    assert_rows_match(got, wanted)


def moments_of(result):
    return {(name, key): getattr(s.moments, key) for name, s in result.items()
            for key in MOMENT_NAMES}


@pytest.mark.parametrize("chunk_atoms", [40, 1 << 21])
@pytest.mark.parametrize("per_element", [False, True])
def test_leaves_give_the_same_bits_in_any_split_and_blocking(random_file, monkeypatch,
                                                             per_element, chunk_atoms,
                                                             both_paths):
    """The leaves' moments do not depend on which leaves share a chunk or a block, nor on
    where a run of leaves starts (only a leaf bigger than a chunk is cut, from its start):
    what shards and clusters rely on."""
    path, n_atoms, _ = random_file
    names = ["forces", "tags", "energy"]
    options = {"per_element": per_element, "per_atom": True, "chunk_atoms": chunk_atoms}
    monkeypatch.setattr(shards, "LEAVES", 9)
    monkeypatch.setattr(stats, "NATIVE_BLOCK_ROWS", 3)  # leaves of several blocks
    leaves = shards.leaf_bounds(n_atoms)
    with open_batch(path) as batch:
        whole = moments_of(merge_stats([leaf_stats(batch, names, leaves, **options)]))
        for cuts in [[0, 1, 5, 9], [0, 4, 9], [0, 9]]:
            parts = [leaf_stats(batch, names, leaves[a:b + 1], **options)
                     for a, b in itertools.pairwise(cuts)]
            split = moments_of(merge_stats(parts))
            for key, value in whole.items():
                np.testing.assert_array_equal(split[key], value, err_msg=str(key))


def test_a_leaf_bigger_than_a_chunk_matches_numpy(tmp_path, many_leaves, both_paths):
    rng = np.random.default_rng()
    n_atoms = np.array([3, 0, 250, 4, 1, 0, 2, 300, 5])
    n = int(n_atoms.sum())
    forces, numbers = rng.normal(2.0, 0.5, (n, 3)), rng.choice([1, 8, 26], n)
    path = write_batch(tmp_path / "big.h5", n_atoms, {"forces": forces, "numbers": numbers})
    for chunk_atoms in (30, 1 << 21):
        assert_rows_match(stats_rows(path, ["forces"], chunk_atoms=chunk_atoms),
                          reference_rows("forces", forces))
        assert_rows_match(stats_rows(path, ["forces"], per_element=True, chunk_atoms=chunk_atoms),
                          per_element_rows("forces", forces, numbers))


def test_one_element_tensor_fields_and_fields_some_structures_lack(tmp_path, many_leaves,
                                                                   both_paths):
    """Per element with a single element, the norm of a per-atom tensor, and per-atom and
    per-structure fields that only some structures have (NaN where filled)."""
    rng = np.random.default_rng()
    n_atoms = rng.integers(0, 6, 40)
    n = int(n_atoms.sum())
    has_q, has_e = rng.random(40) < 0.6, rng.random(40) < 0.7
    atom_has_q = np.repeat(has_q, n_atoms)
    q, t = rng.normal(size=(n, 3)), rng.normal(-3.0, 1.0, (n, 2, 2))
    q[~atom_has_q] = np.nan
    energy = np.where(has_e, rng.normal(-20.0, 4.0, 40), np.nan)
    path = write_batch(tmp_path / "partial.h5", n_atoms,
                       {"q": q, "t": t, "numbers": np.full(n, 29)}, {"energy": energy})
    with h5py.File(path, "r+") as f:
        for name, group, have in (("q", "atoms", has_q), ("energy", "structures", has_e)):
            f[f"{group}/{name}"].attrs["fill_value"] = np.nan
            f[f"present/{name}"] = have
    got = stats_rows(path, ["q", "t", "energy"], per_element=True, per_atom=True,
                     chunk_atoms=11)
    use = has_e & (n_atoms > 0)
    wanted = (reference_rows("q", q[atom_has_q], 29) + reference_rows("t", t, 29)
              + reference_rows("energy", energy[use] / n_atoms[use]))
    assert_rows_match(got, wanted)


def test_nan_and_infinities_are_refused_where_present(tmp_path):
    n_atoms = np.array([2, 0, 3, 1, 4, 2])
    forces = np.ones((12, 3))
    forces[[3, 10], 1] = np.nan
    energy = np.array([1.0, np.nan, 2.0, 3.0, 4.0, 5.0])
    path = write_batch(tmp_path / "nan.h5", n_atoms, {"forces": forces, "numbers": [1, 8] * 6},
                       {"energy": energy})
    for args in ([], ["--per-element"]):
        assert_one_line_error(run("stats", path, "forces", "--chunk-atoms", 3, *args), 1,
                              "'forces' holds 2 NaN", "structure 2")
    # the structure without atoms is left out of energy per atom, but its NaN is refused
    assert_one_line_error(run("stats", path, "energy", "--per-atom"), 1,
                          "'energy' holds 1 NaN", "structure 1")
    forces[[3, 10], 1] = [np.inf, -np.inf]  # a sum of NaN, without a NaN
    infinite = write_batch(tmp_path / "inf.h5", n_atoms, {"forces": forces})
    assert_one_line_error(run("stats", infinite, "forces", "-o", tmp_path / "s.h5"), 1,
                          "'forces' is inf in structure 2")
    assert not (tmp_path / "s.h5").exists()


def test_an_ase_file_read_directly_gives_the_bits_of_its_conversion(tmp_path, many_leaves,
                                                                    both_paths):
    """Leaves of several structures read one structure at a time (an extxyz file), in chunks
    that cut through them, against the same file converted: the same moments, bit for bit."""
    import ase.io
    from test_mixed import mixed_images

    source, path = tmp_path / "mixed.extxyz", tmp_path / "mixed.h5"
    ase.io.write(source, mixed_images())
    assert run("convert", source, "-o", path, "--fill-missing", "nan").exit_code == 0
    names, options = ["forces", "energy"], {"per_element": True, "per_atom": True}
    for chunk_atoms in (9, 50):
        got = []
        for file in (source, path):
            with open_batch(file) as batch:
                got.append(moments_of(field_stats(batch, names, chunk_atoms=chunk_atoms,
                                                  **options)))
        for key, value in got[1].items():
            np.testing.assert_array_equal(got[0][key], value, err_msg=str(key))


def test_rows_left_in_the_files_pages_give_the_bits_of_rows_read(tmp_path, both_paths):
    """A file's contiguous per-atom fields are left in its pages (segcli.memory.Window, read-only),
    and give the moments of the same rows read from a chunked copy, bit for bit."""
    path, _, _ = make_random_file(tmp_path)
    chunked = tmp_path / "chunked.h5"
    with h5py.File(path, "r") as f, h5py.File(chunked, "w") as g:
        f.copy("structures", g)
        g.attrs.update(f.attrs)
        for name, ds in f["atoms"].items():
            g.create_dataset(f"atoms/{name}", data=ds[()], chunks=(7, *ds.shape[1:]))
    names = ["forces", "charges", "tags", "energy"]
    with open_batch(path) as batch:
        chunks = list(batch.iter_chunks(names, chunk_atoms=50, into=stats._in_place))
        assert not any(c.atoms[n].flags.writeable for c in chunks for n in c.atoms)
    for options in ({}, {"per_element": True, "per_atom": True}):
        got = []
        for file in (path, chunked):
            with open_batch(file) as batch:
                got.append(moments_of(field_stats(batch, names, chunk_atoms=50, **options)))
        for key, value in got[1].items():
            np.testing.assert_array_equal(got[0][key], value, err_msg=str(key))


def test_moments_of_runs_leave_empty_runs_empty():
    columns = np.array([[1.0, 2.0, 4.0, -1.0, 5.0], [0.0, 0.5, 0.5, 3.0, 3.0]])
    m = Moments.of_runs(columns, [0, 3, 0, 2, 0])
    np.testing.assert_array_equal(m.count, [0, 3, 0, 2, 0])
    np.testing.assert_array_equal(m.mean[[1, 3]], [[7 / 3, 1 / 3], [2.0, 3.0]])
    np.testing.assert_allclose(m.m2[[1, 3]], [[14 / 3, 1 / 6], [18.0, 0.0]], rtol=1e-15)
    np.testing.assert_array_equal(m.min[[1, 3]], [[1.0, 0.0], [-1.0, 3.0]])
    np.testing.assert_array_equal(m.max[[1, 3]], [[4.0, 0.5], [5.0, 3.0]])
    empty = Moments.empty(5, 2)
    for key in MOMENT_NAMES:
        np.testing.assert_array_equal(getattr(m, key)[[0, 2, 4]], getattr(empty, key)[[0, 2, 4]])


# --- fit-e0 --------------------------------------------------------------------------------

ELEMENTS = np.array([1, 6, 8, 29])


def composition_file(tmp_path, counts, energies, name="e0.h5"):
    """A file whose structures hold `counts` (S, len(ELEMENTS)) atoms of each of ELEMENTS (in
    shuffled order) with the given energies."""
    rng = np.random.default_rng()
    numbers = [rng.permutation(np.repeat(ELEMENTS, row)) for row in counts]
    return write_batch(tmp_path / name, counts.sum(axis=1),
                       {"numbers": np.concatenate(numbers).astype(np.int64)}, {"energy": energies})


@pytest.fixture
def e0_data(tmp_path):
    rng = np.random.default_rng()
    counts = rng.integers(0, 6, (80, len(ELEMENTS)))
    counts[:, 3] = 0
    counts[::7, 3] = rng.integers(1, 4, len(counts[::7]))
    energies = counts @ np.array([-13.6, -1029.8, -2041.2, -45000.0]) + rng.normal(0, 0.5, 80)
    return composition_file(tmp_path, counts, energies), counts, energies


def fit_json(*args):
    result = run("fit-e0", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def assert_residual_errors(got, counts, energies):
    """rmse and mae per atom as the residuals of the reported E0 give them (the E0 match
    lstsq's to 1e-8 only, which moves residuals of a near-exact fit by more than 1e-10)."""
    reported = {e["number"]: e["e0"] for e in got["e0"]}
    e0 = np.array([reported[z] for z in ELEMENTS])
    n = counts.sum(axis=1)
    per_atom = (energies - counts @ e0)[n > 0] / n[n > 0]
    assert got["rmse_per_atom"] == pytest.approx(np.sqrt(np.mean(per_atom ** 2)), rel=1e-10)
    assert got["mae_per_atom"] == pytest.approx(np.mean(np.abs(per_atom)), rel=1e-10)


@pytest.mark.parametrize("chunk_atoms", [5, 1 << 21])
def test_fit_e0_equals_lstsq(e0_data, chunk_atoms):
    path, counts, energies = e0_data
    wanted = np.linalg.lstsq(counts.astype(float), energies, rcond=None)[0]
    got = fit_json(path, "--chunk-atoms", chunk_atoms)
    assert [e["number"] for e in got["e0"]] == ELEMENTS.tolist()
    np.testing.assert_allclose([e["e0"] for e in got["e0"]], wanted, rtol=1e-8)
    assert got["structures"] == 80 and not any(e["fixed"] for e in got["e0"])
    assert_residual_errors(got, counts, energies)


def test_fit_e0_fixed_elements_absent_ones_and_table(e0_data):
    path, counts, energies = e0_data
    free = np.linalg.lstsq(counts[:, 1:].astype(float), energies - counts[:, 0] * -13.0,
                           rcond=None)[0]
    got = fit_json(path, "--fixed", "H=-13", "--fixed", "Au=-3.5")
    assert [(e["element"], e["fixed"]) for e in got["e0"]] == [
        ("H", True), ("C", False), ("O", False), ("Cu", False), ("Au", True)]
    np.testing.assert_allclose([e["e0"] for e in got["e0"]][1:4], free, rtol=1e-8)
    assert_residual_errors(got, counts, energies)
    assert fit_json(path, "--fixed", "h=-13", "--fixed", "AU=-3.5") == got  # any case
    lines = run("fit-e0", path, "--fixed", "H=-13").output.splitlines()
    assert lines[0].split() == ["element", "Z", "E0"]
    assert lines[1].split() == ["H", "1", "-13", "fixed"]
    assert lines[-1].startswith("structures: 80; residual per atom: RMSE ")


def test_fit_e0_names_the_elements_it_cannot_separate(tmp_path):
    rng = np.random.default_rng()
    water = rng.integers(1, 5, 30)
    counts = np.column_stack([2 * water, rng.integers(0, 3, 30), water, np.zeros(30, int)])
    energies = counts @ np.array([-13.6, -1029.8, -2041.2, 0.0])
    path = composition_file(tmp_path, counts, energies)
    result = run("fit-e0", path)
    assert_one_line_error(result, 1, "H, O cannot be separated", "--fixed")
    assert "C" not in result.output.split("separated")[0].split("of ")[-1]
    got = fit_json(path, "--fixed", "H=-13.6")
    np.testing.assert_allclose([e["e0"] for e in got["e0"]], [-13.6, -1029.8, -2041.2], rtol=1e-8)
    few = composition_file(tmp_path, counts[:2], energies[:2], "few.h5")
    assert_one_line_error(run("fit-e0", few), 1, "cannot be separated", "2 structure(s)")


def test_fit_e0_in_place_stores_the_residuals(e0_data):
    path, counts, energies = e0_data
    before = fit_json(path)
    result = run("fit-e0", path, "--in-place", "--name", "e_int")
    assert result.exit_code == 0, result.output
    e0 = np.array([e["e0"] for e in before["e0"]])
    with h5py.File(path) as f:
        stored = f["results/e_int"]
        np.testing.assert_allclose(stored[()], energies - counts @ e0, rtol=1e-9, atol=1e-9)
        assert stored.attrs["per"] == "structure" and stored.attrs["op"] == "fit-e0"
        np.testing.assert_array_equal(stored.attrs["elements"], ELEMENTS)
    assert_one_line_error(run("fit-e0", path, "--in-place", "--name", "e_int"), 1,
                          "already exists")
    # the residual is a field now: its own fit gives E0 of zero
    np.testing.assert_allclose([e["e0"] for e in fit_json(path, "--energy", "e_int")["e0"]],
                               0, atol=1e-8)


def test_fit_e0_leaves_out_structures_without_energy(tmp_path, e0_data):
    path, counts, energies = e0_data
    with h5py.File(path, "r+") as f:
        energy = f["structures/energy"][()]
        energy[:10] = np.nan
        f["structures/energy"][()] = energy
        f["present/energy"] = np.arange(80) >= 10
    wanted = np.linalg.lstsq(counts[10:].astype(float), energies[10:], rcond=None)[0]
    got = fit_json(path)
    assert got["structures"] == 70
    np.testing.assert_allclose([e["e0"] for e in got["e0"]], wanted, rtol=1e-8)
    assert run("fit-e0", path, "--in-place").exit_code == 0
    with h5py.File(path) as f:
        assert np.isnan(f["results/residual_energy"][:10]).all()


@pytest.mark.parametrize("args, code, needles", [
    (["--energy", "numbers"], 1, ["'numbers' is per atom", "one number per structure"]),
    (["--energy", "nope"], 1, ["no field 'nope'"]),
    (["--fixed", "Xx=1"], 2, ["'Xx=1': 'Xx' is not an element's symbol"]),
    (["--fixed", "X=1"], 2, ["'X=1': 'X' is not an element's symbol"]),
    (["--fixed", "Cu=1", "--fixed", "cu=2"], 2, ["'cu=2': Cu is fixed twice"]),
    (["--fixed", "H=abc"], 2, ["SYMBOL=VALUE"]),
    (["--fixed", "H=nan"], 2, ["'H=nan': the energy must be finite"]),
    (["--name", "r"], 2, ["--in-place"]),
    (["--in-place", "--name", "."], 2, ["'.' is not a result name"]),
    (["--in-place", "--name", ""], 2, ["'' is not a result name"]),
    (["--in-place", "--structures", "0:3"], 2, ["--structures"]),
])
def test_fit_e0_errors(e0_data, args, code, needles):
    path, _, _ = e0_data
    assert_one_line_error(run("fit-e0", path, *args), code, *needles)


# --- the curation story on a mixed dataset written by ASE -----------------------------------

def test_curating_a_mixed_dataset_written_by_ase(tmp_path):
    """Bulk cells, surfaces and molecules with EMT results, converted with --fill-missing:
    stats leave out the structures without stress, fit-e0 equals lstsq on ASE's own
    compositions, and select keeps what a --where on a string field and a result says."""
    import ase.io
    from test_mixed import mixed_images

    images = mixed_images()
    source, path = tmp_path / "mixed.extxyz", tmp_path / "mixed.h5"
    ase.io.write(source, images)
    assert run("convert", source, "-o", path, "--fill-missing", "nan").exit_code == 0
    images = ase.io.read(source, ":")
    stressed = [a.get_stress() for a in images if "stress" in a.calc.results]
    assert 0 < len(stressed) < len(images)
    assert_rows_match(stats_json(path, "stress")["stats"],
                      reference_rows("stress", np.array(stressed)))

    energies = np.array([a.get_potential_energy() for a in images])
    elements = sorted({int(z) for a in images for z in a.numbers})
    counts = np.array([[np.count_nonzero(a.numbers == z) for z in elements] for a in images])
    got = fit_json(path)
    assert [e["number"] for e in got["e0"]] == elements
    np.testing.assert_allclose([e["e0"] for e in got["e0"]],
                               np.linalg.lstsq(counts.astype(float), energies, rcond=None)[0],
                               rtol=1e-8)
    assert run("fit-e0", path, "--in-place").exit_code == 0
    out = tmp_path / "bulk.h5"
    result = run("select", path, "--where", "config_type == bulk", "--where",
                 "residual_energy > -1e9", "-o", out)
    assert result.exit_code == 0, result.output
    bulk = [i for i, a in enumerate(images) if a.info["config_type"] == "bulk"]
    with h5py.File(out) as f, h5py.File(path) as whole:
        np.testing.assert_array_equal(f["structures/energy"][()], energies[bulk])
        np.testing.assert_array_equal(f["results/residual_energy"][()],
                                      whole["results/residual_energy"][bulk])
    assert stats_json(out, "stress")["stats"][0]["count"] == len(bulk)
    assert_one_line_error(run("stats", path, "config_type"), 1,
                          "'config_type' holds strings, but stats needs real numbers")


def test_a_field_of_5000_components_is_written(tmp_path):
    """Its 5001 component names (5000 and the norm) fit the stats file's attributes."""
    rng = np.random.default_rng(2)
    wide = rng.normal(size=(30, 5000))
    path = write_batch(tmp_path / "wide.h5", [3] * 10, {"w": wide})
    result = run("stats", path, "w", "-o", tmp_path / "s.h5")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "s.h5") as f:
        assert len(f["stats/w"].attrs["components"]) == 5001
        np.testing.assert_allclose(f["stats/w/mean"][0, :5000], wide.mean(axis=0), rtol=1e-12)


def test_progress_on_a_cluster_counts_the_structures_where_keeps(tmp_path):
    """stats --where --scheduler local:2 (two worker processes): the bar ends at the kept
    structures, as without a cluster."""
    from terminal import BAR, final_screen, on_terminal

    path = write_batch(tmp_path / "f.h5", [2] * 30, {"forces": np.ones((60, 3))},
                       {"e": np.arange(30.0)})
    code, shown, _ = on_terminal("stats", path, "forces", "--where", "e < 10", "--scheduler",
                                 "local:2", cwd=tmp_path)
    assert code == 0, shown
    bars = [m for m in map(BAR.fullmatch, final_screen(shown)) if m]
    assert [(m["done"], m["total"]) for m in bars] == [("10", "10")], shown


def test_leaf_runs_of_structures_follow_the_last_bound_at_or_below_each():
    """stats._leaf_runs against NumPy's search per number (each number's leaf: the last bound
    at or below it): numbers below, on, between and above the bounds, one number, one bound,
    leaves without numbers."""
    rng = np.random.default_rng(5)
    for _ in range(500):
        leaves = np.unique(rng.integers(0, 60, rng.integers(1, 12)))
        numbers = np.unique(rng.integers(0, 70, rng.integers(1, 30)))
        leaf = np.searchsorted(leaves, numbers, side="right") - 1
        first, starts = stats._leaf_runs(numbers, leaves)
        assert first == leaf[0] and starts[0] == 0 and starts[-1] == len(numbers)
        assert len(starts) == leaf[-1] - first + 2
        assert (np.diff(starts) >= 0).all()
        for j, (a, b) in enumerate(itertools.pairwise(starts)):
            assert (leaf[a:b] == first + j).all()
