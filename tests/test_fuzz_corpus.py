"""Every committed fuzz input (fuzz/corpus/<target>/, seeds) and every committed reproducer of a
finding (fuzz/crashes/<target>/) through its target, as plain calls: each returns or raises
DataError, nothing else. A reproducer whose finding is not fixed yet is an expected failure,
named in FINDINGS, so that the one that gets fixed is seen (strict)."""

import contextlib
from pathlib import Path

import pytest

from fuzz.targets import TARGETS
from segcli.errors import DataError

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"

FINDINGS = {}
"""target/file of a reproducer under fuzz/crashes/ -> its finding, while it is not fixed."""


def inputs():
    for kind in ("corpus", "crashes"):
        for path in sorted(FUZZ.glob(f"{kind}/*/*")):
            key = f"{path.parent.name}/{path.name}"
            marks = ([pytest.mark.xfail(strict=True, reason=FINDINGS[key])]
                     if kind == "crashes" and key in FINDINGS else [])
            yield pytest.param(path, id=f"{kind}/{key}", marks=marks)


@pytest.mark.parametrize("path", list(inputs()))
def test_replay(path):
    with contextlib.suppress(DataError):
        TARGETS[path.parent.name].function(path.read_bytes())


def test_every_finding_has_its_reproducer():
    """FINDINGS names only reproducers that are committed."""
    missing = [key for key in FINDINGS if not (FUZZ / "crashes" / key).is_file()]
    assert not missing
