"""Hostile readers, fourth round: what segcli reads from damaged and odd files is what h5py
and ASE read from them, or one line naming the file and exit 1."""

import json

import ase.io
import h5py
import numpy as np
import pytest
from ase.build import molecule
from batch_reference import write_batch
from click.testing import CliRunner

import segcli
from segcli.cli import main
from segcli.errors import Note

N_ATOMS = [3, 2, 4]
POSITIONS = np.arange(27.0).reshape(9, 3) / 7


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sums(result, key):
    assert result.exit_code == 0, result.output
    return np.array([json.loads(line)[key] for line in result.stdout.splitlines()])


def assert_one_line(result, path, *needles):
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and str(path) in lines[0], result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_a_field_through_an_external_link_is_read_from_the_file_it_lies_in(tmp_path):
    """The direct reader mapped a linked dataset's offset in its own file onto the linking
    file's bytes: garbage sums, exit 0."""
    with h5py.File(tmp_path / "target.h5", "w") as f:
        f["pad"] = np.full(300, 7.0)  # the data lies at another offset than in the link file
        f["p"] = POSITIONS
    path = write_batch(tmp_path / "linked.h5", N_ATOMS, {"numbers": np.ones(9, np.int64)})
    with h5py.File(path, "a") as f:
        f["atoms/positions"] = h5py.ExternalLink("target.h5", "/p")
    want = [POSITIONS[0:3].sum(0), POSITIONS[3:5].sum(0), POSITIONS[5:9].sum(0)]
    got = sums(run("reduce", path, "sum", "positions", "--format", "json"), "sum_positions")
    np.testing.assert_allclose(got, want)
    stats = run("stats", path, "positions", "--json")
    assert stats.exit_code == 0, stats.output
    rows = [r for r in json.loads(stats.stdout)["stats"] if r["component"] in ("0", "1", "2")]
    np.testing.assert_allclose([r["max"] for r in rows], POSITIONS.max(0))
    np.testing.assert_allclose([r["mean"] for r in rows], POSITIONS.mean(0))


def test_fields_not_shaped_as_ase_s_derive_nothing(tmp_path):
    """A cell stored as (S, 3) or masses as (N, 3) made scaled_positions and velocities a
    traceback (AxisError, broadcasting); now they are no field, named in one line."""
    path = write_batch(tmp_path / "cell.h5", N_ATOMS,
                       {"positions": POSITIONS, "momenta": POSITIONS, "masses": POSITIONS},
                       {"cell": np.ones((3, 3))})
    for field in ("scaled_positions", "velocities"):
        assert_one_line(run("reduce", path, "sum", field), path, field)
    info = run("info", "--json", path)
    assert info.exit_code == 0 and "scaled_positions" not in info.stdout, info.output


def test_an_export_to_extxyz_refuses_what_its_comment_line_would_change(tmp_path):
    """ASE writes string info unquoted where it holds a tab, a backslash or nothing, and
    a number or a boolean as its text: the export was exit 0 and read back as other values
    (an empty string swallowed the next key, the energy lost; 'T' read back True)."""
    for value in ["", "tab\there", "back\\slash", "T", "1.5", "new\nline"]:
        path = write_batch(tmp_path / "s.h5", [1, 1], {"positions": np.zeros((2, 3)),
                                                       "numbers": np.ones(2, np.int64)},
                           {"energy": np.arange(2.0)})
        with h5py.File(path, "a") as f:
            f.create_dataset("structures/config_type", data=np.array(["ok", value], object),
                             dtype=h5py.string_dtype())
        out = tmp_path / "out.extxyz"
        result = run("convert", path, "-o", out)
        assert_one_line(result, out, "config_type", "structure 1", repr(value))
        assert not out.exists()
    with h5py.File(path, "a") as f:  # what reads back is written
        del f["structures/config_type"]
        f.create_dataset("structures/config_type", data=np.array(['a "q" b', "x=y"], object),
                         dtype=h5py.string_dtype())
        f["atoms/a b"] = np.zeros(2)
        f["structures/virial"] = np.arange(18.0).reshape(2, 3, 3)  # ASE's own 3x3 key
    assert_one_line(run("convert", path, "-o", out), out, "'a b'")
    assert run("convert", path, "-o", out, "--drop", "a b").exit_code == 0
    np.testing.assert_array_equal([a.info["virial"] for a in ase.io.read(out, ":")],
                                  np.arange(18.0).reshape(2, 3, 3))
    back = run("info", "--json", out)
    values = json.loads(back.stdout)["values"]["config_type"]["most_common"]
    assert values == {'a "q" b': 1, "x=y": 1}


def test_a_data_array_per_atom_in_one_row_and_per_structure_in_another(tmp_path):
    """An ASE database whose `data` array has as many rows as one row's atoms but not
    another's: convert --fill-missing nan wrote it per atom with NaN for the other rows, their
    values lost, exit 0; every other command refused the whole file. Now the name is a
    conflict (no field), the other fields read, and what would copy it refuses."""
    import ase.db
    from ase import Atoms

    path = tmp_path / "rows.db"
    with ase.db.connect(path) as db:
        for n in (3, 5):
            db.write(Atoms(f"H{n}", positions=np.arange(3.0 * n).reshape(n, 3)),
                     data={"arr": np.arange(3.0)})
    got = sums(run("reduce", path, "sum", "positions", "--format", "json"), "sum_positions")
    np.testing.assert_allclose(got, [np.arange(9.0).reshape(3, 3).sum(0),
                                     np.arange(15.0).reshape(5, 3).sum(0)])
    info = run("info", "--json", path)
    assert info.exit_code == 0 and "arr" in json.loads(info.stdout)["conflicts"], info.output
    assert_one_line(run("reduce", path, "sum", "arr"), path, "'arr'")
    out = tmp_path / "out.h5"
    for args in (("convert", path, "-o", out, "--fill-missing", "nan"),
                 ("convert", path, "-o", out),
                 ("select", path, "--where", "id > 0", "-o", out)):
        assert_one_line(run(*args), path, "'arr'", "per structure")
        assert not out.exists()
    assert run("convert", path, "-o", out, "--drop", "arr").exit_code == 0


def test_a_compressed_json_database_that_convert_writes_reads_back(tmp_path):
    """convert -o NAME.json.gz (or .bz2) wrote a file that ASE reads but segcli did not:
    detected as JSON decompressed, then handed to ASE's JSON backend compressed."""
    path = write_batch(tmp_path / "s.h5", N_ATOMS, {"positions": POSITIONS,
                                                    "numbers": np.ones(9, np.int64)})
    want = sums(run("reduce", path, "sum", "positions", "--format", "json"), "sum_positions")
    for suffix in (".json.gz", ".json.bz2"):
        out = tmp_path / f"out{suffix}"
        assert run("convert", path, "-o", out).exit_code == 0
        got = run("reduce", out, "sum", "positions", "--format", "json")
        np.testing.assert_allclose(sums(got, "sum_positions"), want)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes((tmp_path / "out.json.gz").read_bytes()[:60])
    assert_one_line(run("info", cut), cut, "truncated")


def test_an_export_to_a_database_keeps_per_atom_fields_a_row_has_no_column_for(tmp_path):
    """ASE's rows keep only their own arrays, and its SQLite backend only some calculator
    results: a per-atom field `q`, per-atom `energies` and `stresses` were lost from .db (q
    from .json and .aselmdb too), exit 0. Now they go to each row's data."""
    q = np.arange(9.0) * 1.5
    path = write_batch(tmp_path / "s.h5", N_ATOMS, {
        "positions": POSITIONS, "numbers": np.full(9, 29), "q": q, "energies": q + 1,
        "stresses": np.ones((9, 6)), "forces": POSITIONS * 2}, {"energy": np.arange(3.0)})
    want = {f: run("reduce", path, "sum", f, "--format", "json").stdout
            for f in ("q", "energies", "stresses", "forces")}
    for suffix in (".db", ".json"):
        out = tmp_path / f"out{suffix}"
        assert run("convert", path, "-o", out).exit_code == 0
        for field, text in want.items():
            got = run("reduce", out, "sum", field, "--format", "json")
            assert got.exit_code == 0 and got.stdout == text, (suffix, field, got.output)


def test_extended_xyz_compressed_is_read_by_its_content_not_its_name(tmp_path):
    """Detection decompressed a gzip file's head and said extended XYZ, but the reader chose
    its decompression by the name: a compressed file piped to stdin or named .extxyz was
    'line 1 is not UTF-8 text'."""
    import gzip
    import lzma

    text = "2\nProperties=species:S:1:pos:R:3 energy=1.5\nH 0 0 0\nO 0.5 0 1\n" * 2
    plain = tmp_path / "a.extxyz"
    plain.write_text(text)
    want = run("reduce", plain, "sum", "positions", "--format", "json").stdout
    (tmp_path / "b.extxyz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "c").write_bytes(lzma.compress(text.encode()))
    for name in ("b.extxyz", "c"):
        got = run("reduce", tmp_path / name, "sum", "positions", "--format", "json")
        assert got.exit_code == 0 and got.stdout == want, (name, got.output)
    piped = CliRunner().invoke(main, ["reduce", "-", "sum", "positions", "--format", "json"],
                               input=gzip.compress(text.encode()))
    assert piped.exit_code == 0 and piped.stdout == want, piped.output


def test_constraints_of_database_rows_are_kept_as_from_a_trajectory(tmp_path):
    """A row's FixAtoms and FixCartesian were dropped by every database reader (convert wrote
    no `fixed`, exit 0); a .traj of the same structures kept them."""
    import ase.db
    from ase import Atoms
    from ase.constraints import FixAtoms, FixCartesian

    atoms = Atoms("H3", positions=np.arange(9.0).reshape(3, 3))
    atoms.set_constraint([FixAtoms([0]), FixCartesian(2, (True, False, True))])
    path = tmp_path / "c.json"
    with ase.db.connect(path) as db:
        db.write(atoms)
    out = tmp_path / "c.h5"
    assert run("convert", path, "-o", out).exit_code == 0
    with h5py.File(out) as f:
        assert f["atoms/fixed"][()].tolist() == [True, False, False]
        assert f["atoms/fixed_cartesian"][()].tolist() == [[False] * 3, [False] * 3,
                                                           [True, False, True]]


def test_a_per_atom_field_that_a_trajectory_cannot_hold_is_told_not_lost_unseen(tmp_path):
    """ASE's trajectory writes its own per-atom arrays only: another field is left out with a
    note naming it (none with --quiet; a Note warning to a Python caller), the rest exact."""
    water = molecule("H2O")
    water.arrays["charge_x"] = np.arange(3.0)
    ase.io.write(tmp_path / "w.extxyz", [water, water])
    told = CliRunner().invoke(main, ["convert", str(tmp_path / "w.extxyz"), "-o",
                                     str(tmp_path / "w.traj")])
    assert told.exit_code == 0, told.output
    assert f"{tmp_path / 'w.traj'}: ASE's trajectory holds no per-atom field 'charge_x'" \
        in told.stderr
    back = ase.io.read(tmp_path / "w.traj", ":")
    assert len(back) == 2 and "charge_x" not in back[0].arrays
    np.testing.assert_array_equal(back[1].positions, water.positions)
    quiet = CliRunner().invoke(main, ["convert", str(tmp_path / "w.extxyz"), "-o",
                                      str(tmp_path / "q.traj"), "-q"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
    with pytest.warns(Note, match="'charge_x'"):
        segcli.convert(tmp_path / "w.extxyz", tmp_path / "p.traj")
