"""Units of fields: the names segcli knows, the conventions of the conformer datasets, and the
conversion to ASE's units (eV, Å, eV/Å, eV/Å³, amu, e)."""

import fnmatch
import functools
import re

import numpy as np

from segcli.errors import DataError
from segcli.fields import held

CONVENTIONS = {
    "conformations": (("conformations", "Bohr"), ("*_energy", "Hartree"),
                      ("*_gradient", "Hartree/Bohr"), ("*_charges", "e")),
    "coordinates": (("coordinates", "Ang"), ("*.energy", "Hartree"),
                    ("*.forces", "Hartree/Ang"), ("*_charges", "e")),
    "positions": (("positions", "Ang"), ("*.energy", "eV"), ("*.forces", "eV/Ang")),
}
"""The units of a conformer file's datasets that state none, by the name of its positions
dataset (which tells the dataset apart) and then by the dataset's name:
- SPICE (`conformations`; Eastman et al., Sci. Data 10, 11 (2023), and the README of
  github.com/openmm/spice-dataset: atomic units) stores positions in bohr, energies
  (`formation_energy`, `dft_total_energy`) in hartree, `dft_total_gradient` in
  hartree/bohr and `mbis_charges` in e;
- ANI-1x (`coordinates`; Smith et al., Sci. Data 7, 134 (2020)) stores positions in Å,
  energies (`wb97x_dz.energy`, `ccsd(t)_cbs.energy`, ...) in hartree, forces
  (`wb97x_dz.forces`) in hartree/Å and charges (`wb97x_dz.cm5_charges`, ...) in e;
- Transition1x (`positions`; Schreiner et al., Sci. Data 9, 779 (2022)) stores positions in
  Å, `wB97x_6-31G(d).energy` in eV and `wB97x_6-31G(d).forces` in eV/Å."""

GRADIENT = re.compile(r"(.*[._])?gradient")
"""The names of gradient fields (`dft_total_gradient`), which --to-ase-units turns into forces."""


@functools.cache
def known():
    """Each unit segcli knows -> (the ASE unit of its kind, the factor to it), from ase.units."""
    from ase import units

    energy = {"eV": 1.0, "Hartree": units.Hartree, "kcal/mol": units.kcal / units.mol,
              "kJ/mol": units.kJ / units.mol}
    length = {"Ang": 1.0, "Bohr": units.Bohr, "nm": units.nm}
    table = {}
    for name, factor in energy.items():
        table[name] = ("eV", factor)
        table.update({f"{name}/{per}": ("eV/Ang", factor / length[per]) for per in ("Ang", "Bohr")})
    table.update({name: ("Ang", factor) for name, factor in length.items()})
    table.update({"eV/Ang^3": ("eV/Ang^3", 1.0), "GPa": ("eV/Ang^3", units.GPa),
                  "Hartree/Bohr^3": ("eV/Ang^3", units.Hartree / units.Bohr ** 3),
                  "amu": ("amu", 1.0), "e": ("e", 1.0), "e*Ang": ("e*Ang", 1.0),
                  "e*Bohr": ("e*Ang", units.Bohr)})
    return table


def canonical(text):
    """The name segcli knows a unit by (`Å`, `angstrom`, `hartree`, `Ha` read as `Ang`,
    `Hartree`), or None for a unit it does not know."""
    text = re.sub("Å|angstrom", "Ang", text.strip(), flags=re.IGNORECASE)
    text = re.sub(r"\bHa\b", "Hartree", text)
    by_lower = {name.lower(): name for name in known()}
    return by_lower.get(text.lower())


def stated(text):
    """A unit as a file states it: segcli's name for it where it knows it, else as written."""
    return canonical(text) or text


def convention(layout, name):
    """The unit of the dataset `name` of a conformer group whose positions dataset is
    `layout`, by CONVENTIONS; None where it has none."""
    return next((unit for pattern, unit in CONVENTIONS.get(layout, ())
                 if fnmatch.fnmatchcase(name, pattern)), None)


def is_ase(unit):
    """Whether `unit` is ASE's for its kind (or not known, so not known to be another)."""
    return unit not in known() or known()[unit][0] == unit


def join(path, name, index, before, unit, hint=""):
    """The unit of field `name` after structures in `unit` (from structure `index` of `path`)
    join those in `before`; DataError (ending with `hint`) when both are stated and differ,
    or one is stated, not ASE's, and the other unstated (ASE's units assumed)."""
    if before == unit or (None in (before, unit) and is_ase(before or unit)):
        return before or unit
    said = [f"in {u}" if u else "without units" for u in (unit, before)]
    raise DataError(f"{path}: field '{name}' is {said[0]} in structure {index}, {said[1]} "
                    f"before{hint}")


def to_ase(path, piece, units, left):
    """A piece (of the file `path`) with each field of known units `units` (name -> unit)
    converted to ASE's units, a gradient field turned into `forces` (its negative); the names
    of fields whose units are not known go to `left` (name -> unit)."""
    out, names = [], {}
    for data in (piece.atoms, piece.structures):
        converted = {}
        for name, values in data.items():
            unit = units.get(name)
            if unit not in known():
                if unit is not None:
                    left[name] = unit
                converted[name] = values
                continue
            if values.dtype.kind not in "iufc":
                raise DataError(f"{path}: field '{name}' holds {held(values.dtype)}, which "
                                f"have no units (it is said to be in {unit})")
            new, _, factor = _in_ase_units(name, unit)
            if new != name:
                if new in data or new in converted:
                    raise DataError(f"{path}: --to-ase-units turns '{name}' into '{new}', "
                                    f"which structure {piece.start} has already")
                names[name] = new
            converted[new] = _scaled(path, piece, name, values, factor) if factor != 1 \
                else values
        out.append(converted)
    present = {names.get(n, n): mask for n, mask in piece.present.items()}
    return piece._replace(atoms=out[0], structures=out[1], present=present)


def _scaled(path, piece, name, values, factor):
    """`values` of field `name` (in `piece` of the file `path`) times `factor`; DataError naming
    the first structure where a finite value becomes too large for its dtype."""
    with np.errstate(over="ignore"):  # checked next
        scaled = values * factor
    overflow = np.isinf(scaled) & np.isfinite(values)
    if overflow.any():
        row = int(np.argmax(overflow.reshape(len(values), -1).any(axis=1)))
        first = piece.structure_of(row) if name in piece.atoms else \
            int(piece.structure_numbers[row])
        raise DataError(f"{path}: field '{name}' of structure {first} holds a value too large "
                        f"for {scaled.dtype} once converted by --to-ase-units (times {factor:g})")
    return scaled


def _in_ase_units(name, unit):
    """(name, unit, factor to it) of field `name`, in the known `unit`, in ASE's units: a
    gradient's name is `forces` and its factor negated."""
    target, factor = known()[unit]
    if target == "eV/Ang" and GRADIENT.fullmatch(name):
        return "forces", target, -factor
    return name, target, factor


def ase_units(units):
    """`units` (name -> unit) as --to-ase-units leaves them (see to_ase)."""
    return dict(_in_ase_units(name, unit)[:2] if unit in known() else (name, unit)
                for name, unit in units.items())


def check_ase(path, units):
    """DataError for the first field of `units` (name -> unit) in a known unit not ASE's: the
    formats ASE writes hold ASE's units."""
    for name, unit in units.items():
        if not is_ase(unit):
            raise DataError(f"{path}: field '{name}' is in {unit}, not ASE's "
                            f"{known()[unit][0]}; files ASE writes hold ASE's units "
                            "(--to-ase-units converts them)")
