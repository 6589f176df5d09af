"""Make the bundled sample files, reproducibly (fixed seed), with ASE's EMT calculator.

    python sample_data/make_samples.py [OUTDIR]    (default: the directory of this script)

writes
- metals.extxyz: rattled periodic cells, slabs and clusters of Cu, Ag, Au, Ni, Pd, Pt, Al
  and their alloys, 1 to 55 atoms (one structure of a single atom), with EMT energies,
  per-atom energies, forces and stresses, and Maxwell-Boltzmann momenta;
- metals.h5: its conversion by `segcli.io.convert`;
- conformers.h5: small clusters in the conformer-group layout of ANI-1x (`atomic_numbers`
  or `species`, `coordinates` (C, n, 3), `energies` (C,), `forces` (C, n, 3), nested groups).

Needs ASE >= 3.29 (ase.md.velocitydistribution.thermalize_momenta).
"""

import os
import sys

import ase.io
import h5py
import numpy as np
from ase import Atoms
from ase.build import bulk, fcc111
from ase.calculators.emt import EMT
from ase.cluster import Decahedron, Icosahedron, Octahedron
from ase.md.velocitydistribution import thermalize_momenta

from segcli.io import convert

METALS = ("Cu", "Ag", "Au", "Ni", "Pd", "Pt", "Al")
SEED = 20240601


def rattled(atoms, rng, stdev):
    atoms.positions += rng.normal(0.0, stdev, atoms.positions.shape)
    return atoms


def random_positions(n, rng, spacing=2.3):
    """n points in a cube sized for the count, none closer than `spacing` Å (a loose cluster
    or molecule, not overlapping atoms with forces of thousands of eV/Å)."""
    side = spacing * 1.6 * n ** (1 / 3)
    points = []
    while len(points) < n:
        candidate = rng.uniform(0, side, 3)
        if all(np.linalg.norm(candidate - p) >= spacing for p in points):
            points.append(candidate)
    return np.array(points)


def shapes(metal, rng):
    """Periodic cells (some strained or alloyed), a slab and clusters of one metal (only their
    numbers, positions, cell and pbc are used)."""
    other = METALS[(METALS.index(metal) + 1) % len(METALS)]
    yield bulk(metal)
    for repeat in ((1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2), (3, 2, 2)):
        cell = bulk(metal, cubic=True).repeat(repeat)
        cell.set_cell(cell.cell * rng.uniform(0.97, 1.03), scale_atoms=True)
        yield cell
    alloy = bulk(metal, cubic=True).repeat((2, 2, 1))
    alloy.symbols[rng.random(len(alloy)) < 0.3] = other
    yield alloy
    yield fcc111(metal, (2, 2, 3), vacuum=6.0)
    clusters = [Icosahedron(metal, 2), Octahedron(metal, 3, 1), Decahedron(metal, 2, 2, 0)]
    if metal == "Cu":
        clusters.append(Icosahedron(metal, 3))
    for size in rng.integers(2, 9, 3):
        clusters.append(Atoms(metal * int(size), positions=random_positions(int(size), rng)))
    for cluster in clusters:
        cluster.center(vacuum=5.0)
        yield cluster


def metals(rng):
    frames = []
    for metal in METALS:
        for shape in shapes(metal, rng):
            for temperature in (300.0, 900.0):
                atoms = Atoms(shape.numbers, shape.positions, cell=shape.cell, pbc=shape.pbc)
                rattled(atoms, rng, 0.05 if any(shape.pbc) else 0.1)
                thermalize_momenta(atoms, temperature_K=temperature, rng=rng)
                atoms.info["temperature_K"] = temperature
                atoms.info["config_type"] = "bulk" if all(shape.pbc) else (
                    "slab" if any(shape.pbc) else "cluster")
                frames.append(atoms)
    single = Atoms("Au", positions=[[5.0, 5.0, 5.0]], cell=[10.0, 10.0, 10.0])
    thermalize_momenta(single, temperature_K=300.0, rng=rng)
    single.info.update(temperature_K=300.0, config_type="atom")
    frames.insert(len(frames) // 2, single)
    for atoms in frames:
        atoms.calc = EMT()
        atoms.get_potential_energy()
        atoms.get_forces()
        atoms.get_stress()
    return frames


def conformers(rng, path):
    """ANI-1x-like groups: one per cluster formula, some nested, some with `species` symbols."""
    with h5py.File(path, "w") as h5:
        for i, metal in enumerate(METALS):
            other = METALS[(i + 3) % len(METALS)]
            for n in (2, 4, 7):
                symbols = [metal] * (n - n // 3) + [other] * (n // 3)
                base = Atoms(symbols, positions=random_positions(n, rng))
                n_conformers = int(rng.integers(3, 9))
                coordinates = np.empty((n_conformers, n, 3))
                energies = np.empty(n_conformers)
                forces = np.empty((n_conformers, n, 3))
                for c in range(n_conformers):
                    atoms = rattled(base.copy(), rng, 0.1)
                    atoms.calc = EMT()
                    coordinates[c] = atoms.positions
                    energies[c] = atoms.get_potential_energy()
                    forces[c] = atoms.get_forces()
                formula = base.get_chemical_formula()
                group = h5.create_group(f"{metal}/{formula}" if n > 2 else formula)
                if i % 2:
                    group["species"] = np.array(symbols, dtype="S2")
                else:
                    group["atomic_numbers"] = base.numbers.astype(np.uint8)
                group["coordinates"] = coordinates
                group["energies"] = energies
                group["forces"] = forces


def main(outdir):
    rng = np.random.default_rng(SEED)
    extxyz = os.path.join(outdir, "metals.extxyz")
    ase.io.write(extxyz, metals(rng), format="extxyz")
    convert([extxyz], os.path.join(outdir, "metals.h5"), force=True)
    conformers(rng, os.path.join(outdir, "conformers.h5"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
