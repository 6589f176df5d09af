"""What the parts of a job cover: each part's range of its input's structures, checked to join
into all of them exactly once, or (on purpose) into fewer, whose lacking ranges are then named.

    spans = [span_of(path, attrs) for path, attrs in ...]   # DataError for a malformed record
    lacking = check_spans(spans)    # DataError: overlaps, gaps, shards missing or twice
    lacking = check_spans(spans, partial=True)   # {fingerprint: [(start, stop), ...]}
"""

import itertools
import os
from dataclasses import dataclass

from segcli.errors import DataError
from segcli.shards import MOST_SHARDS

NAMED = 5
"""The most lacking ranges or shards that a message names (the rest are counted)."""


@dataclass(frozen=True)
class Span:
    """Structures [start, stop) of the input (`total` structures, identified by `fingerprint`)
    that the file `path` covers; a shard's (I, N) and the range `selection` of its job."""

    path: str
    fingerprint: str
    total: int
    start: int
    stop: int
    shard: tuple = None
    selection: tuple = None


def _pair(path, name, text, separator):
    """(a, b), two non-negative integers, from the attribute `name` "A<separator>B"."""
    a, found, b = str(text).partition(separator)
    if not (found and a.isdigit() and b.isdigit()):
        raise DataError(f"{path}: attribute {name} is {text!r}, not A{separator}B")
    return int(a), int(b)


def span_of(path, attrs):
    """The Span that a part's attributes `attrs` (of its results, or its root) record; DataError
    naming one that is missing (a file of an older segcli) or inconsistent."""
    for name in ("structures", "source_fingerprint", "source_structures"):
        if attrs.get(name) is None:
            raise DataError(f"{path}: records no {name} (written by an older segcli?): rerun it")
    start, stop = _pair(path, "structures", attrs["structures"], ":")
    total = attrs["source_structures"]
    if not isinstance(total, int) or isinstance(total, bool) or not start <= stop <= total:
        raise DataError(f"{path}: structures {start}:{stop} do not lie within the input's "
                        f"source_structures={total!r}")
    shard = selection = None
    if attrs.get("shard") is not None:
        shard = _pair(path, "shard", attrs["shard"], "/")
        selection = _pair(path, "selection", attrs.get("selection"), ":")
        if not (shard[0] < shard[1] <= MOST_SHARDS and selection[0] <= start
                and stop <= selection[1] <= total):
            raise DataError(f"{path}: shard {shard[0]}/{shard[1]} of structures "
                            f"{selection[0]}:{selection[1]} cannot hold {start}:{stop}")
    return Span(path, str(attrs["source_fingerprint"]), total, start, stop, shard, selection)


def refuse_empty(path):
    """DataError when the part `path` is an empty file (a task that failed to write it)."""
    if os.path.isfile(path) and not os.path.getsize(path):
        raise DataError(f"{path}: empty file (0 bytes), not a part")


def refuse_skipped(skipped):
    """DataError naming the first of the files `skipped` in a directory of parts (see
    segcli.io.expand_inputs), where none may be left out."""
    for path in skipped[:1]:
        refuse_empty(path)
        raise DataError(f"{path}: not a part (neither results nor statistics of segcli), in a "
                        "directory of parts")


def refuse_repeated(paths):
    """DataError when two of `paths` are the same file (given twice, or by two names)."""
    seen = {}
    for path in paths:
        try:
            info = os.stat(path)
        except OSError as err:
            raise DataError(f"{path}: cannot read it ({err.strerror})") from err
        first = seen.get((info.st_dev, info.st_ino))
        if first is not None:
            raise DataError(f"{path}: given twice (also as {first}): each part counts once")
        seen[info.st_dev, info.st_ino] = path


def check_spans(spans, partial=False, whole=True):
    """{fingerprint: the ranges (start, stop) of its structures that no span covers} of
    `spans`, grouped by input; DataError when two overlap or are the same shard, and, unless
    `partial`, when any structure of an input is lacking (from 0 to its count; from START to
    STOP where all spans of an input are shards of one job over START:STOP) or a shard is.
    Not `whole`: an input none of whose spans is a shard may lack structures (ranges chosen
    with --structures), and none are reported lacking."""
    inputs = {}
    for span in spans:
        inputs.setdefault(span.fingerprint, []).append(span)
    return {fingerprint: _lacking(sorted(group, key=lambda s: (s.start, s.stop)), partial, whole)
            for fingerprint, group in inputs.items()}


def _lacking(spans, partial, whole):
    """The ranges that `spans` (of one input, in structure order) lack (see check_spans)."""
    shards = {}
    for span in spans:
        if span.shard is not None:
            twin = shards.setdefault((span.shard, span.selection), span)
            if twin is not span:
                raise DataError(f"{span.path}: shard {span.shard[0]}/{span.shard[1]}, as is "
                                f"{twin.path}: each part counts once")
    filled = [s for s in spans if s.start < s.stop]  # an empty shard lies between others
    for before, after in itertools.pairwise(filled):
        if after.start < before.stop:
            raise DataError(f"parts overlap on structures {after.start}:"
                            f"{min(before.stop, after.stop)} ({before.path} has {before.start}:"
                            f"{before.stop}, {after.path} {after.start}:{after.stop})")
    jobs = {(s.shard and s.shard[1], s.selection) for s in spans}
    count, selection = jobs.pop() if len(jobs) == 1 else (None, None)
    first, last = selection or (0, spans[0].total)
    ends = [first, *(e for s in filled for e in (s.start, s.stop)), last]
    lacking = [(a, b) for a, b in zip(ends[::2], ends[1::2]) if a < b]
    absent = sorted(set(range(count or 0)) - {i for (i, n), _ in shards if n == count})
    if not (whole or shards):
        return []
    if (lacking or absent) and not partial:
        raise DataError(_lacking_message(filled, lacking, absent, count, first, last))
    return lacking


def _lacking_message(spans, lacking, absent, count, first, last):
    """The line refusing `spans` (those holding structures) that lack the ranges `lacking` or
    the shards `absent` (of `count`) of a job over structures first:last."""
    shards = (f"shard{'s' * (len(absent) > 1)} {_some(map(str, absent), len(absent))} of "
              f"{count} missing; " if absent else "")
    if not lacking:
        return (f"parts lack {shards.rstrip('; ')} (their structures, of {first}:{last}, are "
                "none); --partial merges what there is")
    a, b = lacking[0]
    before = next((s for s in reversed(spans) if s.stop <= a), None)
    after = next((s for s in spans if s.start >= b), None)
    where = ", ".join(f"{s.path} has {s.start}:{s.stop}" for s in (before, after) if s)
    ranges = _some((f"{a}:{b}" for a, b in lacking), len(lacking))
    return (f"parts leave structures {ranges} uncovered "
            f"({shards}{where}; the job covers {first}:{last}); --partial merges what there is")


def _some(texts, count):
    """The first NAMED of `count` texts, joined, and how many more there are."""
    named = list(itertools.islice(texts, NAMED))
    return ", ".join(named) + (f" and {count - NAMED} more" if count > NAMED else "")


def ranges_text(ranges):
    """"A:B,C:D" of the ranges (start, stop)."""
    return ",".join(f"{a}:{b}" for a, b in ranges)


def covers_of(path, entries):
    """The Spans of the attribute `covers` (see coverage_attrs) of the file `path`."""
    spans = []
    for entry in entries:
        fingerprint, total, structures = (str(entry).split(" ") + ["", ""])[:3]
        spans.append(span_of(path, {"structures": structures, "source_fingerprint": fingerprint,
                                    "source_structures": int(total) if total.isdigit() else
                                    total}))
    return spans


def coverage_attrs(spans, lacking):
    """The attributes of a file that joins `spans` lacking `lacking` (see check_spans):
    `covers`, each input's covered ranges as "FINGERPRINT COUNT START:STOP", and, if any lack,
    `missing`: "START:STOP,..." (each input's prefixed by its fingerprint where several lack)."""
    covers = []
    for span in sorted(spans, key=lambda s: (s.fingerprint, s.start)):
        last = covers[-1] if covers else None
        if last and last[:2] == (span.fingerprint, span.total) and last[3] == span.start:
            covers[-1] = (*last[:3], span.stop)
        else:
            covers.append((span.fingerprint, span.total, span.start, span.stop))
    out = {"covers": [f"{f} {n} {a}:{b}" for f, n, a, b in covers]}
    lacks = {f: ranges for f, ranges in lacking.items() if ranges}
    if lacks:
        out["missing"] = (ranges_text(*lacks.values()) if len(lacks) == 1 else
                          "; ".join(f"{f} {ranges_text(r)}" for f, r in lacks.items()))
    return out
