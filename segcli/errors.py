"""Errors that reach the user as one or two lines and an exit code, never a traceback."""

import signal


class DataError(Exception):
    """The data is wrong: a bad file, a missing field, bad values. Exit code 1."""

    exit_code = 1


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind, cleaning up, and exit with 128 + the signal number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


_received = []


def _interrupt(signum, frame):
    _received.append(signum)
    raise Interrupted(signum)


def raise_on_signals():
    """Make SIGINT and SIGTERM raise Interrupted in the main thread (so that `finally` blocks
    remove temporary files), and a file-size limit give an OSError rather than a kill."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def raise_if_interrupted():
    """Raise Interrupted if a signal arrived, even one whose exception a C library's callback
    swallowed: called before a result is committed."""
    if _received:
        raise Interrupted(_received[0])
