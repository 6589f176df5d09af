"""Every fenced `segcli …` line of the README and of each page of docs/ runs, in order, in a
temporary directory of its own holding sample_data/ and the files the pages name as the
reader's own (made here: data.h5, batch.h5, mixed.extxyz, mixed.traj, omat24/*.aselmdb), the
cluster address they give being a LocalCluster's and each task of a SLURM array job run with
that task's variables."""

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

ROOT = Path(__file__).resolve().parents[2]
RUN = {"segcli", "cp", "export"}  # the pages' other lines install, submit or comment
CLUSTER_ADDRESS = "tcp://10.0.0.5:8786"
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
# What each page's examples write (each file non-empty).
WRITTEN = {
    "README.md": ["metals.h5", "forces.h5", "grad.h5", "low.h5", "neighbors.h5", "rms.h5"],
    "docs/clusters.md": ["rms-array.h5", "rms-local.h5", "rms-cluster.h5", "grad-cluster.h5"],
    "docs/commands/convert.md": ["metals.h5", "mixed.h5", "metals-export.extxyz",
                                 "conformers.h5"],
    "docs/commands/grad.md": ["grad.h5", "g.npy", "hot.h5"],
    "docs/commands/merge.md": ["rms.h5", "rms-virtual.h5"],
    "docs/commands/neighbors.md": ["close.h5", "crowded.h5"],
    "docs/commands/reduce.md": ["positions.h5", "forces.h5", "metals.h5", "calm.h5"],
    "docs/commands/select.md": ["low.h5", "quiet.h5"],
    "docs/commands/stats.md": ["stats-a.h5", "stats-b.h5"],
}
# Pages whose examples compile for seconds and repeat the README's: run with -m slow.
SLOW = {"docs/commands/gradcheck.md"}


def fenced_lines(text):
    """(block, line) of each shell line of a page's ```sh blocks, continuations joined."""
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            yield block, line.strip()


def runnable_lines(page):
    """(block, line) of the lines of a page that run: segcli, cp and export."""
    return [(block, line) for block, line in fenced_lines((ROOT / page).read_text())
            if line.split(" ")[0] in RUN]


def readers_files(tmp_path, lines):
    """The files a page's examples (lines) take to be the reader's."""
    os.symlink(ROOT / "sample_data", tmp_path / "sample_data")
    named = " ".join(lines)
    for name in ("data.h5", "batch.h5"):
        if name in named:
            shutil.copy(ROOT / "sample_data" / "metals.h5", tmp_path / name)
    frames = ase.io.read(ROOT / "sample_data" / "metals.extxyz", ":6")
    if "mixed.extxyz" in named:
        ase.io.write(tmp_path / "mixed.extxyz", frames[:3])
    if "mixed.traj" in named:
        rng = np.random.default_rng(0)
        molecules = [molecule(name) for name in ("H2O", "CH4", "NH3")]
        for atoms in molecules:
            atoms.calc = SinglePointCalculator(atoms, energy=rng.normal(),
                                               forces=rng.normal(size=(len(atoms), 3)))
        ase.io.write(tmp_path / "mixed.traj", molecules)
    if "omat24/" in named:
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
    """Run one line as a shell would; segcli in this process. Returns its stdout."""
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


def test_the_pages_show_every_command_and_name_what_they_write():
    lines = [line for page in PAGES for _, line in runnable_lines(page)]
    assert sum(line.startswith("segcli ") for line in lines) >= 30
    commands = {line.split()[1] for line in lines if line.startswith("segcli ")}
    assert commands == set(main.commands)
    readme = {line.split()[1] for _, line in runnable_lines("README.md")
              if line.startswith("segcli ")}
    assert readme == set(main.commands)
    assert set(WRITTEN) <= {page for page in PAGES if runnable_lines(page)}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("page", [pytest.param(page, marks=[pytest.mark.slow] * (page in SLOW))
                                  for page in PAGES if runnable_lines(page)])
def test_every_fenced_segcli_line_runs(page, tmp_path, monkeypatch, request):
    lines = runnable_lines(page)
    readers_files(tmp_path, [line for _, line in lines])
    monkeypatch.chdir(tmp_path)
    address = None
    if any(CLUSTER_ADDRESS in line for _, line in lines):
        address = request.getfixturevalue("dask_cluster").scheduler_address
    env = {}
    for block, line in lines:
        if address:
            line = line.replace(CLUSTER_ADDRESS, address)
        array = re.search(r"#SBATCH --array=(\d+)-(\d+)", block)
        if not array:
            run_line(line, env)
            continue
        first, last = int(array[1]), int(array[2])
        for task in range(first, last + 1):
            run_line(line, {**env, "SLURM_ARRAY_TASK_ID": str(task),
                            "SLURM_ARRAY_TASK_MIN": str(first),
                            "SLURM_ARRAY_TASK_COUNT": str(last - first + 1)})
    for written in WRITTEN.get(page, []):
        assert (tmp_path / written).stat().st_size > 0, written
    if page == "docs/clusters.md":
        assert sorted(p.name for p in (tmp_path / "parts").glob("r-*.h5")) == \
            [f"r-{k:02d}.h5" for k in range(16)]
