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

from fuzz.targets import TARGETS, WrongResult
from segcli.errors import DataError

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
TIME_LIMIT = 0.3
"""CPU seconds (not wall time: the machine may be busy) that an input of a few KB may take:
segcli answers any file within seconds (SPEC §3d)."""
CHILD_CPU_S = 2  # the same for a reproducer replayed in a child, which also imports segcli
CHILD_BYTES = 8 << 30  # the child's address space: a bound on a runaway allocation

FINDINGS = {
    "extxyz/hang-count-past-maxsize.extxyz": (
        TimeoutError,
        "an atom count past sys.maxsize makes islice raise ValueError in "
        "segcli/io/extxyz.py:pieces, taken for a frame to leave to ASE, whose read_xyz "
        "(ase/io/extxyz.py:710) then reads that many lines at the end of the file forever"),
    "extxyz/hang-lying-count-after-ase-frame.extxyz": (
        TimeoutError,
        "after a frame that segcli/io/extxyz.py:pieces leaves to ASE (VEC lines), "
        "AseBatch._ase_pieces hands the file to ase.io.iread, whose read_xyz "
        "(ase/io/extxyz.py:710) reads the 10^12 lines a later header claims, past the end"),
    "extxyz/memory-properties-columns.extxyz": (
        TimeoutError,
        "a Properties column count of 10^8: segcli/io/extxyz.py:columns calls ASE's "
        "parse_properties (ase/io/extxyz.py:380) first, which builds a dtype entry per column "
        "(GBs, minutes)"),
    "hdf5/native-hang-format-attribute.h5": (
        TimeoutError,
        "a damaged global heap: reading the variable-length string attribute `format` "
        "(segcli/io/hdf5.py:SegcliBatch.__init__, h5py attrs.py:77) never returns from HDF5"),
    "hdf5/native-memory-string-heap.h5": (
        TimeoutError,
        "a damaged global heap: reading the string dataset /structures/label "
        "(segcli/io/hdf5.py:read_rows, ds.asstr()[lo:hi]) makes HDF5 allocate 4 GB and run "
        "22 s for a 7.8 KB file before it fails (bad global heap collection signature)"),
    "hdf5/runtimeerror-visiting-results.h5": (
        RuntimeError,
        "a bad metadata checksum: h5py's visititems raises RuntimeError in "
        "segcli/io/hdf5.py:SegcliBatch._result_names; open_file catches OSError, KeyError"),
    "hdf5/runtimeerror-iterating-group.h5.gz": (
        RuntimeError,
        "a damaged link: iterating /atoms (segcli/io/hdf5.py:SegcliBatch.__init__) raises "
        "RuntimeError (Link iteration failed); open_file catches OSError, KeyError"),
    "hdf5/runtimeerror-fill-value-attribute.h5.gz": (
        RuntimeError,
        "a damaged dataspace message: `\"fill_value\" in ...attrs` in "
        "segcli/io/hdf5.py:SegcliBatch.fill_value (after open) raises RuntimeError"),
    "hdf5/valueerror-float-type.h5.gz": (
        ValueError,
        "a float type NumPy has no dtype for: `ds.dtype` in "
        "segcli/io/hdf5.py:SegcliBatch.__init__ raises ValueError (h5t: Insufficient "
        "precision)"),
    "hdf5/indexerror-number-past-table.h5": (
        IndexError,
        "atomic number 203: deriving velocities indexes ase.data.atomic_masses past its end "
        "(IndexError in segcli/io/core.py:derive); a negative number silently takes another "
        "element's mass"),
    "hdf5/bytes-field-name.h5": (
        WrongResult,
        "a dataset name that is not UTF-8 becomes a bytes field name "
        "(segcli/io/hdf5.py:SegcliBatch.__init__); `segcli info` fails on it with TypeError "
        "(its table, and JSON)"),
    "formats/badgzipfile-gz-name.bin": (
        OSError,
        "a .gz name on content that is not gzip: ASE's filetype, called by "
        "segcli/io/asefiles.py:ase_format (from formats.py:detect), raises BadGzipFile; the "
        "CLI prints its text without the file's name"),
    "formats/oserror-bz2-name.bin": (
        OSError,
        "a .bz2 name on content that is not bzip2: OSError (Invalid data stream) from ASE's "
        "filetype in segcli/io/asefiles.py:ase_format"),
    "formats/eoferror-truncated-bz2.bin": (
        EOFError,
        "a truncated bzip2 stream: EOFError from ASE's filetype in "
        "segcli/io/asefiles.py:ase_format, which click turns into `Aborted!`"),
    "formats/keyerror-detecting-format.bin": (
        KeyError,
        "a bad metadata checksum in a conformer file: KeyError from `\"format\" in h5.attrs` "
        "in segcli/io/formats.py:_has_format_attribute (detect, recognised, open_batch), "
        "which catches OSError only"),
    "formats/unraisable-aselmdb-not-lmdb.bin": (
        WrongResult,
        "a .aselmdb name on a file that is not LMDB: detection and open_batch answer "
        "correctly, but ase_db_backends' LMDBDatabase.__del__ raises InvalidError, printed "
        "as a traceback (twice under `segcli info`) beside segcli's error line"),
    "conformers/species-not-utf8.h5": (
        UnicodeDecodeError,
        "species bytes that are not UTF-8: UnicodeDecodeError in "
        "segcli/io/hdf5.py:Molecule.__init__, which open_file does not catch"),
}
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
