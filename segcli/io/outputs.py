"""Output files that appear whole or not at all: a temporary file beside the target, renamed
over it only when all went well (a failure or a kill leaves no partial output and an intact
input), the lock that keeps other writers of the same file waiting, and the room a write
needs, checked before it is made.

    with new_output("out.h5", force=False) as tmp:
        write(tmp)  # out.h5 appears, whole, when the block ends without an error
"""

import errno
import fcntl
import hashlib
import os
import resource
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager, suppress

import numpy as np

from segcli.errors import DataError, hold_signals, raise_if_interrupted, release_signals
from segcli.fields import STRING

ROOM_MARGIN = 1 << 20
"""Bytes kept free beyond each write for HDF5's own records."""


def refuse_overwrite(path, force):
    """DataError if `path` (or the file a symbolic link `path` points to) exists, unless
    `force` and it is a regular file (the only kind of file an output replaces)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # the writer names where it cannot write
        return
    if not force:
        raise DataError(f"{path}: already exists; use --force to overwrite it")
    if not stat.S_ISREG(mode):
        raise DataError(f"{path}: not a regular file; an output replaces only regular files")


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host():
    """This machine's name as temporaries carry it (no dots, so that names split at dots)."""
    return socket.gethostname().replace(".", "-")


_TARGETS = {}
"""The output that each live temporary of atomic_output stands for."""
_LONG_NAME = 160
"""Bytes of an output's name beyond which its temporaries carry a shortened one: the
temporary's name adds up to 90 (pid, host, random part) and may have 255 in all."""


def _temporary_prefix(target):
    """`.NAME.`, the start of the names of `target`'s temporaries: NAME its name, or for a long
    one its first 120 bytes and a digest of the whole."""
    name = os.fsencode(os.path.basename(target))
    if len(name) > _LONG_NAME:
        name = name[:120] + b"~" + hashlib.sha256(name).hexdigest()[:16].encode()
    return f".{os.fsdecode(name)}."


def _sweep(directory, prefix, suffix=".tmp"):
    """Remove the temporaries (files or directories) `prefix`PID@HOST.*`suffix` in `directory`
    that a run of this host left when it was killed (its process is gone)."""
    host = _host()
    with suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith(prefix) and name.endswith(suffix)):
                continue
            pid, _, where = name[len(prefix):].partition(".")[0].partition("@")
            if where != host or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                path = os.path.join(directory, name)
                with suppress(OSError):
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
            except OSError:
                pass


_SCRATCH_PREFIX = ".segcli-parts-"


@contextmanager
def scratch_directory(directory):
    """A new directory in `directory` (.segcli-parts-PID@HOST.*), removed with what it holds
    when the block ends however it ends; the ones that killed runs of this host left there are
    removed first."""
    _sweep(directory, _SCRATCH_PREFIX, suffix="")
    path = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}@{_host()}.", dir=directory)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_output(target, copy_of=None, replace=True):
    """A temporary path beside `target` (a copy of `copy_of` if given), which becomes `target`
    when the block ends cleanly and is removed when it fails or is interrupted. With
    `replace` False, a `target` that appeared meanwhile is never replaced (DataError). A copy
    replacing its original is synced to disk first, so that even a system crash leaves one
    of the two whole. Temporaries of killed runs are removed first.

    A symbolic link `target` stays one: the file it points to is written. The block holds
    `target`'s lock (see `locked`), so that writers of one file, through whichever name,
    take turns."""
    with locked(target), _atomic_output(os.path.realpath(target), target, copy_of,
                                        replace) as tmp:
        yield tmp


@contextmanager
def _atomic_output(real, target, copy_of, replace):
    """atomic_output of the file `real`, which the user calls `target`."""
    directory = os.path.dirname(real)
    prefix = _temporary_prefix(real)
    _sweep(directory, prefix)
    hold_signals()  # until the `try` that removes the temporary is entered
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp",
                                   prefix=f"{prefix}{os.getpid()}@{_host()}.")
    except OSError as err:
        release_signals(pending=False)
        raise DataError(f"{target}: cannot write there ({err.strerror})") from err
    held = True
    _TARGETS[tmp] = target
    try:
        os.close(fd)
        held = False
        release_signals()
        if copy_of is None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        else:
            try:
                shutil.copyfile(copy_of, tmp)
            except OSError as err:
                raise DataError(f"{target}: cannot copy it to write into it "
                                f"({err.strerror})") from err
            shutil.copymode(copy_of, tmp)
        ensure_room(tmp, 0)
        yield tmp
        raise_if_interrupted()
        if copy_of is not None:
            _fsync(tmp)
        if replace:
            os.replace(tmp, real)
        else:
            _link(tmp, real, target)
        if copy_of is not None:
            _fsync(directory)
    except BaseException:
        if held:
            release_signals(pending=False)
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _TARGETS.pop(tmp, None)


def target_of(tmp):
    """The output a temporary of atomic_output stands for."""
    return _TARGETS.get(tmp, tmp)


def ensure_room(h5, data):
    """DataError unless the HDF5 file `h5` (open, or a path) can grow by what writing `data`
    (an array, or a byte count) takes, and a margin: within the file-size limit
    (RLIMIT_FSIZE) and the free space of its disk. Called before each write, since HDF5
    cannot recover from a failed one (its library crashes)."""
    if isinstance(data, np.ndarray):
        data = data.nbytes if data.dtype != STRING else sum(len(str(v)) + 16 for v in data.flat)
    path = getattr(h5, "filename", h5)
    need = os.path.getsize(path) + int(data) + ROOM_MARGIN
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and need > limit:
        raise DataError(f"{target_of(path)}: File too large: writing it needs {need} bytes, "
                        f"more than the file size limit ({limit} bytes, ulimit -f)")
    disk = os.statvfs(path)
    free = disk.f_bavail * disk.f_frsize
    if int(data) + ROOM_MARGIN > free:
        raise DataError(f"{target_of(path)}: No space left on device: {free} bytes free, "
                        f"{int(data) + ROOM_MARGIN} needed")


def _link(tmp, real, target):
    """Give `tmp` the name `real` unless that exists (DataError naming `target`), then drop the
    name `tmp`."""
    try:
        os.link(tmp, real)
    except FileExistsError:
        raise DataError(f"{target}: already exists (made while this run worked); use --force "
                        "to overwrite it") from None
    os.unlink(tmp)


@contextmanager
def new_output(target, force=False):
    """A temporary path for the new file `target` (see atomic_output): an existing `target` is
    refused unless `force` (see refuse_overwrite), and without `force` never replaced."""
    refuse_overwrite(target, force)
    with atomic_output(target, replace=force) as tmp:
        yield tmp


_LOCKS = {}
"""The locks this process holds: the real path of each locked file -> times entered."""


@contextmanager
def locked(path):
    """Hold an exclusive lock for writing the file `path` while the block runs, waiting for
    other writers first. The lock belongs to the file a symbolic link points to, and a process
    may take it again while it holds it. It is taken on `.NAME.lock` beside that file (HDF5
    takes locks of its own on the file itself), which the holder removes; a waiter that then
    holds a removed lock file locks anew."""
    real = os.path.realpath(path)
    if real in _LOCKS:
        _LOCKS[real] += 1
        try:
            yield
        finally:
            _LOCKS[real] -= 1
        return
    lock = os.path.join(os.path.dirname(real), _temporary_prefix(real) + "lock")
    while True:
        hold_signals()  # until the `try` that closes the file is entered
        try:
            fd = _open_lock(path, lock)
        except DataError:
            release_signals(pending=False)
            raise
        try:
            release_signals()
            fcntl.flock(fd, fcntl.LOCK_EX)
            with suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.lstat(lock).st_ino:
                    break
        except BaseException:
            _abandon(fd, lock)
            raise
        os.close(fd)
    _LOCKS[real] = 1
    try:
        yield
    finally:
        del _LOCKS[real]
        with suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def _open_lock(path, lock):
    """The lock file `lock` of `path` opened (made if missing), never through a symbolic link
    nor as anything but a regular file: one planted there is refused (DataError), not
    followed."""
    why = "cannot lock it for writing"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DataError(f"{path}: {why}: {lock} is a symbolic link, which segcli's lock "
                            "file never is; remove it") from err
        if os.path.lexists(lock):
            raise DataError(f"{path}: {why} ({lock}: {err.strerror})") from err
        raise DataError(f"{path}: cannot write there ({err.strerror})") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{path}: {why}: {lock} is not a regular file, which segcli's lock "
                        "file always is; remove it")
    return fd


def _abandon(fd, lock):
    """Close the lock file `lock` (open as `fd`) that a waiter gives up, removing it if no
    other run holds it (so that a waiter interrupted after making it leaves nothing)."""
    with suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == os.lstat(lock).st_ino:
            os.unlink(lock)
    os.close(fd)
