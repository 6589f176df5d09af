"""Every committed fuzz input (fuzz/corpus/<target>/, seeds) and every committed reproducer of a
finding (fuzz/crashes/<target>/) through its target, as plain calls: each returns or raises
DataError, nothing else, within TIME_LIMIT seconds of CPU time. A reproducer whose finding is
not fixed yet is an expected failure, named in FINDINGS, so that the one that gets fixed is
seen (strict)."""

import contextlib
import signal
from pathlib import Path

import pytest

from fuzz.targets import TARGETS
from segcli.errors import DataError

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
TIME_LIMIT = 0.5
"""CPU seconds (not wall time: the machine may be busy) that an input of a few KB may take:
segcli answers any file within seconds (SPEC §3d)."""

FINDINGS = {
    "extxyz/hang-count-past-maxsize.extxyz":
        "an atom count past sys.maxsize makes islice raise ValueError in "
        "segcli/io/extxyz.py:pieces, taken for a frame to leave to ASE, whose read_xyz "
        "(ase/io/extxyz.py:710) then reads that many lines at the end of the file forever",
    "extxyz/hang-lying-count-after-ase-frame.extxyz":
        "after a frame that segcli/io/extxyz.py:pieces leaves to ASE (VEC lines), "
        "AseBatch._ase_pieces hands the file to ase.io.iread, whose read_xyz "
        "(ase/io/extxyz.py:710) reads the 10^12 lines a later header claims, past the end",
    "extxyz/memory-properties-columns.extxyz":
        "a Properties column count of 10^8: segcli/io/extxyz.py:columns calls ASE's "
        "parse_properties (ase/io/extxyz.py:380) first, which builds a dtype entry per column "
        "(GBs, minutes)",
}
"""target/file of a reproducer under fuzz/crashes/ -> its finding, while it is not fixed."""


class TookTooLong(BaseException):
    """An input ran past TIME_LIMIT (not an Exception: segcli's readers catch those)."""


@contextlib.contextmanager
def cpu_time_limit(seconds):
    def expire(signum, frame):
        raise TookTooLong

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def inputs():
    for kind in ("corpus", "crashes"):
        for path in sorted(FUZZ.glob(f"{kind}/*/*")):
            key = f"{path.parent.name}/{path.name}"
            marks = ([pytest.mark.xfail(strict=True, reason=FINDINGS[key])]
                     if kind == "crashes" and key in FINDINGS else [])
            yield pytest.param(path, id=f"{kind}/{key}", marks=marks)


@pytest.mark.parametrize("path", list(inputs()))
def test_replay(path):
    try:
        with cpu_time_limit(TIME_LIMIT), contextlib.suppress(DataError):
            TARGETS[path.parent.name].function(path.read_bytes())
    except TookTooLong:
        pytest.fail(f"{path}: still running after {TIME_LIMIT} s of CPU time")


def test_every_finding_has_its_reproducer():
    """FINDINGS names only reproducers that are committed."""
    missing = [key for key in FINDINGS if not (FUZZ / "crashes" / key).is_file()]
    assert not missing
