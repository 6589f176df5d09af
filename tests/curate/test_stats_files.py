"""`segcli stats` over its own `-o` files: merged exactly (Chan's formulas) into the
statistics of all their data, ungrouped, by element or by a field, against NumPy float64."""

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from test_stats import assert_one_line_error, assert_rows_match, reference_rows, run, stats_json


def data_files(tmp_path, count=3, seed=0):
    """`count` random files (files/data{i}.h5; the last lacks element 8 and holds only
    config_type "b"): (paths, n_atoms, arrays) with the arrays of all files concatenated."""
    rng = np.random.default_rng(seed)
    (tmp_path / "files").mkdir()
    paths, n_atoms, arrays = [], [], []
    for i in range(count):
        n = rng.integers(0, 9, 20 + 5 * i)
        total = int(n.sum())
        elements = [1, 6, 29] if i == count - 1 else [1, 6, 8, 29]
        atoms = {"forces": rng.normal(0.5, 2.0, (total, 3)),
                 "numbers": rng.choice(elements, total)}
        kinds = ["b"] if i == count - 1 else ["a", "b", "c"]
        structures = {"energy": rng.normal(-50.0, 10.0, len(n)),
                      "config_type": np.array(rng.choice(kinds, len(n)), dtype=object)}
        paths.append(write_batch(tmp_path / "files" / f"data{i}.h5", n, atoms, structures))
        n_atoms.append(n)
        arrays.append({**atoms, **structures})
    joined = {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}
    return paths, np.concatenate(n_atoms), joined


def stats_files(tmp_path, paths, *args):
    """Each data file's `stats -o` (stats/s{i}.h5); the glob of them."""
    (tmp_path / "stats").mkdir(exist_ok=True)
    for i, path in enumerate(paths):
        result = run("stats", path, *args, "-o", tmp_path / "stats" / f"s{i}.h5")
        assert result.exit_code == 0, result.output
    return tmp_path / "stats" / "s*.h5"


def test_stats_files_merge_into_the_statistics_of_all_their_data(tmp_path):
    paths, _, data = data_files(tmp_path)
    merged = stats_json(stats_files(tmp_path, paths, "forces", "energy"))
    assert merged["structures"] == len(data["energy"]) and merged["files"] == 3
    assert_rows_match(merged["stats"], reference_rows("forces", data["forces"])
                      + reference_rows("energy", data["energy"]))
    assert merged["stats"] == stats_json(tmp_path / "stats" / "s*.h5", "forces", "energy")["stats"]
    only = stats_json(tmp_path / "stats" / "s*.h5", "energy")
    assert_rows_match(only["stats"], reference_rows("energy", data["energy"]))


def test_per_element_stats_files_merge_over_the_union_of_their_elements(tmp_path):
    paths, _, data = data_files(tmp_path)
    merged = stats_json(stats_files(tmp_path, paths, "forces", "--per-element"))
    numbers = data["numbers"]
    assert_rows_match(merged["stats"], [
        row for z in (1, 6, 8, 29)
        for row in reference_rows("forces", data["forces"][numbers == z], z)])
    assert [row["symbol"] for row in merged["stats"]][::4] == ["H", "C", "O", "Cu"]


def test_stats_files_by_a_field_merge_over_the_union_of_its_values(tmp_path):
    paths, _, data = data_files(tmp_path)
    merged = stats_json(stats_files(tmp_path, paths, "energy", "--by", "config_type"))
    kinds = data["config_type"]
    wanted = [row for kind in ("a", "b", "c")
              for row in reference_rows("energy", data["energy"][kinds == kind])]
    assert_rows_match(merged["stats"], wanted)
    assert [row["group"] for row in merged["stats"]] == ["a", "b", "c"]
    out = tmp_path / "merged.h5"  # written again, and read back the same
    assert run("stats", tmp_path / "stats" / "s*.h5", "-o", out).exit_code == 0
    assert stats_json(out)["stats"] == merged["stats"]


def test_shard_parts_are_statistics_files_too(tmp_path):
    paths, _, data = data_files(tmp_path, count=1)
    for shard in ("0/3", "1/3", "2/3"):
        result = run("stats", paths[0], "forces", "--shard", shard,
                     "-o", tmp_path / f"part{shard[0]}.h5")
        assert result.exit_code == 0, result.output
    merged = stats_json(tmp_path / "part*.h5")
    assert_rows_match(merged["stats"], reference_rows("forces", data["forces"]))
    assert merged["structures"] == len(data["energy"])


def test_what_statistics_files_cannot_do(tmp_path):
    paths, _, _ = data_files(tmp_path, count=2)
    pattern = stats_files(tmp_path, paths, "forces")
    assert_one_line_error(run("stats", pattern, "forces", "--per-element"), 2,
                          "holds statistics, computed already: --per-element applies to data")
    assert_one_line_error(run("stats", pattern, "energy"), 1,
                          "no statistics of energy in every file; they hold forces")
    run("stats", paths[0], "forces", "--per-element", "-o", tmp_path / "stats" / "s0.h5",
        "--force")
    assert_one_line_error(run("stats", pattern), 1, "/stats/forces is per atom, ungrouped",
                          "but in the files before it per atom, by element",
                          "statistics merge only alike")
    with h5py.File(tmp_path / "stats" / "s1.h5", "a") as h5:
        del h5["stats/forces/mean"]
    assert_one_line_error(run("stats", tmp_path / "stats" / "s1.h5"), 1,
                          "s1.h5: damaged HDF5 file")


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_data_files_still_need_fields(tmp_path, args):
    paths, _, _ = data_files(tmp_path, count=1)
    assert_one_line_error(run("stats", paths[0], *args), 2,
                          "give the FIELDs of FILE to compute statistics of")


@pytest.mark.parametrize("key, value, needle", [
    ("count", -5, "count holds -5, not a count of values"),
    ("m2", np.nan, "m2 holds a value that is not finite"),
    ("mean", np.inf, "mean holds a value that is not finite"),
    ("m2", -1.0, "holds a negative m2 or a min above its max"),
    ("min", 1e300, "holds a negative m2 or a min above its max")])
@pytest.mark.parametrize("shard", [False, True])
def test_a_statistics_file_holding_what_no_values_give_is_refused(tmp_path, key, value, needle,
                                                                  shard):
    paths, _, _ = data_files(tmp_path, count=1)
    out = tmp_path / "s.h5"
    assert run("stats", paths[0], "forces", "-o", out, *(["--shard", "0/1"] if shard else [])
               ).exit_code == 0
    where = "stats/forces/leaves" if shard else "stats/forces"
    with h5py.File(out, "r+") as f:
        values = f[f"{where}/{key}"][()]
        values.flat[0] = value
        f[f"{where}/{key}"][...] = values
    target = ["merge", out, "-o", tmp_path / "m.h5"] if shard else ["stats", out]
    assert_one_line_error(run(*target), 1, f"{out}: /{where}", needle)
