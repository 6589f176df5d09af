"""Many files read as one batch: a directory, a glob pattern or an @LIST given as FILE.

    with open_inputs("shards/*.h5") as batch:  # or "shards/", "@list.txt", ["a.h5", "b.xyz"]
        batch.sources, batch.source_of(slice(0, 10))

A batch of many files is described once (`batch.layout`, small and picklable) and can be
opened again from that description in another process without reading its files first.
"""

import glob
import os
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError
from segcli.io.core import (
    Batch,
    Schema,
    check_readable,
    file_stamp,
    fill_value,
    missing,
    open_for_reading,
    standard_input,
)
from segcli.memory import offsets_of


class Layout(NamedTuple):
    """What a batch of files holds, enough to open it again without reading them: the member
    paths as given (`sources`, relative ones to `directory`), each member's format, n_atoms,
    field names (stored fields and results) and presence masks of the fields it has for some
    of its structures only; the merged stored fields and results (name -> FieldInfo) and the
    attributes of the stored results; the format forced on them, if any; the names that
    members hold in ways that do not merge, with why (`conflicts`, see Fields); and each
    member's `stamp` (see Batch.stamp) when its n_atoms were read."""

    name: str
    directory: str
    sources: tuple
    formats: tuple
    n_atoms: tuple
    fields: tuple
    present: tuple
    stored: dict
    result_fields: dict
    results: dict
    input_format: str = None  # the format forced on every member (see open_batch)
    conflicts: tuple = ()  # ((name, why), ...)
    stamps: tuple = ()

    def __reduce__(self):
        """Pickled (a cluster sends the layout to every worker) with each member's n_atoms in
        the narrowest unsigned integer type that holds them, int64 again once loaded."""
        narrow = tuple(np.asarray(n, np.min_scalar_type(int(n.max()) if len(n) else 0))
                       for n in self.n_atoms)
        return _loaded_layout, (tuple(self._replace(n_atoms=narrow)),)

    def path(self, member):
        """The path that opens member `member`, wherever the current directory is."""
        return os.path.join(self.directory, self.sources[member])

    def open(self, member):
        """Member `member` opened again (see open_batch), given its n_atoms where the file is
        unchanged since they were read (its stamp): a reader that can then skips reading and
        checking them again."""
        from segcli.io import open_batch

        path = self.path(member)
        stamp = self.stamps[member] if member < len(self.stamps) else None
        known = stamp is not None and stamp == file_stamp(path)
        return open_batch(path, self.input_format,
                          counts=self.n_atoms[member] if known else None)


def _loaded_layout(fields):
    """The Layout of pickled `fields` (see Layout.__reduce__)."""
    layout = Layout(*fields)
    return layout._replace(n_atoms=tuple(n.astype(np.int64) for n in layout.n_atoms))


def member_layout(batch, name=None):
    """The Layout of one opened batch (`name`: what messages call it, default its path)."""
    names = set(batch._stored) | set(batch._result_fields)
    present = {n: batch._present(n) for n in batch._stored}
    return Layout(name or batch.path, os.getcwd(), (batch.path,), (batch.format,),
                  (np.asarray(batch.n_atoms, np.int64),), (frozenset(names),),
                  ({n: m for n, m in present.items() if m is not None},),
                  dict(batch._stored), dict(batch._result_fields), dict(batch.results),
                  batch.input_format, stamps=(batch.stamp,))


def _join(layouts, name):
    """One Layout of the members of `layouts`, in order. A name that members hold in ways that
    do not merge (per, shape, strings or numbers, units) is no field of the batch: its
    conflict names the first two such members, and the other fields stay usable."""
    stored, result_fields, results, conflicts, first = Schema(), Schema(), {}, {}, {}
    for layout in layouts:
        source = layout.sources[0]
        for info in layout.stored.values():
            if info.name in conflicts:
                continue
            try:
                stored.add(source, info, 0)
            except DataError:
                known = stored.pop(info.name)
                conflicts[info.name] = (
                    f"field '{info.name}' is {_described(info)} in {source} but "
                    f"{_described(known)} in {first[info.name]}, so the batch has no such "
                    f"field (`segcli convert --rename {info.name}=NEW` renames it in one)")
            first.setdefault(info.name, source)
    for layout in layouts:
        for info in layout.result_fields.values():
            if info.name not in stored and info.name not in conflicts:
                result_fields.add(layout.sources[0], info, 0, result=True)
        results = {**layout.results, **results}
    parts = zip(*(layout[2:7] for layout in layouts))
    return Layout(name, os.getcwd(), *(sum(part, ()) for part in parts), dict(stored),
                  dict(result_fields), results, conflicts=tuple(conflicts.items()),
                  stamps=sum((layout.stamps for layout in layouts), ()))


def _described(info):
    """A field's kind, as a conflict states it: per atom, shape (3,), float64, in eV."""
    units = f", in {info.units}" if info.units else ""
    return f"per {info.per}, shape {tuple(info.shape)}, {np.dtype(info.dtype)}{units}"


def _listed(spec):
    """The paths an @LIST names (`@-`: stdin), relative ones to the list's directory; blank lines
    and `#` comments skipped."""
    where = spec[1:]
    if where == "-":
        lines, directory = standard_input().read().splitlines(), ""
    else:
        try:
            with open_for_reading(where) as listing:
                lines = listing.read().decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or "not a text file"
            raise DataError(f"{where}: cannot read the list of files ({reason})") from err
        directory = os.path.dirname(where)
    paths = [line.strip() for line in lines]
    paths = [os.path.join(directory, p) for p in paths if p and not p.startswith("#")]
    if not paths:
        raise DataError(f"{'stdin' if where == '-' else where}: lists no file")
    return paths


def _directory(path, skipped=None):
    """The regular, non-hidden files of a directory that segcli reads, in sorted name order;
    the others appended to the list `skipped`, if given."""
    from segcli.io import reads

    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        raise DataError(f"{path}: cannot list the directory ({err.strerror})") from err
    if not os.access(path, os.X_OK):  # its files cannot be reached
        raise DataError(f"{path}: cannot list the directory (Permission denied)")
    members = []
    for name in names:
        member = os.path.join(path, name)
        if name.startswith(".") or not os.path.isfile(member):
            continue
        check_readable(member)
        if reads(member):
            members.append(member)
        elif skipped is not None:
            skipped.append(member)
    if not members:
        raise DataError(f"{path}: directory without a file that segcli reads")
    return members


def _spooled(source, name, shown):
    """The path of a temporary copy of binary stream `source`, at `name` (a relative or
    absolute path) under a new temporary directory that is removed at exit: what a stream as
    FILE stands for, since readers need to seek. Messages call the copy `shown` (see
    segcli.errors.for_user), and ASE sees its file name."""
    import atexit
    import shutil
    import tempfile

    from segcli.errors import hold_signals, name_for_user, release_signals

    hold_signals()
    try:
        directory = tempfile.mkdtemp(prefix="segcli-spool-")
        atexit.register(shutil.rmtree, directory, True)
    finally:
        release_signals()
    path = os.path.join(directory, name.lstrip(os.sep))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    name_for_user(path, shown)
    try:
        with open(path, "wb") as spool:
            shutil.copyfileobj(source, spool, 1 << 20)
    except OSError as err:
        raise DataError(f"{shown}: cannot copy it to a temporary file in {directory}, which a "
                        f"stream is read through ({err.strerror}; TMPDIR chooses where)") from err
    return path


def _spooled_stdin():
    """The path of a temporary copy of stdin, read as extxyz (see _spooled): what `-` as FILE
    stands for. DataError for a terminal or nothing."""
    if standard_input().isatty():
        raise DataError("-: reads extxyz from stdin, which is a terminal (pipe a file into it)")
    path = _spooled(standard_input().buffer, "stdin.extxyz", "-")
    if not os.path.getsize(path):
        raise DataError("-: stdin holds no structure (it is empty)")
    return path


def is_stream(spec):
    """Whether FILE `spec` is read through a temporary copy (see _spooled): `-` (stdin), a pipe
    or FIFO (`<(cat a.extxyz)`), or a file that stat calls empty but has content (/proc/...)."""
    import stat

    if spec == "-":
        return True
    try:
        mode = os.stat(spec).st_mode
        if stat.S_ISFIFO(mode):
            return True
        if not stat.S_ISREG(mode) or os.path.getsize(spec):
            return False
        with open(spec, "rb") as file:
            return bool(file.read(1))
    except OSError:
        return False


def _seekable(path):
    """`path`, or a temporary copy of it where it is a stream (see is_stream), read once."""
    if not is_stream(path):
        return path
    try:
        stream = open_for_reading(path)
    except OSError:
        return path  # open_batch names what is wrong
    with stream:
        return _spooled(stream, os.path.abspath(path), path)


def _expand(spec, skipped):
    """The paths one FILE stands for (see expand_inputs)."""
    if not spec:
        raise DataError("'': an empty name names no file")
    if spec == "-":
        return [_spooled_stdin()]
    if os.path.isdir(spec):
        return _directory(spec, skipped)
    if os.path.lexists(spec):
        return [_seekable(spec)]
    if spec.startswith("@"):
        paths = _listed(spec)
    elif glob.has_magic(spec):
        paths = sorted(glob.glob(spec))
        if not paths:
            raise DataError(f"{spec}: no file matches the pattern")
    else:
        raise DataError(f"{spec}: {missing(spec)}")
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += _directory(path, skipped)
        elif not os.path.lexists(path):
            raise DataError(f"{path}: {missing(path)} ({spec} names it)")
        else:
            out.append(_seekable(path))
    return out


def expand_inputs(spec, skipped=None):
    """The files that FILE `spec` (a str, or a sequence of them, each expanded) stands for, in
    order: an existing file itself; a directory's regular, non-hidden files that segcli reads,
    in sorted name order (the others appended to the list `skipped`, if given: where every
    file must count, as parts do); a glob pattern's matches, sorted; @LIST's lines (`@-`:
    stdin's); `-`: extxyz on stdin (spooled to a temporary file).
    A directory among a pattern's or list's paths stands for its files. DataError naming a
    member that is missing or unreadable, or a pattern, list or directory that names none."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if sum(os.fspath(s) in ("-", "@-") for s in specs) > 1:
        raise DataError("-: stdin is given more than once (as - or @-); it can be read once")
    paths = [path for s in specs for path in _expand(os.fspath(s), skipped)]
    if len(paths) > 1:
        for path in paths:
            check_readable(path)
    return paths


def open_inputs(spec, name=None, input_format=None):
    """A Batch of the files `spec` stands for (see expand_inputs), or of a Layout: one file's own
    batch (see open_batch), else a MultiBatch. `name`: what messages call many files
    (default: `spec`); `input_format`: the format forced on every file (see open_batch)."""
    from segcli.io import open_batch

    if isinstance(spec, Layout):
        return spec.open(0) if len(spec.sources) == 1 else MultiBatch(spec)
    paths = expand_inputs(spec)
    if len(paths) == 1:
        return open_batch(paths[0], input_format)
    if name is None:
        name = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else \
            ", ".join(map(os.fspath, spec))
    return MultiBatch.scan(paths, name, input_format)


class MultiBatch(Batch):
    """Files read in order as one batch: structure numbers run across them, their fields merge
    (dtypes promote; per and shape must agree) and a field that some files lack is filled
    there (NaN for floats, 0 for integers and booleans, "" for strings) and not present.

    Built from a Layout; a member file is opened only while structures of it are read."""

    format = "multi"
    _states_units = True

    def __init__(self, layout):
        super().__init__(layout.name)
        self.stamp = None  # its files have theirs (see _pieces); `name` may be a directory's
        self._layout = layout
        counts = [len(n) for n in layout.n_atoms]
        self._first = offsets_of(counts)
        self.n_atoms = np.concatenate(layout.n_atoms)
        self._stored = layout.stored
        self._result_fields = layout.result_fields
        self._conflicts = dict(layout.conflicts)
        self._open = []

    @classmethod
    def scan(cls, paths, name, input_format=None):
        """Open each file once (in `input_format`, if given), to learn its structures and
        fields."""
        from segcli.io import open_batch

        layouts = []
        for path in paths:
            with open_batch(path, input_format) as batch:
                layouts.append(member_layout(batch))
        return cls(_join(layouts, name)._replace(input_format=input_format))

    @property
    def layout(self):
        return self._layout

    @property
    def sources(self):
        return list(self._layout.sources)

    def source_of(self, structures):
        start, stop, _ = structures.indices(self.n_structures)
        index = np.arange(start, stop, dtype=np.int64)
        source = np.searchsorted(self._first[:-1], index, side="right") - 1
        return source.astype(np.int32), index - self._first[source]

    @property
    def members(self):
        """Per file: its path, format, structures and atoms."""
        return [{"path": path, "format": fmt, "structures": len(n), "atoms": int(n.sum())}
                for path, fmt, n in zip(self._layout.sources, self._layout.formats,
                                        self._layout.n_atoms)]

    @property
    def results(self):
        return self._layout.results

    def close(self):
        while self._open:
            self._open.pop().close()

    def _present(self, name):
        parts = []
        for names, present, n_atoms in zip(self._layout.fields, self._layout.present,
                                           self._layout.n_atoms):
            mask = present.get(name)
            parts.append(np.full(len(n_atoms), name in names) if mask is None else mask)
        have = np.concatenate(parts) if parts else np.ones(0, bool)
        return None if have.all() else have

    def fill_value(self, name):
        info = self.fields[name]
        return None if self.present(name) is None else fill_value(info.dtype, np.nan)

    def _pieces(self, start, stop, names, chunk_atoms, into=None, bounds=None):
        stop = self.n_structures if stop is None else stop
        names = list(self._stored) if names is None else names
        for member, (first, end) in enumerate(zip(self._first[:-1], self._first[1:])):
            lo, hi = max(start, first), min(stop, end)
            if lo >= hi:
                continue
            has = self._layout.fields[member]
            batch = self._layout.open(member)
            self._open.append(batch)
            try:
                if not np.array_equal(batch.n_atoms, self._layout.n_atoms[member]):
                    raise DataError(f"{batch.path}: changed while this run read it (its "
                                    "structures differ); run again once it stays as it is")
                inside = None if bounds is None else np.unique(np.clip(bounds, lo, hi)) - first
                for piece in batch.unchanged(batch._pieces(
                        int(lo - first), int(hi - first), [n for n in names if n in has],
                        chunk_atoms, into, inside)):
                    yield self._completed(member, piece, names)
            finally:
                if batch in self._open:
                    self._open.remove(batch)
                    batch.close()

    def _completed(self, member, piece, names):
        """A member's piece numbered in the batch, with the fields that its file lacks filled
        (those that only some of its structures have are filled where pieces merge, see
        Batch._chunks, or not: convert without --fill-missing refuses them)."""
        atoms, structures = dict(piece.atoms), dict(piece.structures)
        present = dict(piece.present)
        fields = self.fields
        for name in names:
            data = atoms if fields[name].per == "atom" else structures
            if name in data or name in self._layout.fields[member]:
                continue
            info = fields[name]
            rows = int(piece.n_atoms.sum()) if info.per == "atom" else len(piece.n_atoms)
            data[name] = np.full((rows, *info.shape), fill_value(info.dtype, np.nan), info.dtype)
            present[name] = np.zeros(len(piece.n_atoms), bool)
        return piece._replace(start=int(self._first[member]) + piece.start, atoms=atoms,
                              structures=structures, present=present)
