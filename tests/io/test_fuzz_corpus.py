"""Every committed fuzz input (fuzz/corpus/<target>/, seeds) and every committed reproducer of a
finding (fuzz/crashes/<target>/) through its target, as plain calls: each returns or raises
DataError, nothing else, within TIME_LIMIT seconds of CPU time. A reproducer whose finding is
not fixed yet is an expected failure, named in FINDINGS, so that the one that gets fixed is
seen (strict)."""

import contextlib
import gzip
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.targets import TARGETS
from segcli.errors import DataError

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
TIME_LIMIT = 0.3
"""CPU seconds (not wall time: the machine may be busy) that an input of a few KB may take:
segcli answers any file within seconds (SPEC §3d)."""
CHILD_CPU_S = 2  # the same for a reproducer replayed in a child, which also imports segcli
CHILD_BYTES = 8 << 30  # the child's address space: a bound on a runaway allocation

FINDINGS = {}
"""target/file of a reproducer under fuzz/crashes/ -> (what it raises, its finding), while the
finding is not fixed; TimeoutError: it ran past its CPU-time limit."""


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
            marks = []
            if kind == "crashes" and key in FINDINGS:
                raises, reason = FINDINGS[key]
                marks = [pytest.mark.xfail(strict=True, raises=raises, reason=reason)]
            yield pytest.param(path, id=f"{kind}/{key}", marks=marks)


@pytest.mark.parametrize("path", list(inputs()))
def test_replay(path):
    if path.name.startswith("native-"):
        return replay_in_child(path)
    try:
        with cpu_time_limit(TIME_LIMIT), contextlib.suppress(DataError):
            TARGETS[path.parent.name].function(contents(path))
    except TookTooLong:
        raise TimeoutError(f"{path}: still running after {TIME_LIMIT} s of CPU time") from None


def contents(path):
    """A reproducer's bytes; one of tens of KB is committed gzipped (NAME.gz)."""
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def replay_in_child(path):
    """A reproducer whose finding is in native code (a loop that no Python signal handler
    interrupts, a runaway allocation, a crash), replayed in a process of its own under a
    CPU-time limit."""
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_CPU, ({CHILD_CPU_S}, "
            f"{CHILD_CPU_S + 1})); resource.setrlimit(resource.RLIMIT_AS, ({CHILD_BYTES}, "
            f"{CHILD_BYTES}))\nimport contextlib, sys\nfrom fuzz.targets import TARGETS\n"
            "from segcli.errors import DataError\nwith contextlib.suppress(DataError):\n"
            f"    TARGETS[{path.parent.name!r}].function(open(sys.argv[1], 'rb').read())")
    child = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                           cwd=FUZZ.parent, timeout=120)
    if child.returncode == -signal.SIGXCPU:
        raise TimeoutError(f"{path}: still running after {CHILD_CPU_S} s of CPU time")
    assert child.returncode == 0, f"{path}: exit {child.returncode}\n{child.stderr[-2000:]}"


def test_every_finding_has_its_reproducer():
    """FINDINGS names only reproducers that are committed."""
    missing = [key for key in FINDINGS if not (FUZZ / "crashes" / key).is_file()]
    assert not missing
