"""Where a whole `segcli reduce` or `grad` command's time goes, thread by thread: each run of
the command in this process (after first runs that warm imports, compilation and buffers)
records when each thread reads (`io.direct.Reader.window`, the file's pages mapped), pads
(`engine.pipeline._pad`), launches and waits for a chunk's program (`engine.launch`,
`engine.finish`) and writes a block of results (`ResultWriter._write_block`); printed per
thread and step, with how long the writing thread, from its first block to its last, was busy
and what it waited for.

    python benchmarks/timeline.py [--atoms 20000000] [--runs 3] [--device cpu|gpu]
                                  [--dir /dev/shm] [--show] grad sum forces

Uses the file `benchmarks/steady.py` makes (made here if missing), results with `-o` into
--dir. `--show` prints the last run's steps one by one, in the order they began.
"""

import argparse
import collections
import contextlib
import os
import statistics
import threading
import time

from steady import make_file

STEPS = {"read": ("segcli.io.direct", "Reader", "window"),
         "pad": ("segcli.engine.pipeline", None, "_pad"),
         "launch": ("segcli.engine", None, "launch"),
         "finish": ("segcli.engine", None, "finish"),
         "write": ("segcli.io.writers", "ResultWriter", "_write_block")}
"""step -> (module, class or None, function) timed."""


@contextlib.contextmanager
def recorded(events):
    """Each call of the STEPS appended to `events` as (thread, step, start, end) while open."""
    import importlib

    saved = []
    for step, (module, cls, name) in STEPS.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        raw = owner.__dict__[name]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        def timed(*args, _fn=fn, _step=step, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                events.append((threading.current_thread().name, _step, start,
                               time.perf_counter()))

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        saved.append((owner, name, raw))
    try:
        yield
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=20_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--show", action="store_true")
    parser.add_argument("command", nargs="+", help="e.g. grad sum forces")
    args = parser.parse_args()
    path = os.path.join(args.dir, f"segcli-steady-{args.atoms}.h5")
    if not os.path.exists(path):
        make_file(path, args.atoms)
    out = os.path.join(args.dir, "segcli-timeline-out.h5")

    from segcli.cli import main as cli
    from segcli.cli.common import as_program

    as_program()
    kind, *words = args.command
    argv = [kind, path, *words, "-o", out, "--force", "-q", "--device", args.device]

    def run():
        if os.path.exists(out):
            os.remove(out)
        start = time.perf_counter()
        cli.main(argv, standalone_mode=False)
        return start, time.perf_counter()

    for _ in range(2):
        run()
    walls, busy, writer = [], collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(args.runs):
        events = []
        with recorded(events):
            start, end = run()
        walls.append(end - start)
        totals = collections.Counter()
        for thread, step, a, b in events:
            totals[(thread, step)] += b - a
        for key, seconds in totals.items():
            busy[key].append(seconds)
        writes = sorted((a, b) for thread, step, a, b in events
                        if step == "write" and thread != "MainThread")
        if writes:
            span = writes[-1][1] - writes[0][0]
            writer["span"].append(span)
            writer["busy"].append(sum(b - a for a, b in writes))
    print(f"`segcli {' '.join(args.command)}`, {args.atoms} atoms, device {args.device}; "
          f"median of {args.runs} runs: wall {statistics.median(walls) * 1e3:.0f} ms")
    print("\n| thread | step | ms a run |\n| --- | --- | ---: |")
    for (thread, step), seconds in sorted(busy.items()):
        print(f"| {thread} | {step} | {statistics.median(seconds) * 1e3:.1f} |")
    if writer:
        span, work = (statistics.median(writer[k]) * 1e3 for k in ("span", "busy"))
        print(f"\nwriting thread: busy {work:.0f} of the {span:.0f} ms from its first block's "
              f"start to its last's end ({work / span:.0%})")
    if args.show:
        first = min(a for _, _, a, _ in events)
        for thread, step, a, b in sorted(events, key=lambda e: e[2]):
            print(f"{(a - first) * 1e3:8.1f} {(b - first) * 1e3:8.1f}  {thread:16.16s} {step}")


if __name__ == "__main__":
    main()
