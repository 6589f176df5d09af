"""What every command shares: help with an example, whole summaries in `segcli --help`, and
a quiet exit 141 when stdout closes early."""

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from segcli.cli import main


def test_every_command_has_an_example_and_a_whole_summary():
    listing = CliRunner().invoke(main, ["--help"]).output
    summaries = listing.split("Commands:\n")[1].splitlines()
    assert sorted(line.split()[0] for line in summaries) == sorted(main.commands)
    for line in summaries:
        assert not line.endswith("..."), line
    for name in main.commands:
        assert "Example:" in CliRunner().invoke(main, [name, "--help"]).output, name


@pytest.mark.parametrize("command", [["stats", "forces", "--per-element"], ["fit-e0"]])
def test_closed_stdout_exits_141_quietly(command):
    script = (f"{sys.executable} -m segcli {command[0]} sample_data/metals.h5 "
              f"{' '.join(command[1:])} | true; echo ${{PIPESTATUS[0]}}")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert result.stdout.strip() == "141" and result.stderr == "", result


@pytest.mark.parametrize("variable, value, option", [("SEGCLI_THREADS", "abc", "--threads"),
                                                     ("DASK_SCHEDULER_ADDRESS", "local:x",
                                                      "--scheduler")])
def test_a_bad_value_from_the_environment_names_the_variable(variable, value, option):
    sample = str(Path(__file__).parents[2] / "sample_data" / "metals.h5")
    result = CliRunner().invoke(main, ["reduce", sample, "rms_norm", "forces"],
                                env={variable: value})
    assert result.exit_code == 2
    assert f"Invalid value for '{option}' (from {variable})" in result.output
    assert repr(value) in result.output
