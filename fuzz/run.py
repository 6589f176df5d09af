"""Run a fuzz target with atheris for a given time, keep the smallest input of each distinct
finding, and print a summary.

    python -m fuzz.run TARGET [--minutes 10] [--rss-limit-mb 2048] [--timeout 10]
    python -m fuzz.run TARGET --minimize FILE [--seconds 120]   # shrink a reproducer

Everything goes under fuzz/out/TARGET/ (ignored by git): corpus/ (inputs the fuzzer adds),
seeds/ (the larger run-time seeds of fuzz.seed), findings/ (SIGNATURE.bin, the smallest input
of each finding, and SIGNATURE.txt, its traceback), artifacts/ (libFuzzer's timeout-*, oom-*
and crash-* inputs: hangs, excess memory, native crashes) and fuzz.log.

A Python exception other than DataError is recorded and the fuzzing goes on; a hang, excess
memory or a native crash stops libFuzzer, which is then started again until the time is up.
"""

import argparse
import hashlib
import os
import random
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out"
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 0x10, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x7FFFFFFF,
               0xFFFFFFFF, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]


def signature(err):
    """A finding's identity: exception type, and where it rose (innermost frame, and the
    innermost frame in segcli when that is another)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = [f"{Path(f.filename).name}:{f.lineno}" for f in frames[-1:]]
    own = [f for f in frames if f"{os.sep}segcli{os.sep}" in f.filename]
    if own and own[-1] is not frames[-1]:
        inside = own[-1].filename.rpartition(f"{os.sep}segcli{os.sep}")[2]
        where.append(f"segcli/{inside}:{own[-1].lineno}")
    return f"{type(err).__name__} at {' via '.join(where)}"


def outcome(function, data):
    """None when `function(data)` returns or raises DataError, else the finding's signature
    and traceback."""
    from segcli.errors import DataError

    try:
        function(data)
    except DataError:
        return None
    except Exception as err:  # noqa: BLE001 -- any other exception is what is looked for
        return signature(err), "".join(traceback.format_exception(err))
    return None


def mutate_in_place(data, max_size, seed):
    """Mostly overwrite a few bytes with boundary integers or random bytes, keeping the length
    (an HDF5 file's offsets stay valid, so the mutations reach past its superblock); else
    libFuzzer's own mutation."""
    import atheris

    rng = random.Random(seed)
    if not data or rng.random() < 0.25:
        return atheris.Mutate(data, max_size)
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        width = rng.choice((1, 2, 4, 8))
        at = rng.randrange(max(len(buf) - width, 0) + 1)
        value = rng.choice(INTERESTING) if rng.random() < 0.6 else rng.getrandbits(8 * width)
        if rng.random() < 0.2:
            value = -value
        chunk = (value % (1 << (8 * width))).to_bytes(width, rng.choice(("little", "big")))
        buf[at:at + width] = chunk[:len(buf) - at]
    return bytes(buf[:max_size])


def worker(target, argv):
    """The fuzzing process: atheris over `target`, recording findings into findings/."""
    import atheris

    with atheris.instrument_imports(include=["segcli", "fuzz", "ase.io.extxyz",
                                             "ase.io.formats", "ase.db", "ase_db_backends",
                                             "h5py"]):
        from fuzz.targets import TARGETS

    spec = TARGETS[target]
    findings = OUT / target / "findings"
    findings.mkdir(parents=True, exist_ok=True)

    def test_one_input(data):
        found = outcome(spec.function, data)
        if found is None:
            return
        sig, text = found
        stem = findings / hashlib.sha1(sig.encode()).hexdigest()[:12]
        kept = stem.with_suffix(".bin")
        if kept.exists() and kept.stat().st_size <= len(data):
            return
        kept.write_bytes(data)
        stem.with_suffix(".txt").write_text(f"{sig}\n\n{text}")
        print(f"FINDING {stem.name} ({len(data)} bytes): {sig}", flush=True)

    extra = {"custom_mutator": mutate_in_place} if spec.binary else {}
    atheris.Setup([sys.argv[0], *argv], test_one_input, **extra)
    atheris.Fuzz()


def fuzz(target, minutes, rss_limit_mb, timeout, max_len):
    """Run `target` for `minutes`, restarting libFuzzer after a hang, excess memory or a
    native crash; the summary as a dict."""
    from fuzz.seed import _large_files, write

    out = OUT / target
    dirs = {name: out / name for name in ("corpus", "seeds", "findings", "artifacts")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    write(_large_files(target), dirs["seeds"])
    # not fuzz/crashes/: a known hang among the reproducers would stop every libFuzzer start
    inputs = [dirs["corpus"], ROOT / "corpus" / target, dirs["seeds"]]
    deadline = time.monotonic() + 60 * minutes
    runs = seconds = starts = 0
    log = out / "fuzz.log"
    with open(log, "a") as f:
        while (left := int(deadline - time.monotonic())) > 5:
            starts += 1
            flags = [f"-max_total_time={left}", f"-rss_limit_mb={rss_limit_mb}",
                     f"-timeout={timeout}", f"-max_len={max_len}", "-print_final_stats=1",
                     f"-artifact_prefix={dirs['artifacts']}/"]
            command = [sys.executable, "-m", "fuzz.run", target, "--worker", "--", *flags,
                       *[str(d) for d in inputs if d.is_dir()]]
            f.write(f"\n=== start {starts}: {' '.join(command)}\n")
            f.flush()
            began = time.monotonic()
            proc = subprocess.run(command, check=False, stdout=f, stderr=subprocess.STDOUT,
                                  cwd=ROOT.parent,
                                  env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
            seconds += time.monotonic() - began
            runs += _executed(log)
            f.write(f"=== exit {proc.returncode}\n")
            f.flush()
    findings = sorted(dirs["findings"].glob("*.txt"))
    return {"target": target, "minutes": minutes, "starts": starts, "executions": runs,
            "exec_per_s": round(runs / seconds, 1) if seconds else 0.0,
            "corpus": len(list(dirs["corpus"].iterdir())),
            "findings": [(p.with_suffix(".bin"), p.read_text().splitlines()[0]) for p in findings],
            "artifacts": sorted(dirs["artifacts"].iterdir())}


def _executed(log):
    """Executions of the last libFuzzer run in `log` (its final stats, else its last status
    line)."""
    text = log.read_text(errors="replace")
    last = text[text.rfind("=== start"):]
    stats = re.findall(r"stat::number_of_executed_units: (\d+)", last)
    if stats:
        return int(stats[-1])
    status = re.findall(r"^#(\d+)\s", last, re.M)
    return int(status[-1]) if status else 0


def minimize(target, path, seconds):
    """Shrink the input at `path` while it keeps its finding's signature: delete chunks of
    text, or cut the end and zero chunks of a binary file; writes PATH.min and returns it."""
    from fuzz.targets import TARGETS

    spec = TARGETS[target]
    data = Path(path).read_bytes()
    found = outcome(spec.function, data)
    if found is None:
        raise SystemExit(f"{path}: no finding to minimize")
    sig = found[0]
    deadline = time.monotonic() + seconds

    def keeps(candidate):
        got = outcome(spec.function, candidate)
        return got is not None and got[0] == sig

    size = max(len(data) // 2, 1)
    while size >= 1 and time.monotonic() < deadline:
        changed = False
        at = 0
        while at < len(data) and time.monotonic() < deadline:
            if spec.binary:
                candidates = [data[:at]] if at else []
                if data[at:at + size].strip(b"\0"):
                    candidates.append(data[:at] + bytes(len(data[at:at + size]))
                                      + data[at + size:])
            else:
                candidates = [data[:at] + data[at + size:]]
            better = next((c for c in candidates if keeps(c)), None)
            if better is not None:
                changed = changed or len(better) < len(data) or better != data
                data = better
                if not spec.binary:
                    continue
            at += size
        if not changed:
            size //= 2
    target_path = Path(f"{path}.min")
    target_path.write_bytes(data)
    print(f"{target_path}: {len(data)} bytes, {sig}")
    return target_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if "--worker" in sys.argv:  # its targets are imported instrumented, so not here
        parser.add_argument("target")
    else:
        from fuzz.targets import TARGETS

        parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rss-limit-mb", type=int, default=2048)
    parser.add_argument("--timeout", type=int, default=10, help="seconds per input")
    parser.add_argument("--max-len", type=int, default=65536, help="bytes per input")
    parser.add_argument("--minimize", metavar="FILE")
    parser.add_argument("--seconds", type=float, default=120, help="minimization time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        return worker(args.target, [a for a in rest if a != "--"])
    if args.minimize:
        return minimize(args.target, args.minimize, args.seconds)
    summary = fuzz(args.target, args.minutes, args.rss_limit_mb, args.timeout, args.max_len)
    print(f"{summary['target']}: {summary['minutes']} min, {summary['executions']} executions "
          f"({summary['exec_per_s']}/s), {summary['starts']} libFuzzer start(s), "
          f"{summary['corpus']} inputs added to the corpus")
    print(f"{len(summary['findings'])} distinct Python finding(s):")
    for path, sig in summary["findings"]:
        print(f"  {path} ({path.stat().st_size} bytes): {sig}")
    print(f"{len(summary['artifacts'])} libFuzzer artifact(s) (hang, memory, native crash):")
    for path in summary["artifacts"]:
        print(f"  {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
