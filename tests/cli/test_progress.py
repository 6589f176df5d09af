"""The progress bar of every long command: on a terminal only, with the total, rate and ETA;
gone under --quiet; cleared when the command fails."""

import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from terminal import BAR, final_screen, on_terminal

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"
METALS = SAMPLES / "metals.h5"


@pytest.mark.parametrize("command, label, total, unit", [
    (("convert", METALS, "-o", "out.h5"), "converting to out.h5", 199, "structure"),
    (("reduce", METALS, "rms_norm", "forces", "-o", "out.h5"), f"reducing {METALS}", 199,
     "structure"),
    (("grad", METALS, "rms_norm", "forces", "-o", "out.h5"), f"differentiating {METALS}", 199,
     "structure"),
    (("stats", METALS, "forces", "--per-element"), f"statistics of {METALS}", 199, "structure"),
    (("fit-e0", METALS), f"fitting E0 of {METALS} (2 passes)", 398, "structure"),
    (("select", METALS, "--where", "energy < 1", "-o", "out.h5"), "writing out.h5", 199,
     "structure"),
    # gradcheck's bar (1 of 1 op): tests/cli/test_cli_gradcheck.py, test_subprocess_entry_point_...
])
def test_every_long_command_shows_done_of_total_rate_and_eta(tmp_path, command, label, total,
                                                             unit):
    code, shown, _ = on_terminal(*command, cwd=tmp_path)
    assert code == 0, shown
    bars = [m for m in map(BAR.fullmatch, final_screen(shown)) if m]
    assert len(bars) == 1, shown
    assert (bars[0]["label"], int(bars[0]["done"]), int(bars[0]["total"]),
            bars[0]["unit"] or bars[0]["per"]) == (label, total, total, unit)


def test_convert_of_a_streamed_file_counts_without_a_total(tmp_path):
    code, shown, _ = on_terminal("convert", SAMPLES / "metals.extxyz", "-o", "out.h5",
                                 cwd=tmp_path)
    assert code == 0, shown
    assert re.search(r"converting to out.h5: 199structure \[[\d:]+, +[\d.]+structure/s\]",
                     final_screen(shown)[0]), shown


def test_no_bar_under_quiet_or_off_a_terminal(tmp_path):
    code, shown, _ = on_terminal("reduce", METALS, "sum", "forces", "-o", "out.h5", "--quiet",
                                 cwd=tmp_path)
    assert (code, shown) == (0, "")
    result = subprocess.run([sys.executable, "-m", "segcli", "stats", str(METALS), "energy"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""


def test_a_failing_command_clears_its_bar(tmp_path):
    """The error, NaN in the last structure, comes after bars were drawn: the terminal is left
    with the error line alone."""
    n_atoms = np.full(4000, 3)
    forces = np.ones((n_atoms.sum(), 3))
    forces[-1, 0] = np.nan
    with h5py.File(tmp_path / "nan.h5", "w") as f:
        f.attrs.update(format="segcli-batch", version=1)
        f["structures/n_atoms"] = n_atoms
        f["atoms/forces"] = forces
    code, shown, _ = on_terminal("reduce", "nan.h5", "sum", "forces", "-o", "out.h5",
                                      "--chunk-atoms", 300, cwd=tmp_path)
    assert code == 1 and "reducing nan.h5" in shown
    assert [line for line in final_screen(shown) if line] == [
        "Error: nan.h5: field 'forces' holds 1 NaN value(s), the first in structure 3999"], shown
    assert not (tmp_path / "out.h5").exists()
