"""Errors that reach the user as one or two lines and an exit code, never a traceback."""


class DataError(Exception):
    """The data is wrong: a bad file, a missing field, bad values. Exit code 1."""

    exit_code = 1
