"""The registry is the one list of ops: every op has its function and reference, and every
listing (segcli ops, reduce's help, the op table of the README or docs/) shows exactly its ops."""

import inspect
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from segcli.cli import main
from segcli.registry import OPS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OP_TABLE = "| OP | fields | result |\n| --- | --- | --- |\n"


def leading_parameters(function):
    """The number of parameters before the keyword-only ones."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(function).parameters.values())


@pytest.mark.parametrize("name", list(OPS))
def test_every_op_has_a_function_and_a_reference_of_its_arguments(name):
    op = OPS[name]
    arguments = len(op.inputs) + 2 + len(op.params)  # arrays, idx, num_segments, params
    assert leading_parameters(op.function) == leading_parameters(op.reference) == arguments
    for function in (op.function, op.reference):
        parameters = inspect.signature(function).parameters
        assert ("indices_are_sorted" in parameters) == op.takes_sorted
        assert all(p in parameters for p in op.params)


def test_segcli_ops_lists_every_op():
    lines = CliRunner().invoke(main, ["ops"]).stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == list(OPS)


def test_reduce_help_lists_every_op():
    text = CliRunner().invoke(main, ["reduce", "--help"]).stdout
    table = text.split("what each computes: `segcli ops`):\n")[1].split("\n\n")[0]
    assert [line.split()[0] for line in table.splitlines()] == list(OPS)


def test_readme_lists_every_op():
    tables = [text.split(OP_TABLE)[1].split("\n\n")[0]
              for text in (page.read_text() for page in PAGES) if OP_TABLE in text]
    assert tables
    for table in tables:
        listed = [name for row in table.splitlines()
                  for name in re.findall(r"`(\w+)`", row.split("|")[1])]
        assert listed == list(OPS)
