"""Seed inputs of each target: small valid files written by ASE, h5py and segcli itself, and a
few damaged ones.

    python -m fuzz.seed            # rewrite the committed corpus, fuzz/corpus/<target>/
    python -m fuzz.seed --large D  # the larger seeds, made at run time, into D/<target>/
"""

import argparse
import bz2
import gzip
import io
import os
import tempfile
from pathlib import Path

import h5py
import numpy as np

from fuzz.targets import NAMES, TARGETS

CORPUS = Path(__file__).parent / "corpus"


def _structures(count, seed=0):
    """Small molecules and crystals with energy, forces, stress, momenta and info entries."""
    from ase import Atoms
    from ase.build import bulk, molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    kinds = [lambda: molecule("H2O"), lambda: bulk("Cu", cubic=True), lambda: molecule("CH4"),
             lambda: Atoms("Ar"), lambda: bulk("NaCl", "rocksalt", a=5.6)]
    out = []
    for i in range(count):
        atoms = kinds[i % len(kinds)]()
        atoms.rattle(0.05, seed=i)
        atoms.set_momenta(rng.normal(size=(len(atoms), 3)))
        atoms.info.update(step=i, label=f"s{i}", temperature=300.0 + i)
        atoms.calc = SinglePointCalculator(
            atoms, energy=float(rng.normal()), forces=rng.normal(size=(len(atoms), 3)),
            **({"stress": rng.normal(size=6)} if atoms.pbc.any() else {}))
        out.append(atoms)
    return out


def _ase_bytes(images, fmt, **kwargs):
    import ase.io

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"file.{fmt}")
        ase.io.write(path, images, format=fmt, **kwargs)
        return Path(path).read_bytes()


def _h5_bytes(write):
    """The bytes of an HDF5 file that `write(h5)` fills (h5py, no timestamps)."""
    buf = io.BytesIO()
    with h5py.File(buf, "w", libver="latest", track_order=False) as h5:
        write(h5)
    return buf.getvalue()


def _converted(images):
    """A segcli HDF5 file as `segcli convert` writes it."""
    from segcli.io import convert

    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "in.extxyz"), os.path.join(tmp, "out.h5")
        Path(source).write_bytes(_ase_bytes(images, "extxyz"))
        convert([source], target, fill_missing=float("nan"))
        return Path(target).read_bytes()


def _segcli_layout(h5, n_atoms=(3, 1, 2), results=True, present=True, lie=None):
    """The segcli-batch layout by hand (SPEC §4): a result per structure and per atom, a field
    that one structure lacks; `lie` sets n_atoms to other counts than the data's."""
    rng = np.random.default_rng(1)
    n = sum(n_atoms)
    h5.attrs["format"], h5.attrs["version"] = "segcli-batch", 1
    h5["structures/n_atoms"] = np.array(lie if lie is not None else n_atoms, np.int64)
    h5["structures/energy"] = rng.normal(size=len(n_atoms))
    h5["structures/cell"] = np.tile(np.eye(3) * 5, (len(n_atoms), 1, 1))
    h5["structures/pbc"] = np.ones((len(n_atoms), 3), bool)
    h5["structures/label"] = np.array([b"a", b"bb", b"c"][:len(n_atoms)], h5py.string_dtype())
    h5["atoms/positions"] = rng.normal(size=(n, 3))
    h5["atoms/numbers"] = rng.integers(1, 30, n)
    h5["atoms/masses"] = rng.uniform(1, 60, n)
    h5["atoms/momenta"] = rng.normal(size=(n, 3)).astype(np.float32)
    if present:
        h5["structures/charge"] = np.array([1.0, np.nan, -1.0][:len(n_atoms)])
        h5["present/charge"] = np.array([True, False, True][:len(n_atoms)])
        h5["structures/charge"].attrs["fill_value"] = np.nan
    if results:
        h5["results/sum_forces"] = rng.normal(size=len(n_atoms))
        h5["results/sum_forces"].attrs.update(op="sum", fields="forces", per="structure")
        h5["results/grad/d_positions"] = rng.normal(size=(n, 3))
        h5["results/grad/d_positions"].attrs.update(op="sum", fields="positions", per="atom")


def _conformer_layout(h5, symbols=False, nested=True):
    """Molecule groups as ANI-1x, SPICE and Transition1x hold them (SPEC §4)."""
    from ase.data import chemical_symbols

    rng = np.random.default_rng(2)
    groups = [("H2O", [8, 1, 1], 2, "coordinates"), ("CH4", [6, 1, 1, 1, 1], 1, "positions")]
    if nested:
        groups.append(("rxn/ts/N2", [7, 7], 3, "conformations"))
    for name, numbers, c, key in groups:
        g = h5.create_group(name)
        if symbols:
            g["species"] = np.array([chemical_symbols[z] for z in numbers], "S2")
        else:
            g["atomic_numbers"] = np.array(numbers, np.uint8)
        g[key] = rng.normal(size=(c, len(numbers), 3)).astype(np.float32)
        g["wb97x_dz.energy"] = rng.normal(size=c)
        g["wb97x_dz.forces"] = rng.normal(size=(c, len(numbers), 3))
        g["dipole"] = rng.normal(size=(c, 3))
        g["smiles"] = np.array([b"O"] * c)
    if nested:
        h5["rxn/link"] = h5py.SoftLink("/H2O")


def _extxyz_texts():
    images = _structures(5)
    written = _ase_bytes(images, "extxyz")
    numbers = (b"2\nProperties=Z:I:1:pos:R:3:move_mask:L:1 energy=-1.5 pbc=\"F F F\"\n"
               b"1 0.0 0.0 0.0 T\n8 0.0 0.0 1.0 F\n")
    return {
        "ase.extxyz": written,
        "plain.xyz": b"3\nwater\nO 0 0 0\nH 0 0 0.96\nH 0.93 0 -0.24\n",
        "numbers.extxyz": numbers,
        "lattice.extxyz": (b'1\nLattice="3 0 0 0 3 0 0 0 3" Properties=species:S:1:pos:R:3:'
                           b"forces:R:3 energy=2 stress=\"1 0 0 0 1 0 0 0 1\" tag=x\n"
                           b"Cu 0 0 0 0.1 0.2 0.3\n"),
        "vec.xyz": b"1\n\nH 0 0 0\nVEC1 3 0 0\nVEC2 0 3 0\nVEC3 0 0 3\n",
        "truncated.extxyz": written[: len(written) * 2 // 3],
        "latin1.extxyz": b"1\ncomment=\xe9t\xe9\nH 0 0 0\n",
        "lying-count.extxyz": b"1000000000000\n\nH 0 0 0\n",
    }


def _hdf5_files():
    return {
        "layout.h5": _h5_bytes(_segcli_layout),
        "no-results.h5": _h5_bytes(lambda h5: _segcli_layout(h5, results=False, present=False)),
        "lying-n_atoms.h5": _h5_bytes(lambda h5: _segcli_layout(h5, lie=(3, -1, 2))),
    }


def _conformer_files():
    layout = _h5_bytes(_conformer_layout)
    return {
        "numbers.h5": layout,
        "symbols.h5": _h5_bytes(lambda h5: _conformer_layout(h5, symbols=True, nested=False)),
        "truncated.h5": layout[: len(layout) // 2],
    }


def _named(name, content):
    """A `formats` input: the byte that picks `name` (see fuzz.targets.NAMES), then content."""
    return bytes([NAMES.index(name)]) + content


def _format_files():
    images = _structures(2)
    extxyz = _ase_bytes(images, "extxyz")
    return {
        "extxyz": _named("data.extxyz", extxyz),
        "xyz-gz": _named("data.xyz.gz", gzip.compress(extxyz, mtime=0)),
        "extxyz-bz2": _named("data.extxyz.bz2", bz2.compress(extxyz)),
        "segcli-h5": _named("data.h5", _h5_bytes(lambda h5: _segcli_layout(h5, results=False))),
        "conformers-h5": _named("data.hdf5", _h5_bytes(
            lambda h5: _conformer_layout(h5, nested=False))),
        "json-db": _named("data.json", b'{"1": {"numbers": [1], "positions": [[0, 0, 0]]}, '
                                       b'"ids": [1], "nextid": 2}'),
        "cif": _named("data.cif", _ase_bytes(images[1], "cif")),
        "poscar": _named("POSCAR", _ase_bytes(images[1], "vasp")),
        "pdb": _named("data.pdb", _ase_bytes(images[0], "proteindatabank")),
        "empty": _named("data", b""),
        "sqlite-magic": _named("data.db", b"SQLite format 3\x00" + bytes(100)),
        "lmdb-magic": _named("data.aselmdb", bytes(16) + b"\xde\xc0\xef\xbe" + bytes(12)),
        "count-only": _named("data.txt", b"2\n"),
    }


def _database_bytes(images, kind, spectrum=7, **pairs):
    """An ASE database of type `kind` ("db": its SQLite pages made 512 bytes, the smallest, and
    "aselmdb": copied compacted, so the seeds stay small) holding `images`, each row with
    key-value `pairs` and a `data` array of `spectrum` random numbers (1000: past half an LMDB
    page, so LMDB keeps the row in overflow pages)."""
    import sqlite3

    import ase.db

    rng = np.random.default_rng(4)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"file.{kind}")
        with ase.db.connect(path, type=kind) as db:
            for atoms in images:
                db.write(atoms, data={"spectrum": rng.random(spectrum)}, **pairs)
        if kind == "db":
            con = sqlite3.connect(path)
            con.execute("PRAGMA page_size=512")
            con.execute("VACUUM")
            con.close()
            return Path(path).read_bytes()
        import lmdb

        compact = os.path.join(tmp, "compact.aselmdb")
        with lmdb.open(path, subdir=False, readonly=True, lock=False) as env:
            env.copy(compact, compact=True)
        return Path(compact).read_bytes()


def _asedb_files():
    import sqlite3

    with tempfile.TemporaryDirectory() as tmp:
        foreign = os.path.join(tmp, "foreign.db")
        con = sqlite3.connect(foreign)
        con.execute("PRAGMA page_size=512")
        con.execute("CREATE TABLE systems (id INTEGER)")
        con.commit()
        con.close()
        foreign_bytes = Path(foreign).read_bytes()
    return {"two.db": _database_bytes(_structures(2), "db", config="x", weight=1.5),
            "no-tables.db": _database_bytes([], "db"),
            "systems-only.db": foreign_bytes}


def _aselmdb_files():
    return {"two.aselmdb": _database_bytes(_structures(2), "aselmdb", config="x"),
            "empty.aselmdb": _database_bytes([], "aselmdb"),
            "overflow.aselmdb": _database_bytes(_structures(1), "aselmdb", spectrum=1000)}


def _cli_outputs(*commands):
    """{output name: bytes} of segcli commands (lists of arguments, `IN` for an extxyz file of
    five structures) each writing the output named last."""
    from click.testing import CliRunner

    from segcli.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "in.extxyz")
        Path(source).write_bytes(_ase_bytes(_structures(5), "extxyz"))
        out = {}
        for command in commands:
            args = [source if a == "IN" else os.path.join(tmp, a) if a.endswith(".h5") else a
                    for a in command]
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
            out[command[-1]] = Path(args[-1]).read_bytes()
        return out


def _merge_files():
    return _cli_outputs(
        ["reduce", "IN", "sum", "forces", "--shard", "1/2", "-o", "reduce-part.h5"],
        ["grad", "IN", "sum", "positions", "--shard", "0/2", "-o", "grad-part.h5"],
        ["stats", "IN", "energy", "--shard", "0/2", "-o",
         "stats-part.h5"])


def _stats_files():
    return _cli_outputs(["stats", "IN", "forces", "energy", "-o", "plain.h5"],
                        ["stats", "IN", "forces", "--per-element", "-o", "by-element.h5"],
                        ["stats", "IN", "energy", "--by", "label", "-o", "by-label.h5"])


COMMITTED = {"extxyz": _extxyz_texts, "hdf5": _hdf5_files, "conformers": _conformer_files,
             "formats": _format_files, "asedb": _asedb_files, "aselmdb": _aselmdb_files,
             "merge": _merge_files, "statsfile": _stats_files}
"""target -> a function returning {file name: bytes} of its committed corpus."""


def _large_files(target):
    """Bigger seeds, never committed: many structures, ASE databases, an ASE trajectory."""
    import ase.db

    images = _structures(40, seed=3)
    if target == "extxyz":
        return {"many.extxyz": _ase_bytes(images, "extxyz")}
    if target == "hdf5":
        return {"converted.h5": _converted(images[:3]), "many.h5": _converted(images)}
    if target == "conformers":
        return {"many.h5": _h5_bytes(lambda h5: [_conformer_layout(h5.create_group(f"g{i}"))
                                                 for i in range(8)])}
    if target in ("asedb", "aselmdb"):
        return {"many": _database_bytes(images, {"asedb": "db"}.get(target, target))}
    if target in ("merge", "statsfile"):
        return {}  # the committed seeds are of a few structures and fields already
    out = {"traj": _named("data.traj", _ase_bytes(images[:3], "traj"))}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "file.db")
        with ase.db.connect(path) as db:
            for atoms in images[:2]:
                db.write(atoms)
        out["sqlite-db"] = _named("data.db", Path(path).read_bytes())
    return out


def write(files, directory):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", metavar="DIR", help="write the larger run-time seeds here")
    args = parser.parse_args()
    for target in TARGETS:
        if args.large:
            write(_large_files(target), Path(args.large) / target)
        else:
            write(COMMITTED[target](), CORPUS / target)


if __name__ == "__main__":
    main()
