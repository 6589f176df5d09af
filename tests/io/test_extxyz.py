"""segcli's extxyz reader against ase.io.iread + atoms_piece: the same pieces, bit for bit, and
ASE itself, a structure at a time, wherever the fast path does not apply."""

from pathlib import Path

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixAtoms, FixCartesian

from segcli.errors import DataError
from segcli.io import open_batch
from segcli.io.asefiles import AseBatch, ExtxyzBatch
from segcli.io.extxyz import pieces

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"


def ase_pieces(path, start=0, stop=None):
    return list(AseBatch(str(path), "extxyz").structures(start, stop))


def batch_pieces(path, start=0, stop=None):
    return list(ExtxyzBatch(str(path)).structures(start, stop))


def assert_identical(got, expected):
    """Same structures, field names in the same order, dtypes, shapes and bytes (strings:
    equal str)."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.start == e.start
        assert g.n_atoms.dtype == e.n_atoms.dtype and np.array_equal(g.n_atoms, e.n_atoms)
        for mine, theirs in ((g.atoms, e.atoms), (g.structures, e.structures)):
            assert list(mine) == list(theirs), g.start
            for name, array in theirs.items():
                assert mine[name].dtype == array.dtype, (g.start, name)
                assert mine[name].shape == array.shape, (g.start, name)
                if array.dtype == object:  # strings
                    assert mine[name].tolist() == array.tolist(), (g.start, name)
                    assert {type(v) for v in mine[name].tolist()} == {str}, (g.start, name)
                else:
                    assert (np.ascontiguousarray(mine[name]).tobytes()
                            == np.ascontiguousarray(array).tobytes()), (g.start, name)


def assert_fast(path):
    """The fast reader reads the whole file, exactly as ASE does."""
    assert_identical(list(pieces(str(path), 0, None)), ase_pieces(path))


def assert_falls_back(path):
    """A file with structures that the fast reader leaves to ASE reads as ASE reads it, or
    fails as it does."""
    try:
        expected = ase_pieces(path)
    except DataError:
        assert_same_error(path)
    else:
        assert_identical(batch_pieces(path), expected)


def assert_same_error(path):
    with pytest.raises(DataError) as expected:
        ase_pieces(path)
    with pytest.raises(DataError) as got:
        batch_pieces(path)
    assert str(got.value) == str(expected.value)
    return str(got.value)


def varied_frames(seed=3):
    """Structures of 1 to 40 atoms, periodic, partly periodic and not, with extra per-atom
    arrays of every column type and info entries of several types."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate([1, 7, 40, 2, 13, 1, 25]):
        atoms = Atoms(numbers=rng.integers(1, 95, n), positions=rng.normal(0, 4, (n, 3)))
        if i % 3 == 0:
            atoms.cell = np.diag(rng.uniform(5, 9, 3)) + rng.normal(0, 0.3, (3, 3))
            atoms.pbc = True
        elif i % 3 == 1:
            atoms.cell = [[6.0, 0, 0], [0, 7.5, 0], [0, 0, 0]]
            atoms.pbc = [True, True, False]
        atoms.set_momenta(rng.normal(0, 1, (n, 3)))
        atoms.set_masses(rng.uniform(1, 200, n))
        atoms.set_tags(rng.integers(0, 4, n))
        atoms.set_initial_charges(rng.normal(0, 0.5, n))
        atoms.new_array("flag", rng.integers(0, 2, n).astype(bool))
        atoms.new_array("mask3", rng.integers(0, 2, (n, 3)).astype(bool))
        atoms.new_array("counts", rng.integers(-5, 5, (n, 2)))
        atoms.new_array("weight", rng.random(n) * 10.0 ** rng.integers(-30, 30, n))
        atoms.new_array("label", np.array([f"a{j}" for j in range(n)], object))
        atoms.info.update(step=i, temperature=float(rng.uniform(1, 900)), odd=bool(i % 2),
                          name=f"frame_{i}", vector=rng.normal(0, 1, 4), ints=np.arange(3) + i,
                          flags=[True, False, bool(i % 2)], virial=rng.normal(0, 1, (3, 3)),
                          big=10 ** 15 + i, tiny=float(rng.normal()) * 1e-300)
        atoms.calc = SinglePointCalculator(
            atoms, energy=float(rng.normal()), free_energy=float(rng.normal()),
            forces=rng.normal(0, 1, (n, 3)), stress=rng.normal(0, 0.1, 6),
            energies=rng.normal(0, 1, n), charges=rng.normal(0, 1, n),
            magmoms=rng.normal(0, 1, n), magmom=float(rng.normal()), dipole=rng.normal(0, 1, 3))
        out.append(atoms)
    return out


def test_sample_data():
    assert_fast(SAMPLES / "metals.extxyz")


def test_batches_read_extxyz_without_ase_io(monkeypatch, extxyz, ase_reference):
    monkeypatch.setattr(ase.io, "iread", None)
    n_atoms, per_atom, per_structure = ase_reference(extxyz)
    with open_batch(extxyz) as batch:
        assert np.array_equal(batch.n_atoms, n_atoms)
        chunk, = batch.iter_chunks(["forces", "stress"])
    assert np.array_equal(chunk.atoms["forces"], per_atom["forces"])
    assert np.array_equal(chunk.structures["stress"], per_structure["stress"])


def test_conftest_frames(extxyz):
    assert_fast(extxyz)


@pytest.mark.parametrize("options", [
    {},
    {"write_results": False},
    {"write_info": False},
    {"columns": ["symbols", "positions", "masses", "flag", "counts"]},
    {"columns": ["numbers", "positions", "symbols", "momenta"]},
    {"columns": ["positions", "symbols", "tags", "mask3", "label"], "write_results": False},
], ids=["all", "no_results", "no_info", "some_columns", "numbers_and_symbols", "reordered"])
def test_files_written_by_ase(tmp_path, options):
    path = tmp_path / "varied.extxyz"
    ase.io.write(path, varied_frames(), format="extxyz", **options)
    assert_fast(path)


def test_string_info_is_kept(tmp_path):
    path = tmp_path / "varied.extxyz"
    ase.io.write(path, varied_frames(), format="extxyz")
    got = [piece.structures["name"] for piece in pieces(str(path), 0, None)]
    assert [(array.dtype, array.tolist()) for array in got] == [
        (np.dtype(object), [f"frame_{i}"]) for i in range(7)]


def test_constraints_and_plain_xyz(tmp_path):
    frames = varied_frames(5)
    frames[0].set_constraint(FixAtoms(indices=[0]))
    frames[2].set_constraint([FixCartesian(1, [True, False, True]), FixCartesian(3)])
    ase.io.write(tmp_path / "fixed.extxyz", frames, format="extxyz")
    assert "move_mask:L:3" in (tmp_path / "fixed.extxyz").read_text()
    assert_fast(tmp_path / "fixed.extxyz")
    ase.io.write(tmp_path / "plain.xyz", frames, format="xyz")
    assert_fast(tmp_path / "plain.xyz")


def test_many_structures_and_selections(tmp_path):
    rng = np.random.default_rng(0)
    frames = []
    for n in rng.integers(1, 30, 60):
        atoms = Atoms(numbers=rng.integers(1, 90, n), positions=rng.normal(0, 5, (n, 3)),
                      cell=np.eye(3) * 20, pbc=True)
        atoms.calc = SinglePointCalculator(atoms, energy=rng.normal(),
                                           forces=rng.normal(0, 1, (n, 3)))
        frames.append(atoms)
    path = tmp_path / "many.extxyz"
    ase.io.write(path, frames, format="extxyz")
    assert_fast(path)
    for start, stop in [(0, 1), (5, 17), (59, None), (60, None), (10, 10)]:
        assert_identical(list(pieces(str(path), start, stop)), ase_pieces(path, start, stop))


HANDWRITTEN = {
    "numbers_column": "2\nProperties=Z:I:1:pos:R:3 energy=-1\n"
                      "29 0 0 0\n8 1.5 -0 1e-3\n",
    "both_columns": "2\nProperties=species:S:1:pos:R:3:Z:I:1\nCu 0 0 0 6\nX 1 1 1 8\n",
    "lowercase_species": "2\n\ncu 0.1 0.2 0.3\nO 1 2 3\n",
    "integer_lattice": '1\nLattice="10 0 0 0 10 0 0 0 10" stress="1 2 3 2 4 5 3 5 6" '
                       'energy=3 virial="1 0 0 0 1 0 0 0 1"\nH 0 0 0\n',
    "pbc_without_lattice": '1\npbc="T F T" dipole="1 2 3"\nH 0 0 0\n',
    "lattice_without_pbc": '1\nLattice="3 0 0 0 3 0 0 0 3" have_forces\nHe 0 0 0\n',
    "single_pbc": '1\nLattice="3 0 0 0 3 0 0 0 3" pbc=F\nHe 0 0 0\n',
    "quoted_and_escaped": '1\nname="a \\"quoted\\" b" data={1 2 3} other=\'4,5\' json='
                          '"_JSON [[1, 2], [3, 4]]" obj="_JSON {\\"a\\": 1}"\nH 0 0 0\n',
    "odd_numbers": "2\nProperties=species:S:1:pos:R:3:w:R:1\nH 1_0 +2 -0.0 nan\n"
                   "H inf -Infinity 1e-320 1E400\n",
    "string_columns": "2\nProperties=species:S:1:pos:R:3:tag:S:2:n:I:1:ok:L:1\n"
                      "H 0 0 0 x y -3 T\nH 1 1 1 z w 2147483647 False\n",
    "whitespace": "  2 \n  energy=1.5  \t\nH\t0 0 0\n   He  1.0   2.0   3.0   \n",
    "windows_lines": "1\r\nenergy=2\r\nH 0 0 0\r\n1\r\n\r\nH 1 1 1\r\n",
    "charge_column": "2\nProperties=species:S:1:pos:R:3:charge:R:1:initial_charges:R:1\n"
                     "H 0 0 0 0.5 1\nH 1 1 1 -0.5 -1\n",
    "move_mask": "2\nProperties=species:S:1:pos:R:3:move_mask:L:1\nH 0 0 0 T\nH 1 1 1 F\n"
                 "2\nProperties=species:S:1:pos:R:3:move_mask:L:3\nH 0 0 0 T T T\nH 1 1 1 F T F\n",
    "energy_column": "2\nProperties=species:S:1:pos:R:3:energy:R:1 energy=4\n"
                     "H 0 0 0 1\nH 1 1 1 2\n",
}


@pytest.mark.parametrize("name", HANDWRITTEN)
def test_handwritten_files(tmp_path, name):
    path = tmp_path / f"{name}.extxyz"
    path.write_text(HANDWRITTEN[name], newline="")
    assert_fast(path)


FALLBACK = {
    "vec_lines": "1\ncomment\nH 0 0 0\nVEC1 3 0 0\n1\n\nH 0 0 0\n",
    "extra_column": "1\n\nH 0 0 0\n1\n\nH 0 0 0 5\n",
    "quoted_string_column": "1\nProperties=species:S:1:pos:R:3:s:S:1\nH 0 0 0 a\n"
                            '1\nProperties=species:S:1:pos:R:3:s:S:1\nH 0 0 0 "a b"\n',
    "unknown_element": "1\n\nH 0 0 0\n1\n\nHe 0 0 0\n1\n\nQq 0 0 0\n",
    "positions_as_integers": "1\nProperties=species:S:1:pos:I:3\nH 0 0 0\n",
    "no_positions": "1\nProperties=species:S:1:x:R:3\nH 0 0 0\n",
    "no_species": "1\nProperties=pos:R:3\n0 0 0\n",
    "bool_spelled_otherwise": "1\nProperties=species:S:1:pos:R:3:b:L:1\nH 0 0 0 T\n"
                              "1\nProperties=species:S:1:pos:R:3:b:L:1\nH 0 0 0 1\n",
    "empty_structure": "1\n\nH 0 0 0\n0\n\n1\n\nH 1 1 1\n",
    "string_forces": "1\nProperties=species:S:1:pos:R:3:forces:S:3\nH 0 0 0 1 2 3\n",
}


@pytest.mark.parametrize("name", FALLBACK)
def test_fallback_to_ase(tmp_path, name):
    path = tmp_path / f"{name}.extxyz"
    path.write_text(FALLBACK[name])
    assert_falls_back(path)


@pytest.mark.parametrize("name,index,cut", [
    ("bad_float", 2, lambda lines: lines[:22] + [lines[22].replace(".", "x", 1)] + lines[23:]),
    ("bad_stress", 1, lambda lines: lines[:8] + [lines[8].replace("stress=\"", "stress=\"1 ")]
     + lines[9:]),
])
def test_bad_files_give_ases_error(tmp_path, extxyz, name, index, cut):
    lines = extxyz.read_text().splitlines(keepends=True)
    path = tmp_path / f"{name}.extxyz"
    path.write_text("".join(cut(lines)))
    message = assert_same_error(path)
    assert message.startswith(f"{path}: ASE cannot read structure {index} as extxyz")


@pytest.mark.parametrize("name, cut, message", [
    ("truncated_atoms", lambda lines: lines[:-5], "structure 5 claims 7 atoms, but the file ends "
                                                  "6 atom line(s) later"),
    ("truncated_comment", lambda lines: lines[:-3], "structure 6 claims 2 atoms, but the file "
                                                    "ends 0 atom line(s) later"),
    ("claims_1e12_atoms", lambda lines: ["1000000000000\n", *lines[1:3]],
     "structure 0 claims 1000000000000 atoms, but the file ends 1 atom line(s) later"),
    ("latin_1_comment", lambda lines: [lines[0], lines[1].replace("Properties", "é Properties")],
     "line 2 is not UTF-8 text (byte 0xe9: invalid continuation byte)"),
])
def test_a_truncated_frame_or_non_utf8_text_is_one_line_at_once(tmp_path, extxyz, name, cut,
                                                                  message):
    """A frame whose atom lines the file does not hold is refused before ASE reads it (ASE
    would read on through 10^12 claimed atoms); text that is not UTF-8 is named."""
    lines = extxyz.read_text().splitlines(keepends=True)
    path = tmp_path / f"{name}.extxyz"
    text = "".join(cut(lines))
    path.write_bytes(text.encode("latin-1") if "é" in text else text.encode())
    with pytest.raises(DataError) as error:
        batch_pieces(path)
    assert str(error.value) == f"{path}: {message}"

def test_compressed(tmp_path, extxyz):
    import gzip

    path = tmp_path / "frames.extxyz.gz"
    path.write_bytes(gzip.compress(extxyz.read_bytes()))
    assert_fast(path)
    assert_identical(batch_pieces(path), ase_pieces(extxyz))


def test_fallback_in_the_middle_of_a_selection(tmp_path):
    frames = varied_frames(9) * 2
    path = tmp_path / "mixed.extxyz"
    ase.io.write(path, frames, format="extxyz", columns=["symbols", "positions", "label"])
    text = path.read_text().replace(" a3\n", ' "a 3"\n')  # a quoted string: ASE's way only
    path.write_text(text)
    first = next(i for i, atoms in enumerate(frames) if len(atoms) > 3)
    assert_falls_back(path)
    for start, stop in [(0, first), (0, first + 1), (1, None), (first, first + 2), (5, 12)]:
        assert_identical(batch_pieces(path, start, stop), ase_pieces(path, start, stop))


def test_dash_reads_extxyz_from_stdin_like_the_file(tmp_path):
    from click.testing import CliRunner

    from segcli.cli import main

    path = tmp_path / "frames.extxyz"
    ase.io.write(path, varied_frames(), format="extxyz")
    runner = CliRunner()
    for command in (["reduce", "{}", "sum", "forces", "+", "count"], ["stats", "{}", "energy"]):
        from_file = runner.invoke(main, [str(path) if a == "{}" else a for a in command])
        from_stdin = runner.invoke(main, ["-" if a == "{}" else a for a in command],
                                   input=path.read_bytes())
        assert from_file.exit_code == from_stdin.exit_code == 0, from_stdin.output
        assert from_stdin.stdout == from_file.stdout
    empty = runner.invoke(main, ["reduce", "-", "count"], input=b"")
    assert empty.exit_code == 1 and "-: stdin holds no structure (it is empty)" in empty.output
