"""convert joins results (as results) as well as fields, and renames (--rename) and casts
(--cast) fields so that files which name or type a field differently join."""

import itertools

import ase.io
import h5py
import numpy as np
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def frames(kinds, per_atom_energies=False):
    out = []
    for i, kind in enumerate(kinds):
        atoms = Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.7 + i / 10]])
        atoms.info["kind"] = kind
        if per_atom_energies:
            atoms.calc = SinglePointCalculator(atoms, energies=np.array([-1.0, -2.0]) * i)
        else:
            atoms.info["energies"] = -3.0 * i
        out.append(atoms)
    return out


def test_results_of_two_files_join_as_results(tmp_path):
    rng = np.random.default_rng(1)
    sums, grads = [], []
    for k, n_atoms in enumerate(([2, 0, 3], [1, 4])):
        x = rng.normal(size=(sum(n_atoms), 3))
        path = write_batch(tmp_path / f"in{k}.h5", n_atoms, {"x": x})
        bounds = np.cumsum([0, *n_atoms])
        sums.append([x[a:b].sum(axis=0) for a, b in itertools.pairwise(bounds)])
        grads.append(np.ones_like(x))
        assert run("reduce", path, "sum", "x", "+", "count", "-o", tmp_path / f"r{k}.h5",
                   "--quiet").exit_code == 0
        assert run("grad", path, "sum", "x", "-o", tmp_path / f"g{k}.h5",
                   "--quiet").exit_code == 0
    result = run("convert", tmp_path / "r0.h5", tmp_path / "r1.h5", "-o", tmp_path / "all.h5")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "all.h5") as f, h5py.File(tmp_path / "r0.h5") as first:
        np.testing.assert_allclose(f["results/sum_x"][()], np.concatenate(sums), rtol=1e-12)
        np.testing.assert_array_equal(f["results/count"][()], [2, 0, 3, 1, 4])
        np.testing.assert_array_equal(f["structures/n_atoms"][()], [2, 0, 3, 1, 4])
        attrs = dict(first["results/sum_x"].attrs)
        assert attrs.pop("structures") == "0:3"  # the range of one input: not kept
        assert dict(f["results/sum_x"].attrs) == attrs
    result = run("convert", tmp_path / "g0.h5", tmp_path / "g1.h5", "-o", tmp_path / "g.h5",
                 "--rename", "sum_x/d_x=gradient")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "g.h5") as f:
        np.testing.assert_array_equal(f["results/gradient"][()], np.concatenate(grads))
        assert f["results/gradient"].attrs["per"] == "atom"
    result = run("convert", tmp_path / "r0.h5", tmp_path / "in1.h5", "-o", tmp_path / "no.h5",
                 "--fill-missing", "nan")
    assert result.exit_code == 1 and "result 'count' is not in every input" in result.output
    result = run("convert", tmp_path / "r0.h5", "-o", tmp_path / "some.h5", "--fields", "count")
    assert result.exit_code == 0 and "fields: count" in result.output, result.output


def test_a_field_of_strings_and_numbers_joins_once_cast(tmp_path):
    ase.io.write(tmp_path / "a.extxyz", frames([1, 2]))
    ase.io.write(tmp_path / "b.extxyz", frames(["bulk", "surface"]))
    inputs = [tmp_path / "a.extxyz", tmp_path / "b.extxyz"]
    result = run("convert", *inputs, "-o", tmp_path / "no.h5")
    assert result.exit_code == 1 and "field 'kind' holds strings" in result.output
    result = run("convert", *inputs, "-o", tmp_path / "all.h5", "--cast", "kind=str",
                 "--cast", "energies=float32")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "all.h5") as f:
        assert [v.decode() for v in f["structures/kind"][()]] == ["1", "2", "bulk", "surface"]
        assert f["structures/energies"].dtype == np.float32
        np.testing.assert_array_equal(f["structures/energies"][()], [0, -3, 0, -3])


def test_a_clashing_name_is_renamed_before_joining(tmp_path):
    ase.io.write(tmp_path / "molecules.extxyz", frames([1, 2]))
    ase.io.write(tmp_path / "atoms.extxyz", frames([3, 4], per_atom_energies=True))
    result = run("convert", tmp_path / "molecules.extxyz", tmp_path / "atoms.extxyz",
                 "-o", tmp_path / "no.h5")
    assert result.exit_code == 1 and "field 'energies' is per atom" in result.output
    assert run("convert", tmp_path / "molecules.extxyz", "-o", tmp_path / "m.h5", "--rename",
               "energies=energy", "--quiet").exit_code == 0
    result = run("convert", tmp_path / "m.h5", tmp_path / "atoms.extxyz", "-o",
                 tmp_path / "all.h5", "--fill-missing", "nan")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "all.h5") as f:
        np.testing.assert_array_equal(f["structures/energy"][()], [0, -3, np.nan, np.nan])
        np.testing.assert_array_equal(f["atoms/energies"][()],
                                      [np.nan] * 4 + [0, 0, -1, -2])


def test_bad_renames_and_casts_are_one_line(tmp_path):
    path = write_batch(tmp_path / "d.h5", [2, 1], {"numbers": [1, 8, 6],
                                                   "q": [0.5, 1.0, 2.0],
                                                   "big": [1, 2, 2 ** 40]},
                       {"name": np.array([b"7", b"x"], dtype=h5py.string_dtype())})
    out = tmp_path / "out.h5"
    cases = [(["--rename", "q=numbers"], 1, "--rename q=numbers: structure 0 has a field "
                                             "'numbers' already"),
             (["--rename", "nothing=q2"], 1, "no field 'nothing' (--rename)"),
             (["--cast", "q2=int64", "--rename", "q=q2"], 1,
              "field 'q2' of structures from 0 cannot be cast to int64"),
             (["--cast", "big=int32"], 1, "field 'big' of structures from 0 cannot be cast"),
             (["--cast", "name=float64"], 1, "field 'name' of structures from 0 cannot be cast"),
             (["--cast", "q=complex"], 2, "'complex' is not one of float64"),
             (["--rename", "q"], 2, "expected OLD=NEW, got 'q'"),
             (["--rename", "q=a", "--rename", "q=b"], 2, "q is given twice")]
    for args, code, message in cases:
        result = run("convert", path, "-o", out, *args)
        assert result.exit_code == code and message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5"]
    result = run("convert", path, "-o", out, "--cast", "q=float32", "--cast", "big=float64",
                 "--rename", "numbers=z", "--cast", "z=uint8")
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f:
        assert f["atoms/z"].dtype == np.uint8 and f["atoms/q"].dtype == np.float32
        np.testing.assert_array_equal(f["atoms/big"][()], [1, 2, 2 ** 40])
