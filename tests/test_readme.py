"""Every fenced `segcli …` line of the README runs, in order, in a temporary directory holding
sample_data/ and the files the README names as the reader's own (made here: data.h5, batch.h5,
mixed.extxyz, mixed.traj, omat24/*.aselmdb), the cluster address it gives being a
LocalCluster's and each task of its SLURM array job run with that task's variables."""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import ase.db
import ase.io
import numpy as np
import pytest
from ase.build import molecule
from ase.calculators.singlepoint import SinglePointCalculator
from click.testing import CliRunner

from segcli.cli import main

ROOT = Path(__file__).resolve().parents[1]
RUN = {"segcli", "cp", "export"}  # the README's other lines install, submit or comment


def fenced_lines(text):
    """(block, line) of each shell line of the README's ```sh blocks, continuations joined."""
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            yield block, line.strip()


def readers_files(tmp_path):
    """The files the README's examples take to be the reader's."""
    os.symlink(ROOT / "sample_data", tmp_path / "sample_data")
    for name in ("data.h5", "batch.h5"):
        shutil.copy(ROOT / "sample_data" / "metals.h5", tmp_path / name)
    frames = ase.io.read(ROOT / "sample_data" / "metals.extxyz", ":6")
    ase.io.write(tmp_path / "mixed.extxyz", frames[:3])
    rng = np.random.default_rng(0)
    molecules = [molecule(name) for name in ("H2O", "CH4", "NH3")]
    for atoms in molecules:
        atoms.calc = SinglePointCalculator(atoms, energy=rng.normal(),
                                           forces=rng.normal(size=(len(atoms), 3)))
    ase.io.write(tmp_path / "mixed.traj", molecules)
    (tmp_path / "omat24").mkdir()
    for k in range(2):
        with ase.db.connect(tmp_path / "omat24" / f"part{k}.aselmdb", type="aselmdb") as db:
            for atoms in frames[3 * k:3 * k + 3]:
                db.write(atoms)


def stages(line):
    """The commands of a pipeline (lists of words) and the file its output is redirected to."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|>")
    lexer.whitespace_split = True
    words, redirect = list(lexer), None
    if ">" in words:
        words, redirect = words[:words.index(">")], words[words.index(">") + 1]
    commands = [[]]
    for word in words:
        if word == "|":
            commands.append([])
        else:
            commands[-1].append(word)
    return commands, redirect


def run_line(line, env):
    """Run one README line as a shell would; segcli in this process. Returns its stdout."""
    commands, redirect = stages(line)
    data = b""
    for command in commands:
        if command[0] == "segcli":
            result = CliRunner().invoke(main, command[1:], input=data, env=env)
            assert result.exit_code == 0, (line, result.output, result.exception)
            data = result.stdout_bytes
        elif command[0] == "export":
            name, _, value = command[1].partition("=")
            env[name] = value
        else:
            done = subprocess.run(command, input=data, capture_output=True, check=False)
            assert done.returncode == 0, (line, done.stderr)
            data = done.stdout
    if redirect:
        Path(redirect).write_bytes(data)
    return data


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_fenced_segcli_line_of_the_readme_runs(tmp_path, monkeypatch, dask_cluster):
    readers_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    lines = [(block, line) for block, line in fenced_lines((ROOT / "README.md").read_text())
             if line.split(" ")[0] in RUN]
    assert sum(line.startswith("segcli ") for _, line in lines) >= 30
    env = {}
    for block, line in lines:
        line = line.replace("tcp://10.0.0.5:8786", dask_cluster.scheduler_address)
        array = re.search(r"#SBATCH --array=(\d+)-(\d+)", block)
        if not array:
            run_line(line, env)
            continue
        first, last = int(array[1]), int(array[2])
        for task in range(first, last + 1):
            run_line(line, {**env, "SLURM_ARRAY_TASK_ID": str(task),
                            "SLURM_ARRAY_TASK_MIN": str(first),
                            "SLURM_ARRAY_TASK_COUNT": str(last - first + 1)})
    for written in ("metals.h5", "mixed.h5", "positions.h5", "forces.h5", "grad.h5", "g.npy",
                    "calm.h5", "rms.h5", "rms-virtual.h5", "low.h5", "quiet.h5", "rms-array.h5",
                    "rms-local.h5", "rms-cluster.h5", "grad-cluster.h5"):
        assert (tmp_path / written).stat().st_size > 0, written
    assert sorted(p.name for p in (tmp_path / "parts").glob("r-*.h5")) == \
        [f"r-{k:02d}.h5" for k in range(16)]
