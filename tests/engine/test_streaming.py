"""Extended XYZ files read directly: memory that does not grow with the number of atoms, and
the forces that ASE reads."""

import tracemalloc

import ase.io
import numpy as np
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

from segcli.io.asefiles import ExtxyzBatch


def write(path, n_structures, seed=0):
    """An extxyz file of periodic structures of 1-63 atoms with forces and energy."""
    rng = np.random.default_rng(seed)
    frames = []
    for n in rng.integers(1, 64, n_structures):
        atoms = Atoms(numbers=rng.integers(1, 30, n), positions=rng.normal(0, 3, (n, 3)),
                      cell=np.eye(3) * 10, pbc=True)
        atoms.calc = SinglePointCalculator(atoms, energy=float(rng.normal()),
                                           forces=rng.normal(0, 1, (n, 3)))
        frames.append(atoms)
    ase.io.write(path, frames, format="extxyz")
    return str(path)


def read_all(path, chunk_atoms=500):
    """Concatenated forces and energies of a full scan and `iter_chunks` pass."""
    batch = ExtxyzBatch(path)
    forces, energies = [], []
    for chunk in batch.iter_chunks(["forces", "energy"], chunk_atoms=chunk_atoms):
        forces.append(chunk.atoms["forces"])
        energies.append(chunk.structures["energy"])
    return np.concatenate(forces), np.concatenate(energies)


def peak_traced(path):
    """Peak traced memory (bytes) of a scan and `iter_chunks` pass keeping nothing read."""
    tracemalloc.start()
    try:
        batch = ExtxyzBatch(path)
        assert batch.n_structures > 0
        for _ in batch.iter_chunks(["forces"], chunk_atoms=500):
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_flat_in_atoms(tmp_path):
    small = write(tmp_path / "small.extxyz", 60, seed=1)
    large = write(tmp_path / "large.extxyz", 240, seed=2)
    read_all(small)  # imports and caches outside the measurement
    small_peak, large_peak = peak_traced(small), peak_traced(large)
    assert large_peak < 1.5 * small_peak + 64 * 1024, (small_peak, large_peak)


def test_values_equal_ase(tmp_path):
    path = write(tmp_path / "f.extxyz", 50)
    expected = ase.io.read(path, ":")
    forces, energies = read_all(path, chunk_atoms=100)
    assert np.array_equal(forces, np.concatenate([a.get_forces() for a in expected]))
    assert np.array_equal(energies, [a.get_potential_energy() for a in expected])
