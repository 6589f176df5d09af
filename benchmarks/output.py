"""Throughput of the result outputs of `segcli reduce` and `segcli grad`; prints a markdown table
(rerunnable).

    python benchmarks/output.py [--rows 2000000] [--atom-rows 10000000] [--runs 3]
                                [--before per-row|numpy] [--before-checkout DIR]

The sinks of segcli.io.sinks (csv, json and npy on stdout, `-o OUT.h5`), in this process,
are given the chunks that engine.run gives (2 Mi atoms, 32 atoms a structure, standard normal
float64 values) of three outputs: a scalar and a 3-vector per structure (--rows structures) and
a 3-vector per atom (--atom-rows atoms). stdout is a new file in --workdir, as is OUT.h5.
Beside each, in the same run and alternating with it: before, the per-row text of the former
TextSink (copied below) and the former npy sink (which copied each chunk with tobytes), or
with `--before numpy` the text made by segcli.io.text's NumPy passes (SEGCLI_NATIVE_TEXT=0,
what runs where `_text.c` was not built), or with `--before-checkout DIR` the text
sink of the segcli checkout DIR (another commit, in a child process of its own); the floors of
npy and HDF5, the same bytes (the values) copied into a new buffer and written to a new file a
chunk at a time; beside csv and json, orjson alone over the float cells of each block of rows
(the bound of a text made by orjson, which holds Python's lock). Rows/s from the median of
--runs runs.
"""

import argparse
import functools
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import h5py
import numpy as np
import orjson

from segcli import keep_freed_buffers
from segcli.io import ResultWriter, text
from segcli.io.core import Chunk
from segcli.io.sinks import Hdf5Sink, NpySink, TextSink

ATOMS = 32
CHUNK_ATOMS = 2 ** 21


def _printable(array):
    """Values whose Python repr is the shortest text that reads back as the same value:
    float32 goes through its own shortest decimal text."""
    if array.dtype.kind == "f" and array.dtype.itemsize < 8:
        return array.astype(str).astype("float64")
    return array


class PerRowTextSink:
    """Before: the text sink as it was before segcli.io.text, which formatted each row in
    Python (repr, json.dumps)."""

    def __init__(self, fmt, outputs, columns, source_of=None, out=None):
        self._fmt, self._outputs, self._columns = fmt, outputs, columns
        self._per = next(iter(outputs.values()))[0]
        self._source_of = source_of
        self._keys = (["structure"] + (["source", "source_index"] if source_of else [])
                      + (["atom"] if self._per == "atom" else []))
        self._out = sys.stdout

    def __enter__(self):
        if self._fmt == "csv":
            header = list(self._keys)
            for label, (_, shape, _) in self._outputs.items():
                base = self._columns[label]
                header += ([base] if not shape else
                           [f"{base}_{'_'.join(map(str, i))}" for i in np.ndindex(*shape)])
            self._out.write(",".join(header) + "\n")
        return self

    def __exit__(self, *exc):
        self._out.flush()

    def write(self, chunk, arrays):
        structures = chunk.start + np.arange(len(chunk.n_atoms))
        index = [structures]
        if self._source_of:
            index += self._source_of(slice(chunk.start, chunk.start + len(chunk.n_atoms)))
        if self._per == "atom":
            first = np.repeat(np.cumsum(chunk.n_atoms) - chunk.n_atoms, chunk.n_atoms)
            index = [np.repeat(i, chunk.n_atoms) for i in index] + [np.arange(len(first)) - first]
        index = np.stack(index, axis=1).tolist()
        if self._fmt == "csv":
            values = np.concatenate([_printable(a).reshape(len(a), -1).astype("float64")
                                     if a.dtype.kind == "f" else a.reshape(len(a), -1)
                                     for a in arrays.values()], axis=1).tolist()
            lines = [",".join(map(repr, i + v)) for i, v in zip(index, values)]
        else:
            columns = [self._columns[label] for label in arrays]
            values = [_printable(a).tolist() for a in arrays.values()]
            lines = [json.dumps({**dict(zip(self._keys, i)), **dict(zip(columns, v))})
                     for i, *v in zip(index, *values)]
        if lines:
            self._out.write("\n".join(lines) + "\n")


class CopyingNpySink(NpySink):
    """The former npy sink: each chunk copied to bytes (tobytes) before it was written."""

    def write(self, chunk, arrays):
        (array,), = [arrays.values()]
        self.out.write(np.ascontiguousarray(array, self._dtype).tobytes())


def chunks(per, rows, width, rng):
    """(Chunk, {"value": values}) of `rows` rows of an output per structure or per atom."""
    values = rng.standard_normal((rows, width) if width > 1 else rows)
    step = CHUNK_ATOMS if per == "atom" else CHUNK_ATOMS // ATOMS
    out = []
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        structures = n // ATOMS if per == "atom" else n
        start = lo // ATOMS if per == "atom" else lo
        out.append((Chunk(start, np.full(structures, ATOMS), {}, {}),
                    {"value": values[lo:lo + n]}))
    return out


class NumpyTextSink(TextSink):
    """The text sink with segcli.io.text's NumPy passes in place of `_text.c`."""

    def __enter__(self):
        os.environ["SEGCLI_NATIVE_TEXT"] = "0"
        text._native_text.cache_clear()
        return super().__enter__()

    def __exit__(self, *exc):
        del os.environ["SEGCLI_NATIVE_TEXT"]
        text._native_text.cache_clear()
        return super().__exit__(*exc)


def candidates(outputs, n_atoms, h5, before="per-row"):
    """sink -> (before, after): functions giving each a new sink of `outputs`."""
    columns = {"value": "value"}
    text_before = PerRowTextSink if before == "per-row" else NumpyTextSink
    return {
        "csv": (lambda: text_before("csv", outputs, columns, out=sys.stdout.buffer),
                lambda: TextSink("csv", outputs, columns, out=sys.stdout.buffer)),
        "json": (lambda: text_before("json", outputs, columns, out=sys.stdout.buffer),
                 lambda: TextSink("json", outputs, columns, out=sys.stdout.buffer)),
        "npy": (lambda: CopyingNpySink(outputs, columns, n_atoms, out=sys.stdout.buffer),
                lambda: NpySink(outputs, columns, n_atoms, out=sys.stdout.buffer)),
        "-o OUT.h5": (None, lambda: Hdf5Sink(ResultWriter(output_path=h5, force=True), outputs,
                                              n_atoms, {"value": {}})),
    }


def run_sink(make, parts, path):
    """Seconds to write `parts` through the sink `make()` gives, stdout a new file `path`."""
    with open(path, "wb") as out:
        sys.stdout = io.TextIOWrapper(out)
        try:
            start = time.perf_counter()
            with make() as sink:
                for chunk, arrays in parts:
                    sink.write(chunk, arrays)
            seconds = time.perf_counter() - start
        finally:
            sys.stdout.detach()
            sys.stdout = sys.__stdout__
    os.unlink(path)
    return seconds


def copy(parts):
    """Seconds to copy the values of `parts` into a new buffer."""
    start = time.perf_counter()
    out = np.empty(sum(a["value"].nbytes for _, a in parts), np.uint8)
    row = 0
    for _, arrays in parts:
        view = arrays["value"].reshape(-1).view(np.uint8)
        out[row:row + len(view)] = view
        row += len(view)
    return time.perf_counter() - start


def file_write(parts, path):
    """Seconds to write the values of `parts` to a new file `path`, a chunk at a time."""
    start = time.perf_counter()
    with open(path, "wb") as out:
        out.writelines(arrays["value"] for _, arrays in parts)
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def orjson_alone(parts, cells):
    """Seconds orjson takes to format the floats of `parts`, in the blocks of rows of
    segcli.io.text (rows of `cells` numbers, the integer indices among them)."""
    step = max(1, text._BLOCK_CELLS // cells)
    start = time.perf_counter()
    for _, arrays in parts:
        values = arrays["value"]
        for lo in range(0, len(values), step):
            orjson.dumps(np.ascontiguousarray(values[lo:lo + step]).ravel(),
                         option=orjson.OPT_SERIALIZE_NUMPY)
    return time.perf_counter() - start


def time_checkout(args, case, sink):
    """Seconds the sink `sink` of the checkout args.before_checkout takes over case `case`,
    timed by this script in a child process that imports segcli from there."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.abspath(args.before_checkout), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, __file__, "--time-one", str(case), sink, "--workdir",
               args.workdir, "--rows", str(args.rows), "--atom-rows", str(args.atom_rows)]
    return float(subprocess.run(command, env=env, check=True, capture_output=True,
                                text=True).stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/segcli-bench-output")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--atom-rows", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before-checkout", metavar="DIR",
                        help="time the csv and json of the segcli checkout DIR as before")
    parser.add_argument("--time-one", nargs=2, metavar=("CASE", "SINK"), help=argparse.SUPPRESS)
    parser.add_argument("--before", choices=["per-row", "numpy"], default="per-row",
                        help="the csv and json text to compare with")
    args = parser.parse_args()
    keep_freed_buffers()  # as the segcli program does
    os.makedirs(args.workdir, exist_ok=True)
    stdout, h5 = os.path.join(args.workdir, "stdout"), os.path.join(args.workdir, "out.h5")
    cases = [("scalar per structure", "structure", args.rows, 1),
             ("3-vector per structure", "structure", args.rows, 3),
             ("3-vector per atom", "atom", args.atom_rows, 3)]
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, NumPy {np.__version__}, orjson "
          f"{orjson.__version__}, h5py {h5py.__version__}, load average "
          f"{os.getloadavg()[0]:.1f}; median of {args.runs} runs\n")
    print("| output | rows | sink | before, rows/s | after, rows/s | after / before "
          "| memory copy, rows/s | file write, rows/s | orjson alone, rows/s | after / bound |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    if args.time_one:  # one sink of this checkout, timed for another one's run
        label, per, rows, width = cases[int(args.time_one[0])]
        outputs = {"value": (per, (width,) if width > 1 else (), np.dtype(np.float64))}
        print(run_sink(candidates(outputs, None, h5)[args.time_one[1]][1],
                       chunks(per, rows, width, np.random.default_rng(0)), stdout))
        return
    for case, (label, per, rows, width) in enumerate(cases):
        parts = chunks(per, rows, width, np.random.default_rng(0))
        n_atoms = np.full(rows // ATOMS if per == "atom" else rows, ATOMS)
        outputs = {"value": (per, (width,) if width > 1 else (), np.dtype(np.float64))}
        sinks = candidates(outputs, n_atoms, h5, args.before)
        if args.before_checkout:
            sinks = {name: (functools.partial(time_checkout, args, case, name), after)
                     for name, (_, after) in sinks.items() if name in ("csv", "json")}
        for name, (before, after) in sinks.items():
            times = {"before": [], "after": [], "copy": [], "file write": [], "orjson": []}
            for _ in range(args.runs):
                if before and args.before_checkout:
                    times["before"].append(before())
                elif before:
                    times["before"].append(run_sink(before, parts, stdout))
                times["after"].append(run_sink(after, parts, stdout))
                if name == "-o OUT.h5":
                    os.unlink(h5)
                if name in ("npy", "-o OUT.h5"):
                    times["copy"].append(copy(parts))
                    times["file write"].append(file_write(parts, stdout))
                else:
                    times["orjson"].append(orjson_alone(parts, width + (per == "atom") + 1))
            rate = {k: rows / statistics.median(t) if t else None for k, t in times.items()}
            cells = [f"{rate[k] / 1e6:.2f} M" if rate[k] else "" for k in rate]
            bound = rate["file write"] or rate["orjson"]
            ratio = [f"{rate['after'] / r:.2f}" if r else "" for r in (rate["before"], bound)]
            print(f"| {label} | {rows:,} | {name} | {cells[0]} | {cells[1]} | {ratio[0]} | "
                  f"{cells[2]} | {cells[3]} | {cells[4]} | {ratio[1]} |", flush=True)


if __name__ == "__main__":
    main()
