"""Writing structures to the files ASE writes (extxyz, traj, db, ...), streamed a chunk at a
time: the inverse of reading one (see segcli.io.asefiles.structure_piece)."""

import functools
import os
import shutil
import warnings
from contextlib import ExitStack, contextmanager, suppress

import numpy as np

from segcli.errors import DataError, Note, memory_shortage, raise_if_interrupted
from segcli.io.core import N_ELEMENTS, are_elements, not_an_element
from segcli.io.outputs import new_output
from segcli.io.writers import FieldChoice

HDF5_SUFFIXES = (".h5", ".hdf5")
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}
_DATABASES = ("db", "json", "aselmdb")
"""Formats written through ase.db, a row per structure (ASE's own writers of these need a
file name that says the format, which a temporary's does not); aselmdb (LMDB, through
ase-db-backends) is named by its suffix alone."""
_STREAMED = frozenset({"extxyz", "xyz", "traj", "cif", "eon", "castep-geom", "castep-md", "py",
                       "runnerdata", "vasp-xdatcar"})
"""Formats of several structures whose ASE writers take them one at a time (the others are
given a list, held in memory)."""
_UNWRITABLE = {"pov": "ASE writes it as several files (.pov, .ini)",
               "xtd": "ASE writes it as two files (.xtd, .arc)",
               "mustem": "ASE's writer needs the microscope's keV, which segcli does not take",
               "espresso-in": "ASE's writer needs pseudopotentials, which segcli does not take"}
_NEEDS_CELL = frozenset({"abinit-in", "cfg", "crystal", "dftb", "dmol-incoor", "elk-in", "jsv",
                         "lammps-data", "onetep-in", "prismatic", "res", "rmc6f", "struct",
                         "v-sim", "vasp"})
"""Formats that hold only structures with a cell of three vectors (ASE's writers of some
invent one, others fail)."""


def export_format(path):
    """The ASE format that the name `path` asks for; None for a segcli HDF5 file (a name
    ending .h5 or .hdf5, or with no suffix); DataError when ASE writes no format of that
    name."""
    name = os.fspath(path)
    suffix = os.path.splitext(os.path.basename(name))[1].lower()
    if suffix in ("", *HDF5_SUFFIXES):
        return None  # (ASE, whose ase.io imports SciPy, left unloaded: 0.45 s)
    if suffix == ".aselmdb":
        return "aselmdb"
    from ase.io.formats import UnknownFileTypeError, filetype, ioformats

    try:
        fmt = filetype(name, read=False)
    except UnknownFileTypeError:
        fmt = None
    if fmt not in ioformats or not ioformats[fmt].can_write:
        raise DataError(f"{name}: no format to write by that name; name a segcli HDF5 file "
                        "(.h5, .hdf5) or a file ASE writes (.extxyz, .traj, .db, .xyz, ...)")
    io = ioformats[fmt]
    reason = _UNWRITABLE.get(fmt)
    if reason is None and not (io.single or io.acceptsfd or fmt in _DATABASES):
        reason = "ASE writes it only as a directory, an animation or to a server"
    if reason is None and _compression(name) and (fmt == "db" or not io.acceptsfd):
        reason = ("ASE reads it only from a file of its own, not compressed; leave out "
                  f"{os.path.splitext(name)[1]}")
    if reason is not None:
        raise DataError(f"{name}: segcli cannot export to the format {fmt}: {reason}")
    return fmt


def _compression(output):
    """The module (gzip, bz2, lzma) compressing the file `output` as its suffix says, or None."""
    return _COMPRESSED.get(os.path.splitext(output)[1].lower())


def export(inputs, output, fmt, *, chunk_atoms=100_000, fields=None, drop=None, rename=None,
           cast=None, units=None, to_ase_units=False, left=None, keep=None, force=False,
           progress=None, input_format=None):
    """Write the structures of `inputs` (files open_batch reads, in `input_format` if given),
    in order, to the new file `output` in ASE's format `fmt` (see export_format), compressed
    as its name says (.gz, .bz2, .xz), streaming `chunk_atoms` atoms at a time: per
    structure, positions, numbers, cell and pbc as the Atoms', calculator results (energy,
    forces, stress, ...) as a SinglePointCalculator's, a per-atom bool field `fixed` as a
    FixAtoms constraint, the other per-atom fields as arrays and per-structure ones as info
    (or, in a database, as key-value pairs where ASE allows, else data); a structure without
    a field leaves it out.
    `fields`, `drop`, `rename`, `cast`, `units`, `to_ase_units` and `left` choose, rename,
    cast and convert fields as convert's do; a field in known units that are not ASE's
    raises DataError (see units.check_ase) unless `to_ase_units` converts it. `keep` (a bool
    per structure of the inputs, in order) writes only those it marks.
    Returns (structures, atoms) written."""
    from ase.io import write
    from ase.io.formats import ioformats

    from segcli.io import open_batch
    from segcli.io.units import check_ase

    output = os.fspath(output)
    choice = FieldChoice(fields, drop, rename, cast, units, to_ase_units, left)
    counts = [0, 0]
    with ExitStack() as stack:
        batches = [stack.enter_context(open_batch(path, input_format)) for path in inputs]
        stated = [choice.units(batch) for batch in batches]
        for batch, units in zip(batches, stated):
            check_ase(batch.path, choice.written(units))
        tmp = stack.enter_context(new_output(output, force))
        if progress is not None and None not in (b.counted for b in batches):
            progress.reset(sum(b.counted for b in batches))
        images = _read_as_usual(_images(batches, stated, choice, chunk_atoms, keep, counts,
                                        progress))
        io = ioformats["db" if fmt == "aselmdb" else fmt]  # both through ase.db
        if io.single:
            images = iter([_only_one(output, fmt, images)])
        if fmt in _NEEDS_CELL:
            images = _with_cells(output, fmt, images)
        if fmt in ("extxyz", "xyz"):
            images = _comment_safe(output, fmt, images)
        if fmt == "traj":
            images = _told_what_traj_leaves_out(output, images)
        with _written_by_ase(output, fmt, tmp):
            if fmt in _DATABASES:
                with _plain(tmp, output) as plain:
                    _write_database(plain, fmt, images)
            elif io.single and not io.acceptsfd:
                with _plain(tmp, output) as plain:
                    write(plain, next(images), format=fmt)
            else:
                images = next(images) if io.single else (
                    images if fmt in _STREAMED else list(images))
                with _open(tmp, output, io.isbinary) as fd:
                    write(fd, images, format=fmt)
        choice.check(inputs)
    return tuple(counts)


@contextmanager
def _written_by_ase(output, fmt, tmp):
    """Run the block, in which ASE writes `output` in the format `fmt` into the temporary
    `tmp` (and files beside it named tmp...), with its failures as one DataError naming both:
    a file that reached the file-size limit or filled its disk, an exception of ASE's writer, a
    float operation that gives NaN or infinity (a cell of zeros inverted); ASE's warnings are
    not shown, segcli's Notes are. DataError, OSError naming a file and running out of memory
    pass as they are (those of reading the inputs among them); what the writer left beside
    `tmp` is removed."""
    try:
        with warnings.catch_warnings(), np.errstate(divide="raise", over="raise",
                                                    invalid="raise"):
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", Note)  # segcli's own, told as they come
            yield
    except DataError:
        raise
    except Exception as err:
        raise_if_interrupted()
        if (isinstance(err, OSError) and err.filename is not None) or memory_shortage(err):
            raise
        reason = _out_of_room(tmp)
        if reason is None and isinstance(err, OSError) and err.strerror:
            reason = err.strerror
        if reason is None:
            text = str(err).strip()
            reason = (f"ASE cannot write the format {fmt}: {type(err).__name__}"
                      f"{': ' if text else ''}{text.splitlines()[0] if text else ''}")
        raise DataError(f"{output}: {reason}") from err
    finally:
        for left in _beside(tmp):
            with suppress(FileNotFoundError):
                os.unlink(left)


def _beside(tmp):
    """The files named tmp... (an SQLite journal, a scratch file) that writers made beside the
    temporary `tmp`, not `tmp` itself."""
    directory, name = os.path.split(tmp)
    with suppress(OSError):
        return [os.path.join(directory, n) for n in os.listdir(directory or ".")
                if n.startswith(name[:-len(".tmp")]) and n != name]
    return []


_ROOM = 1 << 16
"""Bytes within which a file counts as having reached the file-size limit, or its disk as full."""


def _out_of_room(tmp):
    """Why the temporary `tmp`, or a file beside it, could not grow: it reached the file-size
    limit (RLIMIT_FSIZE), or its disk is full; None if neither."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    for path in [tmp, *_beside(tmp)]:
        with suppress(OSError):
            if limit != resource.RLIM_INFINITY and os.path.getsize(path) + _ROOM >= limit:
                return f"File too large: it reached the file size limit ({limit} bytes, ulimit -f)"
    with suppress(OSError):
        disk = os.statvfs(tmp)
        if disk.f_bavail * disk.f_frsize < _ROOM:
            return "No space left on device"
    return None


def _read_as_usual(images):
    """The structures `images`, each read under NumPy's float error handling of now (not the
    stricter one of _written_by_ase, which is for ASE's writer)."""
    errors = np.geterr()
    iterator = iter(images)
    while True:
        with np.errstate(**errors):
            atoms = next(iterator, None)
        if atoms is None:
            return
        yield atoms


@contextmanager
def _open(tmp, output, binary):
    """The temporary `tmp` opened for writing (text as UTF-8 unless `binary`), compressed as
    `output`'s suffix says (by the module of that compression: gzip, bz2 or lzma); a gzip
    stream names the file it holds as `output`'s, not the temporary's."""
    import importlib
    import io

    module = _compression(output)
    with open(tmp, "wb") as raw:
        if module == "gzip":
            import gzip

            stream = gzip.GzipFile(os.path.basename(output)[:-len(".gz")], "wb", fileobj=raw)
        elif module is not None:
            stream = importlib.import_module(module).open(raw, "wb")
        else:
            stream = raw
        with stream:
            if binary:
                yield stream
            else:
                with io.TextIOWrapper(stream, encoding="utf-8", write_through=True) as text:
                    yield text


@contextmanager
def _plain(tmp, output):
    """A path for a writer that takes only a file's name: `tmp` itself, or, where `output`'s
    suffix asks for compression, a scratch file beside it (see _beside) that is compressed
    into `tmp` when the block ends cleanly."""
    if _compression(output) is None:
        yield tmp
        return
    scratch = f"{tmp[:-len('.tmp')]}.plain.tmp"  # removed as tmp is after a kill
    yield scratch
    with open(scratch, "rb") as source, _open(tmp, output, binary=True) as target:
        shutil.copyfileobj(source, target, 1 << 20)


def _with_cells(output, fmt, images):
    """The structures `images`, DataError for one without a cell of three vectors."""
    for number, atoms in enumerate(images):
        if atoms.cell.rank < 3:
            raise DataError(f"{output}: the format {fmt} holds only structures with a cell of "
                            f"three vectors; structure {number} (counting those written) has "
                            f"{atoms.cell.rank}")
        yield atoms


_SPECIAL_KEYS = frozenset({"Lattice", "Properties", "pbc"})
"""Keys of the comment line that ASE writes itself (not from info)."""
_MATRIX_KEYS = frozenset({"virial", "stress"})
"""Info keys that ASE's extended XYZ writes and reads as 3x3 matrices (SPECIAL_3_3_KEYS)."""


@functools.lru_cache(maxsize=4096)
def _reads_back(key, value):
    """Whether the comment line of extended XYZ that ASE writes for info `key`=`value` (a
    string; "x" for a key of another value) reads back as that alone: not a value that
    reads as a number or a boolean ("1.5", "T"), empty, or holding a tab, a newline or a
    backslash, nor a key holding a space or "=", all of which ASE writes unquoted."""
    from ase.io.extxyz import key_val_dict_to_str, key_val_str_to_dict

    try:
        back = key_val_str_to_dict(key_val_dict_to_str({key: value}))
    except Exception:  # noqa: BLE001 - what ASE cannot parse does not read back
        return False
    return list(back) == [key] and isinstance(back[key], str) and back[key] == value


_TRAJ_ARRAYS = frozenset({"numbers", "positions", "masses", "tags", "momenta",
                          "initial_magmoms", "initial_charges"})
"""The per-atom arrays of an Atoms that ASE's trajectory writes (ase.io.trajectory)."""


def _told_what_traj_leaves_out(output, images):
    """The structures `images`, each per-atom field that ASE's trajectory does not write told
    once, as a segcli.errors.Note: a field left out is said, never lost unseen."""
    told = set()
    for atoms in images:
        for key in sorted(set(atoms.arrays).difference(_TRAJ_ARRAYS, told)):
            told.add(key)
            warnings.warn(f"{output}: ASE's trajectory holds no per-atom field {key!r}: it is "
                          "left out (write .h5, .db or .extxyz to keep it, or --drop it)",
                          Note, stacklevel=2)
        yield atoms


def _comment_safe(output, fmt, images):
    """The structures `images`, DataError for one whose per-structure info ASE would write
    to the comment line of (extended) XYZ so that it reads back otherwise (a string value
    lost or turned into a number, another key invented, the next key swallowed), or whose
    per-atom field has a name that the Properties of the format cannot hold."""
    for number, atoms in enumerate(images):
        for key, value in atoms.info.items():
            if isinstance(value, str):
                fine = key not in _SPECIAL_KEYS | _MATRIX_KEYS and _reads_back(key, value)
            elif key in _MATRIX_KEYS:
                fine = np.shape(value) == (3, 3)  # read back as 3x3, or not at all
            else:
                fine = key in _SPECIAL_KEYS or _reads_back(key, "x")
            if not fine:
                why = (f"its value {value!r} would read back otherwise"
                       if isinstance(value, str) else
                       f"ASE reads it back only as a 3x3 matrix, not {np.shape(value)}"
                       if key in _MATRIX_KEYS else "its name would read back otherwise")
                raise DataError(f"{output}: the format {fmt} cannot hold field {key!r} of "
                                f"structure {number} (counting those written): {why}; write "
                                "it to .h5, .traj or .db, or --drop it")
        for key in atoms.arrays:
            if not key or any(c.isspace() or c in ':="\\' for c in key):
                raise DataError(f"{output}: the format {fmt} cannot hold per-atom field "
                                f"{key!r} (of structure {number}, counting those written) in "
                                "its Properties; --rename it or --drop it")
        yield atoms


def _only_one(output, fmt, images):
    first = next(images, None)
    if first is None or next(images, None) is not None:
        raise DataError(f"{output}: the format {fmt} holds one structure; give one "
                        "(e.g. select --structures I:I+1)")
    return first


def _write_database(path, fmt, images):
    """The structures `images` as the rows of a new ASE database `path` of the type `fmt`."""
    import ase.db

    if fmt == "json":
        _write_json(path, _rows(images))
        return
    options = {"serial": True}
    if fmt == "aselmdb":
        from segcli.io.asedb import lmdb_backend

        lmdb_backend(path)
        options = {}
    with ase.db.connect(path, type=fmt, append=False, **options) as db:
        for atoms, pairs, data in _rows(images, sqlite=fmt == "db"):
            db.write(atoms, key_value_pairs=pairs, data=data)


_ROW_ARRAYS = frozenset({"numbers", "positions", "initial_magmoms", "initial_charges", "masses",
                         "tags", "momenta"})
"""The per-atom arrays an ASE database row holds (ase.db.row.atoms2dict): others go to data."""
_SQLITE_RESULTS = frozenset({"energy", "free_energy", "forces", "stress", "dipole", "magmoms",
                             "magmom", "charges"})
"""The calculator results ASE's SQLite backend has columns for: the others (per-atom
`energies`, `stresses`, ...) go to data, where it keeps them."""


def _rows(images, sqlite=False):
    """(atoms, key-value pairs, data) of each structure as a database row holds it: its info's
    scalars under names a database allows as key-value pairs, the rest of its info as data;
    `id` and `unique_id` (a database's own, of the rows read) left out: the new database
    numbers its rows itself. Per-atom arrays that a row does not hold (and, with `sqlite`,
    calculator results that ASE's SQLite backend drops) go to data too, which segcli reads
    back per atom."""
    from ase.db.core import reserved_keys

    for atoms in images:
        pairs, data = {}, {}
        for key in [k for k in atoms.arrays if k not in _ROW_ARRAYS]:
            data[key] = atoms.arrays.pop(key)
        if sqlite and atoms.calc is not None:
            for key in [k for k in atoms.calc.results if k not in _SQLITE_RESULTS]:
                data[key] = atoms.calc.results.pop(key)
        for key, value in atoms.info.items():
            if key in ("id", "unique_id"):
                continue
            value = value.item() if isinstance(value, np.generic) else value
            scalar = isinstance(value, (str, bool, int, float))
            if scalar and key not in reserved_keys and key.isidentifier():
                pairs[key] = value
            else:
                data[key] = value
        atoms.info = {}
        yield atoms, pairs, data


def _write_json(path, rows):
    """The rows as ASE's JSON database `path`, written one after another (ASE's own writer
    reads and rewrites the whole file for each row: time quadratic in the rows), each as ASE
    encodes it."""
    import io

    from ase.db.jsondb import JSONDatabase

    count = 0
    with open(path, "w") as out:
        out.write("{")
        for atoms, pairs, data in rows:
            alone = io.StringIO()  # ASE's file of this one row: {"1": {...},\n"ids": ...}
            JSONDatabase(alone, serial=True).write(atoms, key_value_pairs=pairs, data=data)
            text = alone.getvalue()
            count += 1
            out.write(f'"{count}": ' + text[len('{"1": '):text.rindex('"ids": ')])
        out.write(f'"ids": {list(range(1, count + 1))},\n"nextid": {count + 1}}}\n')


def _images(batches, stated, choice, chunk_atoms, keep, counts, progress):
    """Each structure of the batches that `keep` (None: all) marks, as an ase.Atoms (fields
    converted from the units `stated` of each batch as `choice` says), counted into `counts`
    (structures, atoms); `progress` counts every structure read."""
    index = 0
    for batch, units in zip(batches, stated):
        first = index
        for group in batch.stream(chunk_atoms, choice.keep):
            for atoms, structure, n in _each_structure(choice.apply(batch.path, group, units)):
                if keep is None or keep[index]:
                    _check_elements(batch.path, index - first, atoms.get("numbers"))
                    yield _atoms(atoms, structure, n)
                    counts[0] += 1
                    counts[1] += n
                index += 1
                if progress is not None:
                    progress.update(1)


def _each_structure(chunks):
    """(per-atom values, per-structure values, n_atoms) of each structure of the Chunks, with
    the fields that the structure has (name -> its rows, or its value)."""
    for chunk in chunks:
        ends = np.cumsum(chunk.n_atoms)
        for s, (n, end) in enumerate(zip(chunk.n_atoms.tolist(), ends.tolist())):
            absent = {k for k, mask in chunk.present.items() if not mask[s]}
            yield ({k: v[end - n:end] for k, v in chunk.atoms.items() if k not in absent},
                   {k: v[s] for k, v in chunk.structures.items() if k not in absent}, n)


def structure_atoms(path, number, chunk):
    """The first structure of `chunk` (structure `number` of `path`) as an ase.Atoms, as an
    export writes it."""
    per_atom, per_structure, n = next(_each_structure([chunk]))
    _check_elements(path, number, per_atom.get("numbers"))
    return _atoms(per_atom, per_structure, n)


def _constraints(per_atom):
    """The ASE constraints that boolean `fixed` and `fixed_cartesian` fields (see
    asefiles.constraint_fields) hold, popped from `per_atom`."""
    from ase.constraints import FixAtoms, FixCartesian

    constraints = []
    if per_atom.get("fixed", np.zeros(0)).dtype == bool:
        fixed = per_atom.pop("fixed")
        if fixed.any():
            constraints.append(FixAtoms(mask=fixed))
    if per_atom.get("fixed_cartesian", np.zeros(0)).dtype == bool:
        fixed = per_atom.pop("fixed_cartesian")
        constraints.extend(FixCartesian(np.flatnonzero((fixed == mask).all(axis=1)), mask)
                           for mask in np.unique(fixed[fixed.any(axis=1)], axis=0))
    return constraints


def _check_elements(path, number, numbers):
    """DataError unless the atomic numbers `numbers` (of structure `number` of `path`; None:
    none) are those of elements (a negative one would index ASE's symbols from the end)."""
    if numbers is not None and len(numbers) and not are_elements(numbers):
        raise not_an_element(path, numbers[np.argmin((numbers >= 0) & (numbers < N_ELEMENTS))],
                             number)


def _atoms(per_atom, per_structure, n):
    """An ase.Atoms of n atoms from one structure's field values (name -> array)."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.outputs import all_outputs

    per_atom, per_structure = dict(per_atom), dict(per_structure)
    atoms = Atoms(numbers=per_atom.pop("numbers", np.zeros(n, int)),
                  positions=per_atom.pop("positions", None),
                  cell=per_structure.pop("cell", None), pbc=per_structure.pop("pbc", None))
    atoms.set_constraint(_constraints(per_atom))
    results = {}
    for per, values in (("atom", per_atom), ("structure", per_structure)):
        for name, value in values.items():
            prop = all_outputs.get(name)
            if prop is not None and (prop.shapespec[:1] == ("natoms",)) == (per == "atom"):
                results[name] = value
            elif per == "atom":
                atoms.set_array(name, value)
            else:
                atoms.info[name] = value if isinstance(value, str) else value[()]
    if results:
        atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms
