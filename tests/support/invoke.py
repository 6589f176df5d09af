"""The command line called in the test's own process, as the tests call it."""

from click.testing import CliRunner

from segcli.cli import main


def run(*args):
    """`segcli ARGS` (each made text) in this process: click's Result."""
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(*args):
    """run(*args), asserted to exit 0."""
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result
