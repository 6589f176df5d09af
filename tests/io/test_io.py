"""segcli.io against ase.io.read, h5py and NumPy, on files written fresh to tmp_path."""

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys

import ase.io
import h5py
import numpy as np
import pytest
from ase.data import chemical_symbols

from segcli.errors import DataError
from segcli.io import ResultWriter, convert, open_batch

ATOM_FIELDS = ["numbers", "positions", "momenta", "forces", "velocities", "scaled_positions"]
STRUCTURE_FIELDS = ["cell", "pbc", "energy", "stress", "temperature", "step"]


def read_all(batch, fields, **kwargs):
    """Every chunk of a batch, checked to hold whole structures within the bound, concatenated."""
    chunks = list(batch.iter_chunks(fields, **kwargs))
    bound = kwargs.get("chunk_atoms", 1_000_000)
    selected = batch.n_atoms[kwargs.get("structures", slice(None))]
    first = kwargs.get("structures", slice(None)).start or 0
    position = 0
    for chunk in chunks:
        assert chunk.start == first + position
        assert np.array_equal(chunk.n_atoms, selected[position:position + len(chunk.n_atoms)])
        total = chunk.n_atoms.sum()
        assert total <= bound or len(chunk.n_atoms) == 1
        position += len(chunk.n_atoms)
        if position < len(selected):  # greedy: the next structure would not have fitted
            assert total + selected[position] > bound or total > bound
        for name, array in chunk.atoms.items():
            assert len(array) == total, name
        for name, array in chunk.structures.items():
            assert len(array) == len(chunk.n_atoms), name
    assert position == len(selected)
    return {name: np.concatenate([c.atoms.get(name, c.structures.get(name)) for c in chunks])
            for name in fields}


def assert_same(got, expected):
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert np.array_equal(got[name], value), name


@pytest.mark.parametrize("chunk_atoms", [1, 13, 1_000_000])
def test_extxyz_chunks_match_ase(extxyz, ase_reference, chunk_atoms):
    n_atoms, per_atom, per_structure = ase_reference(extxyz)
    with open_batch(extxyz) as batch:
        assert batch.format == "extxyz" and batch.path == str(extxyz)
        assert np.array_equal(batch.n_atoms, n_atoms) and batch.n_atoms.dtype == np.int64
        assert batch.n_structures == len(n_atoms)
        got = read_all(batch, ATOM_FIELDS + STRUCTURE_FIELDS, chunk_atoms=chunk_atoms)
        fields = batch.fields
        assert batch.results == {}
    assert_same(got, {**per_atom, **per_structure})
    assert {name: (f.per, f.shape, f.dtype) for name, f in fields.items()} == {
        "numbers": ("atom", (), np.int64), "positions": ("atom", (3,), np.float64),
        "momenta": ("atom", (3,), np.float64), "forces": ("atom", (3,), np.float64),
        "velocities": ("atom", (3,), np.float64), "scaled_positions": ("atom", (3,), np.float64),
        "cell": ("structure", (3, 3), np.float64), "pbc": ("structure", (3,), np.bool_),
        "energy": ("structure", (), np.float64), "stress": ("structure", (6,), np.float64),
        "temperature": ("structure", (), np.float64), "step": ("structure", (), np.int64),
        "label": ("structure", (), np.dtype(object))}


def test_structure_selection(extxyz, ase_reference):
    n_atoms, per_atom, per_structure = ase_reference(extxyz)
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    with open_batch(extxyz) as batch:
        got = read_all(batch, ["forces", "energy"], chunk_atoms=20, structures=slice(2, 5))
        assert list(batch.iter_chunks(["forces"], structures=slice(4, 4))) == []
    assert np.array_equal(got["forces"], per_atom["forces"][offsets[2]:offsets[5]])
    assert np.array_equal(got["energy"], per_structure["energy"][2:5])


def test_derived_fields_use_stored_masses(tmp_path, frames):
    rng = np.random.default_rng(3)
    masses = [rng.uniform(1, 100, len(atoms)) for atoms in frames]
    for atoms, m in zip(frames, masses):
        atoms.set_masses(m)
    path = tmp_path / "masses.traj"
    ase.io.write(path, frames)
    got = read_all(open_batch(path), ["velocities", "scaled_positions", "masses"], chunk_atoms=9)
    images = ase.io.read(path, ":")
    assert np.array_equal(got["velocities"], np.concatenate([a.get_velocities() for a in images]))
    assert np.array_equal(got["scaled_positions"], np.concatenate(
        [a.get_scaled_positions(wrap=False) for a in images]))
    assert np.array_equal(got["masses"], np.concatenate(masses))


@pytest.mark.parametrize("fmt", ["traj", "db", "cif", "vasp"])
def test_other_ase_formats(tmp_path, frames, fmt):
    images = [a for a in frames if a.pbc.all()] if fmt in ("cif", "vasp") else frames
    images = images[:1] if fmt == "vasp" else images
    path = tmp_path / ("POSCAR" if fmt == "vasp" else f"frames.{fmt}")
    ase.io.write(path, images, format=fmt)
    reference = ase.io.read(path, ":")
    got = read_all(open_batch(path), ["numbers", "positions", "cell", "pbc"], chunk_atoms=10)
    assert np.array_equal(got["numbers"], np.concatenate([a.numbers for a in reference]))
    assert np.array_equal(got["positions"], np.concatenate([a.positions for a in reference]))
    assert np.array_equal(got["cell"], np.stack([a.cell.array for a in reference]))
    assert np.array_equal(got["pbc"], np.stack([a.pbc for a in reference]))


def test_convert_round_trip_is_bit_exact_and_follows_the_layout(extxyz, ase_reference):
    out = extxyz.with_name("out.h5")
    n, atoms, fields = convert([extxyz], out, chunk_atoms=10)
    n_atoms, per_atom, per_structure = ase_reference(extxyz)
    assert (n, atoms) == (len(n_atoms), n_atoms.sum())
    with open_batch(out) as batch:
        assert batch.format == "segcli"
        assert batch.fields.keys() == fields.keys() | {"velocities", "scaled_positions"}
        got = read_all(batch, ATOM_FIELDS + STRUCTURE_FIELDS, chunk_atoms=1_000)
    assert_same(got, {**per_atom, **per_structure})
    with h5py.File(out) as h5:
        assert h5.attrs["format"] == "segcli-batch" and h5.attrs["version"] == 1
        assert np.array_equal(h5["structures/n_atoms"][()], n_atoms)
        assert h5["structures/n_atoms"].dtype == np.int64
        assert sorted(h5["atoms"]) == ["forces", "momenta", "numbers", "positions"]
        assert sorted(h5["structures"]) == ["cell", "energy", "label", "n_atoms", "pbc", "step",
                                            "stress", "temperature"]
        assert h5py.check_string_dtype(h5["structures/label"].dtype).encoding == "utf-8"
        assert "present" not in h5 and "fill_value" not in h5["structures/energy"].attrs
        assert h5["atoms/positions"].shape == (n_atoms.sum(), 3)
        assert h5["atoms/positions"].chunks is not None
        assert h5["atoms/positions"].maxshape == (None, 3)
    assert [p for p in os.listdir(out.parent) if p.endswith(".tmp")] == []


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_convert_compressed(extxyz, ase_reference, compression):
    out = extxyz.with_name("out.h5")
    convert([extxyz], out, compression=compression)
    with h5py.File(out) as h5:
        assert h5["atoms/forces"].compression == compression
    expected = {"forces": ase_reference(extxyz)[1]["forces"]}
    assert_same(read_all(open_batch(out), ["forces"]), expected)


def test_convert_concatenates_inputs_of_every_kind(tmp_path, frames):
    ase.io.write(tmp_path / "a.extxyz", frames[:3])
    ase.io.write(tmp_path / "b.traj", frames[3:])
    convert([tmp_path / "b.traj"], tmp_path / "b.h5")
    convert([tmp_path / "a.extxyz", tmp_path / "b.h5", tmp_path / "b.traj"], tmp_path / "all.h5",
            chunk_atoms=8)
    images = [*ase.io.read(tmp_path / "a.extxyz", ":"), *ase.io.read(tmp_path / "b.traj", ":")]
    images += images[3:]
    got = read_all(open_batch(tmp_path / "all.h5"), ["positions", "forces", "energy", "cell"])
    assert np.array_equal(got["positions"], np.concatenate([a.positions for a in images]))
    assert np.array_equal(got["forces"], np.concatenate([a.get_forces() for a in images]))
    assert np.array_equal(got["energy"], [a.get_potential_energy() for a in images])
    assert np.array_equal(got["cell"], [a.cell.array for a in images])


def test_field_in_some_structures(tmp_path, frames):
    frames[2].info["charge"] = 1.5
    frames[4].info["charge"] = -0.5
    path = tmp_path / "partial.extxyz"
    ase.io.write(path, frames)
    with pytest.raises(DataError, match=r"partial.extxyz: structure 0 has no field 'charge'"):
        convert([path], tmp_path / "out.h5")
    del frames[2].info["charge"], frames[4].info["charge"]
    frames[0].arrays.pop("momenta")
    ase.io.write(path, frames)
    with pytest.raises(DataError, match=r"structure 0 has no field 'momenta'"):
        convert([path], tmp_path / "out.h5", chunk_atoms=3)
    chunk, = open_batch(path).iter_chunks(["momenta"], structures=slice(0, 3))
    assert chunk.present["momenta"].tolist() == [False, True, True]  # filled as convert fills
    assert np.isnan(chunk.atoms["momenta"][:len(frames[0])]).all()
    assert not (tmp_path / "out.h5").exists()
    frames[0].set_momenta(np.ones((len(frames[0]), 3)))
    frames[5].arrays.pop("momenta")
    frames[3].info["charge"] = 2.0
    ase.io.write(path, frames)
    with pytest.raises(DataError, match=r"partial.extxyz: structure 5 has no field 'momenta'"):
        convert([path], tmp_path / "out.h5")
    convert([path], tmp_path / "out.h5", fill_missing=np.nan, chunk_atoms=6)
    got = read_all(open_batch(tmp_path / "out.h5"), ["momenta", "charge"])
    expected = [a.arrays.get("momenta", np.full((len(a), 3), np.nan))
                for a in ase.io.read(path, ":")]
    assert np.array_equal(got["momenta"], np.concatenate(expected), equal_nan=True)
    assert np.array_equal(got["charge"], [np.nan] * 3 + [2.0] + [np.nan] * 3, equal_nan=True)
    frames[1].info["flag"] = 3
    ase.io.write(path, frames)
    convert([path], tmp_path / "out2.h5", fill_missing=np.nan, chunk_atoms=2)
    with open_batch(tmp_path / "out2.h5") as batch:
        assert np.array_equal(read_all(batch, ["flag"])["flag"], [0, 3, 0, 0, 0, 0, 0])
        assert np.array_equal(batch.present("flag"), np.arange(7) == 1)
        assert batch.present("charge").tolist() == [False] * 3 + [True] + [False] * 3
        assert batch.present("momenta").tolist() == [True] * 5 + [False, True]
        assert batch.present("velocities").tolist() == [True] * 5 + [False, True]
        assert batch.present("positions") is None
        assert (batch.fill_value("flag"), batch.fill_value("positions")) == (0, None)
        assert np.isnan(batch.fill_value("charge"))


def test_convert_promotes_a_field_that_turns_float(tmp_path, frames):
    for i, atoms in enumerate(frames):
        atoms.info["order"] = i if i < 4 else i + 0.5
    ase.io.write(tmp_path / "p.extxyz", frames)
    convert([tmp_path / "p.extxyz"], tmp_path / "p.h5", chunk_atoms=5)
    with open_batch(tmp_path / "p.h5") as batch:
        assert batch.fields["order"].dtype == np.float64
        got = read_all(batch, ["order"])["order"]
    assert np.array_equal(got, [0, 1, 2, 3, 4.5, 5.5, 6.5])


def write_conformers(path):
    """A conformer-layout file and what each field must read as, in file order (groups are
    created in the order h5py lists them; a soft link must not count twice)."""
    rng = np.random.default_rng(5)
    expected = {k: [] for k in ("numbers", "positions", "forces", "charges", "energy", "dipole")}
    n_atoms = []
    with h5py.File(path, "w") as h5:
        for name, n, c, numbers_key, positions_key in [
                ("C2H6", 8, 3, "atomic_numbers", "coordinates"),
                ("nested/H2O", 3, 2, "species", "conformations"),
                ("nested/deeper/CH4", 5, 4, "atomic_numbers", "positions"),
                ("z/O2", 2, 1, "species", "coordinates")]:
            g = h5.create_group(name)
            numbers = rng.integers(1, 9, n)
            symbols = np.array([chemical_symbols[z] for z in numbers], "S2")
            g[numbers_key] = (numbers.astype(np.uint8) if numbers_key == "atomic_numbers"
                              else symbols)
            data = {"positions": rng.normal(size=(c, n, 3)), "forces": rng.normal(size=(c, n, 3)),
                    "charges": rng.normal(size=(c, n)).astype(np.float32),
                    "energy": rng.normal(size=c), "dipole": rng.normal(size=(c, 3))}
            g[positions_key] = data.pop("positions")
            if positions_key == "conformations":  # SPICE's name, in Bohr unless stated
                g[positions_key].attrs["units"] = "Ang"
            positions = g[positions_key][()]
            for key, value in data.items():
                g[key] = value
            g["formal_charges"] = np.zeros(n + 1)
            g["smiles"] = np.array([b"C"] * c)
            expected["numbers"].append(np.tile(numbers, c))
            expected["positions"].append(positions.reshape(-1, 3))
            expected["forces"].append(data["forces"].reshape(-1, 3))
            expected["charges"].append(data["charges"].reshape(-1))
            expected["energy"].append(data["energy"])
            expected["dipole"].append(data["dipole"])
            n_atoms += [n] * c
        h5["nested/link"] = h5py.SoftLink("/C2H6")
    return np.array(n_atoms), {k: np.concatenate(v) for k, v in expected.items()}


@pytest.mark.parametrize("chunk_atoms", [1, 10, 1000])
def test_conformer_layout(tmp_path, chunk_atoms):
    n_atoms, expected = write_conformers(tmp_path / "conf.h5")
    with open_batch(tmp_path / "conf.h5") as batch:
        assert batch.format == "conformers"
        assert np.array_equal(batch.n_atoms, n_atoms)
        assert {n: (f.per, f.shape, f.dtype) for n, f in batch.fields.items()} == {
            "numbers": ("atom", (), np.int64), "positions": ("atom", (3,), np.float64),
            "forces": ("atom", (3,), np.float64), "charges": ("atom", (), np.float32),
            "energy": ("structure", (), np.float64), "dipole": ("structure", (3,), np.float64)}
        assert_same(read_all(batch, list(expected), chunk_atoms=chunk_atoms), expected)
        got = read_all(batch, ["forces", "dipole"], chunk_atoms=chunk_atoms, structures=slice(2, 7))
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    assert np.array_equal(got["forces"], expected["forces"][offsets[2]:offsets[7]])
    assert np.array_equal(got["dipole"], expected["dipole"][2:7])


def test_conformer_field_in_some_groups(tmp_path):
    write_conformers(tmp_path / "conf.h5")
    with h5py.File(tmp_path / "conf.h5", "a") as h5:
        del h5["nested/H2O/dipole"]
    with open_batch(tmp_path / "conf.h5") as batch:
        assert "dipole" in batch.fields
        assert batch.present("dipole").tolist() == [True] * 3 + [False] * 2 + [True] * 5
        assert batch.present("numbers") is None and batch.present("forces") is None
        unconverted = read_all(batch, ["dipole"])["dipole"]  # filled as convert fills it
    convert([tmp_path / "conf.h5"], tmp_path / "out.h5", fill_missing=np.nan, chunk_atoms=10)
    with open_batch(tmp_path / "out.h5") as batch:
        dipole = read_all(batch, ["dipole"])["dipole"]
        assert np.isnan(dipole[3:5]).all() and not np.isnan(dipole[:3]).any()
        assert np.array_equal(dipole, unconverted, equal_nan=True)
        assert batch.present("dipole").tolist() == [True] * 3 + [False] * 2 + [True] * 5
        chunks = list(batch.iter_chunks(["dipole", "energy"], chunk_atoms=10))
        assert not any("energy" in c.present for c in chunks)
        assert np.concatenate([c.present.get("dipole", np.ones(len(c.n_atoms), bool))
                               for c in chunks]).tolist() == batch.present("dipole").tolist()


def test_conformer_groups_through_links(tmp_path):
    """Groups are found through hard links only, a group under two names once per name (at
    the root too); datasets of a group through soft and external links too, a dangling link
    left out; units as attributes state them (in bytes or text), else by convention."""
    rng = np.random.default_rng(3)
    numbers, positions, energy = [1, 8], rng.normal(size=(3, 2, 3)), rng.normal(size=3)
    with h5py.File(tmp_path / "other.h5", "w") as other:
        other["dipole"] = rng.normal(size=(3, 3))
    with h5py.File(tmp_path / "conf.h5", "w") as h5:
        h5["numbers"] = np.array(numbers, np.int16)
        for h5_or_group in (h5, h5.create_group("m")):
            h5_or_group["atomic_numbers"] = h5py.SoftLink("/numbers")
            h5_or_group["conformations"] = positions
            h5_or_group["dft_total_energy"] = energy
        h5["m/conformations"].attrs["units"] = np.bytes_(b"bohr")
        h5["m/dft_total_energy"].attrs["units"] = "hartree"
        h5["m/energy_again"] = h5py.SoftLink("/m/dft_total_energy")
        h5["m/dipole"] = h5py.ExternalLink("other.h5", "/dipole")
        h5["m/dangling"] = h5py.SoftLink("/nowhere")
        h5["n"] = h5["m"]
        h5["soft"] = h5py.SoftLink("/m")
    with open_batch(tmp_path / "conf.h5") as batch:
        fields = {n: (f.per, f.shape, f.units) for n, f in batch.fields.items()}
        got = read_all(batch, ["numbers", "positions", "dft_total_energy", "energy_again"])
        present = batch.present("dipole")
    assert np.array_equal(batch.n_atoms, [2] * 9)
    assert fields == {"numbers": ("atom", (), None), "positions": ("atom", (3,), "Bohr"),
                      "dft_total_energy": ("structure", (), "Hartree"),
                      "energy_again": ("structure", (), "Hartree"),
                      "dipole": ("structure", (3,), None)}
    assert np.array_equal(got["numbers"], numbers * 9)
    assert np.array_equal(got["positions"], np.tile(positions.reshape(-1, 3), (3, 1)))
    assert np.array_equal(got["dft_total_energy"], np.tile(energy, 3))
    assert np.isnan(got["energy_again"][:3]).all()
    assert np.array_equal(got["energy_again"][3:], np.tile(energy, 2))
    assert present.tolist() == [False] * 3 + [True] * 6


def replace(group, name, value):
    """`group[name]` replaced by `value` (an array, or a dict: a group)."""
    if name in group:
        del group[name]
    if isinstance(value, dict):
        group.create_group(name)
    else:
        group[name] = value


@pytest.mark.parametrize("name, value, message", [
    ("coordinates", {}, "/a/coordinates is not a dataset"),
    ("atomic_numbers", {}, "/a/atomic_numbers is not a dataset"),  # species do not stand in
    ("atomic_numbers", [[1]], "/a/atomic_numbers must be 1-D, not of shape (1, 1)"),
    ("atomic_numbers", 1, "/a/atomic_numbers must be 1-D, not of shape ()"),
    ("atomic_numbers", np.array([b"H", b"Xx"]), "/a/atomic_numbers holds 'Xx', not a chemical "
                                                "symbol"),
    ("positions", np.zeros((2, 2, 3)), "group /a must hold exactly one of coordinates, "
                                       "conformations, positions; it holds ['coordinates', "
                                       "'positions']"),
    ("coordinates", np.zeros((2, 3, 3)), "/a/coordinates has shape (2, 3, 3), not (conformers, "
                                         "2, 3) for the 2 atomic numbers"),
])
def test_conformer_groups_that_are_refused(tmp_path, name, value, message):
    with h5py.File(tmp_path / "conf.h5", "w") as h5:
        group = h5.create_group("a")
        group["atomic_numbers"] = np.array([1, 1], np.int16)
        group["species"] = np.array([b"H", b"H"])
        group["coordinates"] = np.zeros((2, 2, 3))
        replace(group, name, value)
    with pytest.raises(DataError) as err:
        open_batch(tmp_path / "conf.h5").close()
    assert str(err.value) == f"{tmp_path / 'conf.h5'}: {message}"


def test_conformer_units_that_are_not_text_are_refused(tmp_path):
    with h5py.File(tmp_path / "conf.h5", "w") as h5:
        h5["a/species"] = np.array([b"H", b"H"])
        h5["a/coordinates"] = np.zeros((2, 2, 3))
        h5["a/energy"] = np.zeros(2)
        h5["a/energy"].attrs["units"] = 5
    with pytest.raises(DataError) as err:
        open_batch(tmp_path / "conf.h5").close()
    assert str(err.value) == f"{tmp_path / 'conf.h5'}: attribute units of /a/energy is 5, not text"


def test_missing_field_lists_the_fields(tmp_path):
    write_conformers(tmp_path / "conf.h5")
    with open_batch(tmp_path / "conf.h5") as batch:
        with pytest.raises(DataError, match=r"conf.h5: no field 'velocities'; its fields are: "
                                            r"charges, dipole, energy, forces, numbers, positions"):
            list(batch.iter_chunks(["forces", "velocities"]))


def test_empty_inputs(tmp_path):
    (tmp_path / "empty.extxyz").write_text("")
    with open_batch(tmp_path / "empty.extxyz") as batch:
        assert batch.n_structures == 0 and batch.fields == {}
    convert([tmp_path / "empty.extxyz"], tmp_path / "empty.h5")
    with open_batch(tmp_path / "empty.h5") as batch:
        assert batch.format == "segcli" and batch.n_structures == 0
        assert list(batch.iter_chunks([])) == []


def test_result_writer_new_file(batch_h5, tmp_path):
    n_atoms = open_batch(batch_h5).n_atoms
    out = tmp_path / "results.h5"
    values = np.arange(len(n_atoms) * 3, dtype=np.float64).reshape(-1, 3)
    with ResultWriter(output_path=out) as w:
        w.create("sum_forces", values.shape, values.dtype,
                 {"op": "sum", "fields": ["forces"], "per": "structure"})
        w.write("sum_forces", 0, values[:2])
        w.write("sum_forces", 2, values[2:])
        w.set_n_atoms(n_atoms)
    with open_batch(out) as batch:
        assert np.array_equal(batch.n_atoms, n_atoms)
        attrs = batch.results["sum_forces"]
    assert {k: attrs[k] for k in ("op", "fields", "per")} == {
        "op": "sum", "fields": ["forces"], "per": "structure"}
    assert {"segcli_version", "created"} <= attrs.keys()
    with h5py.File(out) as h5:
        assert np.array_equal(h5["results/sum_forces"][()], values)
        assert h5.attrs["format"] == "segcli-batch"
    with pytest.raises(DataError, match="results.h5: already exists; use --force"):
        with ResultWriter(output_path=out) as w:
            pass
    with ResultWriter(output_path=out, force=True) as w:
        w.set_n_atoms(n_atoms[:2])
    assert open_batch(out).n_structures == 2


def _write_rows(into, blocks, values, limit=None):
    """In a process of its own: the `blocks` ((name, lo, hi) of its rows) of `values` through
    the RowsInto `into`, its files capped at `limit` bytes (RLIMIT_FSIZE) if given; the
    DataError's message, or None."""
    import resource

    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        with into as w:
            for name, array in values.items():
                w.create(name, array.shape, array.dtype, {}, np.nan if name == "filled" else None)
            for name, lo, hi in blocks:
                w.write(name, lo, values[name][lo:hi])
    except DataError as error:
        return str(error)
    return None


def test_rows_written_by_other_processes_into_a_placed_result_equal_one_writer(tmp_path):
    """Results created `placed` (ResultWriter.places) while their file stays open here, and
    their rows written by three other processes (RowsInto), a shard each, in blocks out of
    order, some rows of the NaN-filled result left out: the file then holds what one writer
    writing every block would, and a process whose files are capped below its rows gets a
    DataError naming the output, and the output is not made."""
    import concurrent.futures
    import multiprocessing

    from segcli.io.writers import RowsInto

    rng = np.random.default_rng(3)
    sizes = {"filled": 900, "vector": 900, "atoms": 4000}  # per structure, and per atom
    values = {"filled": rng.normal(size=900),
              "vector": rng.normal(size=(900, 3)).astype(np.float32),
              "atoms": rng.integers(-99, 99, (4000, 2))}
    shards = {"filled": [0, 250, 250, 900], "vector": [0, 250, 250, 900],
              "atoms": [0, 1000, 1000, 4000]}  # the middle shard empty
    jobs, skipped = [[] for _ in range(3)], []  # skipped: blocks of "filled" left out
    for name, cuts in shards.items():
        for k, (a, b) in enumerate(itertools.pairwise(cuts)):
            edges = np.unique(np.r_[a, rng.integers(a, b + 1, 5), b]) - a
            blocks = [(name, int(lo), int(hi)) for lo, hi in itertools.pairwise(edges)]
            if name == "filled":
                skipped += [(a + lo, a + hi) for _, lo, hi in blocks[1::3]]
                del blocks[1::3]
            rng.shuffle(blocks)
            jobs[k].append((name, blocks, values[name][a:b]))
    context = multiprocessing.get_context("spawn")
    for limit, out in ((None, tmp_path / "out.h5"), (50_000, tmp_path / "capped.h5")):
        with pytest.raises(DataError) if limit else contextlib.nullcontext():
            with ResultWriter(output_path=out) as w:
                w.set_n_atoms(np.ones(900, np.int64))
                for name, array in values.items():
                    w.create(name, (sizes[name], *array.shape[1:]), array.dtype, {"per": name},
                             np.nan if name == "filled" else None, placed=True)
                places = w.places()
                with concurrent.futures.ProcessPoolExecutor(3, mp_context=context) as pool:
                    errors = list(pool.map(_write_rows, [
                        RowsInto(w.temporary, str(out), {name: (places[name], shards[name][k])
                                                         for name, _, _ in job})
                        for k, job in enumerate(jobs)],
                        [[(n, lo, hi) for n, blocks, _ in job for _, lo, hi in blocks]
                         for job in jobs],
                        [{n: v for n, _, v in job} for job in jobs],
                        [limit] * 3))
                for name, cuts in shards.items():
                    for a, b in itertools.pairwise(cuts):
                        w.written_elsewhere(name, a, b)
                if limit:
                    assert f"{out}: File too large" in [e for e in errors if e]
                    raise DataError(errors[-1])
            assert errors == [None] * 3
    assert sorted(os.listdir(tmp_path)) == ["out.h5"]
    with h5py.File(tmp_path / "out.h5") as h5:
        expected = values["filled"].copy()
        for lo, hi in skipped:
            expected[lo:hi] = np.nan
        assert skipped and np.isnan(expected).sum() > 0
        assert np.array_equal(h5["results/filled"][()], expected, equal_nan=True)
        for name in ("vector", "atoms"):
            got = h5[f"results/{name}"]
            assert got.dtype == values[name].dtype and np.array_equal(got[()], values[name])
            assert dict(got.attrs)["per"] == name


@pytest.mark.parametrize("dtype", ["float64", "float32", "int64"])
def test_result_writer_writes_blocks_of_rows_in_any_order(tmp_path, dtype):
    """Blocks of rows (scalars, 3-vectors) written in shuffled order, some empty, into datasets
    of float64 left NaN where no block goes: the rows read back are the values, converted as
    NumPy converts them; a block of the wrong row shape is refused whole."""
    rng = np.random.default_rng(1)
    n = 1000
    values = {"scalar": (rng.normal(size=n) * 100).astype(dtype),
              "vector": (rng.normal(size=(n, 3)) * 100).astype(dtype)}
    cuts = np.unique(np.r_[0, rng.integers(0, n, 12), 500, 700, n])
    blocks = [(lo, hi) for lo, hi in itertools.pairwise(cuts) if hi != 700] + [(3, 3)]
    rng.shuffle(blocks)
    with ResultWriter(output_path=tmp_path / "out.h5") as w:
        w.set_n_atoms(np.ones(n, np.int64))
        for name, array in values.items():
            w.create(name, array.shape, "float64", {}, np.nan)
            for lo, hi in blocks:
                w.write(name, int(lo), array[lo:hi])
        with pytest.raises(ValueError, match=r"rows of shape \(2,\) for /results/vector"):
            w.write("vector", 0, values["vector"][:4, :2])
    with h5py.File(tmp_path / "out.h5") as h5:
        for name, array in values.items():
            expected = array.astype(np.float64)
            missing = [lo for lo, hi in itertools.pairwise(cuts) if hi == 700]
            for lo in missing:
                expected[lo:700] = np.nan
            assert np.array_equal(h5[f"results/{name}"][()], expected, equal_nan=True), name


@pytest.fixture(params=["C", "NumPy"])
def rows_route(request, monkeypatch):
    """A selection's rows copied by `_rows.c`, or by NumPy's indexing (SEGCLI_NATIVE_ROWS=0)."""
    from segcli.io import core

    monkeypatch.setenv("SEGCLI_NATIVE_ROWS", "1" if request.param == "C" else "0")
    core._native_rows.cache_clear()
    assert (core._native_rows() is not None) == (request.param == "C")
    yield
    core._native_rows.cache_clear()


@pytest.mark.parametrize("numbers", [[2, 3, 4], [0, 2, 5], [1, 4], [5]])
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.float64])
def test_a_selection_takes_and_spreads_the_rows_of_its_structures(rows_route, numbers, dtype):
    """Chunk.take keeps the rows of the structures a mask marks (the chunk itself, its arrays
    not copied, where it marks all); spread places them back among those of every structure
    from the first to the last (a per-atom field and a per-structure one), NaN in the rows of
    the others: against a loop over the structures, with integer rows promoted to float64 by
    the fill, empty structures among them."""
    from segcli.io.core import Chunk, spread

    n_atoms = np.array([2, 0, 3, 1, 4, 2])
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    rows = np.arange(offsets[-1] * 3, dtype=dtype).reshape(-1, 3)
    per_structure = np.arange(6 * 2, dtype=dtype).reshape(6, 2)
    chunk = Chunk(0, n_atoms, {"x": rows}, {"e": per_structure})
    mask = np.isin(np.arange(6), numbers)
    taken = chunk.take(mask)
    assert chunk.take(np.ones(6, bool)) is chunk
    expected = np.concatenate([rows[offsets[s]:offsets[s + 1]] for s in numbers])
    assert np.array_equal(taken.atoms["x"], expected) and taken.atoms["x"].dtype == dtype
    assert np.array_equal(taken.structures["e"], per_structure[numbers])
    assert np.array_equal(taken.structure_numbers, numbers)
    span = range(numbers[0], numbers[-1] + 1)
    for got, whole, starts in ((taken.atoms["x"], rows, offsets),
                               (taken.structures["e"], per_structure, np.arange(7))):
        first, block = spread(got, np.asarray(numbers), starts, np.nan)
        assert first == starts[numbers[0]]
        assert block.dtype == np.result_type(dtype, np.nan)
        reference = np.concatenate([whole[starts[s]:starts[s + 1]] if s in numbers else
                                    np.full((starts[s + 1] - starts[s], *whole.shape[1:]),
                                            np.nan) for s in span])
        assert np.array_equal(block, reference, equal_nan=True)


def test_result_writer_fills_the_rows_no_block_covers(tmp_path):
    """The rows before, between and after the blocks written (the gaps longer than the
    writer's step of rows), and a result never written, hold the fill (NaN) once the writer
    closes; the datasets state it as their fill value. A result without a fill is 0 there."""
    n = 200_000
    values = np.arange(n, dtype=np.float64)
    written = [(70_000, 80_000), (80_000, 80_500), (81_000, 81_001), (150_000, 150_010)]
    with ResultWriter(output_path=tmp_path / "out.h5") as w:
        w.set_n_atoms(np.ones(n, np.int64))
        for name, fill in (("filled", np.nan), ("never", np.nan), ("zeros", None)):
            w.create(name, (n, 3), "float64", {}, fill)
        for lo, hi in reversed(written):
            for name in ("filled", "zeros"):
                w.write(name, lo, np.repeat(values[lo:hi, None], 3, axis=1))
    inside = np.zeros(n, bool)
    for lo, hi in written:
        inside[lo:hi] = True
    with h5py.File(tmp_path / "out.h5") as h5:
        for name, fill in (("filled", np.nan), ("zeros", 0.0)):
            got = h5[f"results/{name}"][()]
            assert np.array_equal(got[inside], np.repeat(values[inside, None], 3, axis=1)), name
            assert np.array_equal(got[~inside], np.full(((~inside).sum(), 3), fill),
                                  equal_nan=True), name
        assert np.isnan(h5["results/never"][()]).all()
        assert np.isnan(h5["results/filled"].fillvalue)


def test_result_writer_leaves_nothing_on_failure(batch_h5, tmp_path):
    out = tmp_path / "results.h5"
    with pytest.raises(RuntimeError):
        with ResultWriter(output_path=out) as w:
            w.set_n_atoms([1, 2])
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="set_n_atoms"):
        with ResultWriter(output_path=out):
            pass
    before = batch_h5.read_bytes()
    with pytest.raises(RuntimeError):
        with ResultWriter(in_place_of=batch_h5) as w:
            w.create("x", (3,), np.float64, {"op": "sum"})
            raise RuntimeError("boom")
    assert batch_h5.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["batch.h5", "frames.extxyz"]


def test_result_writer_in_place(batch_h5, extxyz, monkeypatch):
    before = read_all(open_batch(batch_h5), ["forces", "energy"])
    n_atoms = open_batch(batch_h5).n_atoms
    with ResultWriter(in_place_of=batch_h5) as w:
        w.create("sum_forces", (len(n_atoms), 3), np.float64, {"op": "sum", "per": "structure"})
        w.write("sum_forces", 0, np.ones((len(n_atoms), 3)))
        w.create("sum_forces_grad/d_forces", (n_atoms.sum(), 3), np.float64, {"op": "sum"})
        w.set_n_atoms(n_atoms)
    with open_batch(batch_h5) as batch:
        assert sorted(batch.results) == ["sum_forces", "sum_forces_grad/d_forces"]
        assert_same(read_all(batch, ["forces", "energy"]), before)
    stored = batch_h5.read_bytes()
    for name in ("sum_forces", "sum_forces_grad/d_forces", "sum_forces/x"):
        with pytest.raises(DataError, match=f"result '{name.split('/x')[0]}' already exists"):
            with ResultWriter(in_place_of=batch_h5) as w:
                w.create(name, (1,), np.float64, {})
    assert batch_h5.read_bytes() == stored
    # results named up front are refused before the input is copied
    copies = []
    monkeypatch.setattr(shutil, "copyfile", lambda *args: copies.append(args))
    for name in ("sum_forces", "sum_forces/x"):
        with pytest.raises(DataError, match="result 'sum_forces' already exists"):
            with ResultWriter(in_place_of=batch_h5, names=["other", name]):
                pass
    assert copies == []
    monkeypatch.undo()
    with pytest.raises(DataError, match="must cover all its 7 structures, not 2"):
        with ResultWriter(in_place_of=batch_h5) as w:
            w.set_n_atoms(n_atoms[:2])
    with ResultWriter(in_place_of=batch_h5, force=True) as w:
        w.create("sum_forces", (len(n_atoms),), np.int32, {"op": "count"})
    with h5py.File(batch_h5) as h5:
        assert h5["results/sum_forces"].dtype == np.int32
        assert h5["results/sum_forces"].attrs["op"] == "count"
    with pytest.raises(DataError, match="frames.extxyz: results can only be stored in a segcli "
                                        "HDF5 file; convert it first"):
        with ResultWriter(in_place_of=extxyz):
            pass


def test_result_writer_in_place_survives_sigkill(batch_h5):
    before = batch_h5.read_bytes()
    script = (
        "import os, signal, numpy as np\n"
        "from segcli.io import ResultWriter\n"
        f"with ResultWriter(in_place_of={str(batch_h5)!r}) as w:\n"
        "    w.create('big', (10**6, 3), np.float64, {'op': 'sum'})\n"
        "    w.write('big', 0, np.ones((10**6, 3)))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, "-c", script])
    assert result.returncode == -signal.SIGKILL
    assert batch_h5.read_bytes() == before
    with open_batch(batch_h5) as batch:
        assert batch.results == {} and batch.n_structures == 7


def test_chunks_read_in_place_where_the_destination_fits(tmp_path):
    rng = np.random.default_rng(5)
    n_atoms = np.array([3, 1, 4, 2, 5])
    forces = rng.normal(size=(n_atoms.sum(), 3))
    path = tmp_path / "b.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="segcli-batch", version=1)
        f["structures/n_atoms"] = n_atoms
        f["atoms/forces"] = forces
        f["atoms/numbers"] = np.arange(n_atoms.sum())
    given = []

    def into(name, rows):
        given.append(np.full((rows + 2, 3), np.nan) if name == "forces" else np.zeros((rows, 7)))
        return given[-1][:rows]

    with open_batch(path) as batch:
        chunks = list(batch.iter_chunks(["forces", "numbers"], chunk_atoms=6, into=into))
    assert [len(c.n_atoms) for c in chunks] == [2, 2, 1]
    offsets = np.concatenate([[0], np.cumsum([c.n_atoms.sum() for c in chunks])])
    for k, chunk in enumerate(chunks):
        np.testing.assert_array_equal(chunk.atoms["forces"], forces[offsets[k]:offsets[k + 1]])
        assert chunk.atoms["forces"].ctypes.data == given[2 * k].ctypes.data  # read into it
        assert np.isnan(given[2 * k][len(chunk.atoms["forces"]):]).all()  # and only its rows
        # a destination of another shape is left alone
        assert chunk.atoms["numbers"].ctypes.data != given[2 * k + 1].ctypes.data
        np.testing.assert_array_equal(chunk.atoms["numbers"], np.arange(offsets[k], offsets[k + 1]))
