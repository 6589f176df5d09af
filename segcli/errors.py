"""Errors that reach the user as one or two lines and an exit code, never a traceback."""

import builtins
import signal
import string
import sys
import threading
from contextlib import contextmanager

_user_names = {}
"""A temporary copy's path -> what the user called the stream it copies (see for_user)."""


def name_for_user(path, name):
    """Have messages call the temporary copy `path` by `name` (`-` for stdin, a FIFO's path)."""
    _user_names[path] = name


def for_user(text):
    """`text` with each temporary copy's path replaced by the name the user gave its stream."""
    for path, name in _user_names.items():
        text = text.replace(path, name)
    return text


class DataError(Exception):
    """The data is wrong: a bad file, a missing field, bad values. Exit code 1. Its message
    names a stream copied to a temporary file as the user did (see for_user)."""

    exit_code = 1

    def __init__(self, *args):
        super().__init__(*(for_user(arg) if isinstance(arg, str) else arg for arg in args))


def literal(text):
    """`text` (a path, a value) as it stands in an ArgumentError's template."""
    return str(text).replace("{", "{{").replace("}", "}}")


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind, cleaning up, and exit with 128 + the signal number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


_received = []
_held = [0]
_deferred = []  # signals that arrived while held, not raised since


def _interrupt(signum, frame):
    _received.append(signum)
    if not _held[0]:
        raise Interrupted(signum)
    _deferred.append(signum)


def hold_signals():
    """Defer Interrupted until release_signals(): for the few steps that create something
    and enter the `try` that removes it."""
    _held[0] += 1


def release_signals(pending=True):
    """End a hold_signals(); raise Interrupted for a signal that arrived meanwhile, unless
    `pending` is False (the caller is unwinding already)."""
    _held[0] -= 1
    if not _held[0]:
        _deferred.clear()
    if pending and not _held[0]:
        raise_if_interrupted()


def _whole_imports(original):
    """`original` (builtins.__import__) holding signals in the main thread until the module is
    loaded, then raising Interrupted for one that arrived meanwhile: an import broken off
    halfway leaves its package half made (a later import of it fails, or a library that
    catches every exception around an optional import goes on without it), as the lazy
    imports of a command may run after its output exists."""
    main = threading.main_thread().ident

    def whole_import(*args, **kwargs):
        if threading.get_ident() != main:
            return original(*args, **kwargs)
        _held[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _held[0] -= 1
            if not _held[0] and _deferred:
                signum = _deferred[0]
                _deferred.clear()
                raise Interrupted(signum)

    return whole_import


def _unraisable(report, default=sys.unraisablehook):
    """Say nothing of an Interrupted raised where Python cannot pass it on (a weakref or C
    library callback): raise_if_interrupted raises it again."""
    if not issubclass(report.exc_type, Interrupted):
        default(report)


@contextmanager
def interruptible():
    """While the block runs, SIGINT and SIGTERM raise Interrupted in the main thread (so that
    `finally` blocks remove temporary files), after any import in progress there (see
    _whole_imports), and a file-size limit gives an OSError rather than a kill; the previous
    handlers are back afterwards. Elsewhere than in the main thread, which alone can set
    handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)
    previous, hook = {s: signal.getsignal(s) for s in signals}, sys.unraisablehook
    importer = builtins.__import__
    _received.clear()
    _deferred.clear()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.unraisablehook = _unraisable
    builtins.__import__ = _whole_imports(importer)
    try:
        yield
    finally:
        builtins.__import__ = importer
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = hook


def interrupting_signal():
    """The first signal that arrived while interruptible() ran, or None: an exception that
    follows one may be how a library (h5py's conversions, say) passed on the Interrupted that
    its Python callback raised."""
    return _received[0] if _received else None


_SHORTAGE_SIGNS = ("RESOURCE_EXHAUSTED", "failed to map segment", "Cannot allocate memory",
                   "cannot allocate memory")


def memory_shortage(err):
    """One line saying that memory ran out, if the exception `err` (or one it comes from) says
    so: a MemoryError, an allocation XLA could not make, a library that could not be loaded
    under a limit on memory; else None."""
    import resource

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if isinstance(err, MemoryError) or any(sign in text for sign in _SHORTAGE_SIGNS):
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            where = (f"the limit on memory ({limit} bytes, ulimit -v)"
                     if limit != resource.RLIM_INFINITY else "the memory free")
            return f"out of memory{f' ({text})' if text else ''}: the work needs more than {where}"
        err = err.__cause__ or err.__context__
    return None


def raise_if_interrupted():
    """Raise Interrupted if a signal arrived, even one whose exception a C library's callback
    swallowed: called before a result is committed."""
    if _received:
        raise Interrupted(_received[0])


class ArgumentError(ValueError):
    """A bad argument of a segcli function or command (the CLI's exit 2). `template` holds
    `{name}` for each argument it names (or `{0}`, `{1}`, ... for `arguments`, names too). The
    message names them as a Python caller spells them (`per_element=`, and the positional
    ones and those of `arguments` bare); `for_command` as the command line does."""

    def __init__(self, template, *arguments, commands=None):
        self.template, self.arguments, self.commands = template, arguments, commands or {}
        super().__init__(self._spelled(
            lambda name: name if name in _POSITIONAL or name in arguments else f"{name}="))

    def for_command(self, names=None):
        """The message as the command line says it: each argument as `commands` (given to
        the constructor), else `names` (argument -> option), spells it, else as its option
        (`per_element` as --per-element)."""
        names = {**(names or {}), **self.commands}
        return self._spelled(lambda name: names.get(name, f"--{name.replace('_', '-')}"))

    def _spelled(self, spell):
        return string.Formatter().vformat(self.template, [spell(a) for a in self.arguments],
                                          _Spelled(spell))


_POSITIONAL = ("inputs", "fields", "output", "parts")
"""Arguments that segcli's functions take by position: named without `=`."""


class _Spelled(dict):
    def __init__(self, spell):
        super().__init__()
        self.spell = spell

    def __missing__(self, name):
        return self.spell(name)


class Note(UserWarning):
    """Something worth telling that is no error (a condition that selects no structure of a
    shard, statistics merged though some lack): a warning to a Python caller, a line on
    stderr from the command line (none with --quiet)."""
