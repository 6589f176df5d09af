"""Every committed fuzz input (fuzz/corpus/<target>/, seeds) and every committed reproducer of a
finding (fuzz/crashes/<target>/) through its target, as plain calls: each returns or raises
DataError, nothing else, within TIME_LIMIT seconds of CPU time. A reproducer whose finding is
not fixed yet is an expected failure, named in FINDINGS, so that the one that gets fixed is
seen (strict)."""

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.targets import TARGETS
from segcli.errors import DataError

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
TIME_LIMIT = 0.5
"""CPU seconds (not wall time: the machine may be busy) that an input of a few KB may take:
segcli answers any file within seconds (SPEC §3d)."""
CHILD_CPU_S = 2  # the same for a reproducer replayed in a child, which also imports segcli

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
    "hdf5/native-hang-format-attribute.h5":
        "a damaged global heap: reading the variable-length string attribute `format` "
        "(segcli/io/hdf5.py:SegcliBatch.__init__, h5py attrs.py:77) never returns from HDF5",
    "hdf5/keyerror-detecting-format.h5":
        "a bad metadata checksum: `\"format\" in h5.attrs` raises KeyError in "
        "segcli/io/formats.py:_has_format_attribute, which catches OSError only",
    "hdf5/runtimeerror-visiting-results.h5":
        "a bad metadata checksum: h5py's visititems raises RuntimeError in "
        "segcli/io/hdf5.py:SegcliBatch._result_names; open_file catches OSError, KeyError",
    "hdf5/indexerror-number-past-table.h5":
        "atomic number 203: deriving velocities indexes ase.data.atomic_masses past its end "
        "(IndexError in segcli/io/core.py:derive); a negative number silently takes another "
        "element's mass",
    "hdf5/typeerror-name-not-utf8.h5":
        "a dataset name that is not UTF-8 becomes a bytes field name "
        "(segcli/io/hdf5.py:SegcliBatch.__init__); `segcli info` fails on it with TypeError "
        "(its table, and JSON)",
    "formats/badgzipfile-gz-name.bin":
        "a .gz name on content that is not gzip: ASE's filetype, called by "
        "segcli/io/asefiles.py:ase_format (from formats.py:detect), raises BadGzipFile; the "
        "CLI prints its text without the file's name",
    "formats/oserror-bz2-name.bin":
        "a .bz2 name on content that is not bzip2: OSError (Invalid data stream) from ASE's "
        "filetype in segcli/io/asefiles.py:ase_format",
    "formats/eoferror-truncated-bz2.bin":
        "a truncated bzip2 stream: EOFError from ASE's filetype in "
        "segcli/io/asefiles.py:ase_format, which click turns into `Aborted!`",
    "formats/keyerror-detecting-format.bin":
        "a bad metadata checksum in a conformer file: KeyError from `\"format\" in h5.attrs` "
        "in segcli/io/formats.py:_has_format_attribute (detect and recognised)",
    "conformers/species-not-utf8.h5":
        "species bytes that are not UTF-8: UnicodeDecodeError in "
        "segcli/io/hdf5.py:Molecule.__init__, which open_file does not catch",
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
    if path.name.startswith("native-"):
        return replay_in_child(path)
    try:
        with cpu_time_limit(TIME_LIMIT), contextlib.suppress(DataError):
            TARGETS[path.parent.name].function(path.read_bytes())
    except TookTooLong:
        pytest.fail(f"{path}: still running after {TIME_LIMIT} s of CPU time")


def replay_in_child(path):
    """A reproducer whose finding is in native code (a loop that no Python signal handler
    interrupts, a crash), replayed in a process of its own under a CPU-time limit."""
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_CPU, ({CHILD_CPU_S}, "
            f"{CHILD_CPU_S}))\nimport contextlib, sys\nfrom fuzz.targets import TARGETS\n"
            "from segcli.errors import DataError\nwith contextlib.suppress(DataError):\n"
            f"    TARGETS[{path.parent.name!r}].function(open(sys.argv[1], 'rb').read())")
    child = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                           cwd=FUZZ.parent, timeout=120)
    assert child.returncode == 0, f"{path}: exit {child.returncode}\n{child.stderr[-2000:]}"


def test_every_finding_has_its_reproducer():
    """FINDINGS names only reproducers that are committed."""
    missing = [key for key in FINDINGS if not (FUZZ / "crashes" / key).is_file()]
    assert not missing
