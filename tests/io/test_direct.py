"""Rows read from an HDF5 file's bytes by several threads (segcli.io.direct) against h5py's
own read of the same rows, for every storage it reads itself; what it leaves to h5py; damaged
chunks; --threads and segcli.threads."""

import gc
import io
import os
import sys
import time
import zlib

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli import threads
from segcli.cli import main
from segcli.io import direct

ROWS = 10_007
RANGES = [(0, 0), (0, ROWS), (0, 1), (ROWS - 1, ROWS), (999, 1001), (1000, 3000), (123, 9876),
          (5000, 5000)]


@pytest.fixture(autouse=True)
def default_threads():
    yield
    threads.set_count(None)


@pytest.fixture(params=[1, 3])
def thread_count(request, monkeypatch):
    """Read with 1 and with 3 threads, in parts of a few rows (so that even small reads are
    cut into parts)."""
    monkeypatch.setattr(direct, "MIN_PART", 4096)
    threads.set_count(request.param)
    return request.param


def _layouts(rng):
    """name -> (data, create_dataset options) of every storage io.direct reads itself."""
    x = rng.normal(size=(ROWS, 3))
    return {
        "contiguous": (x, {}),
        "contiguous 1-D float32": (x[:, 0].astype(np.float32), {}),
        "contiguous big-endian": (x.astype(">f8"), {}),
        "chunked": (x, {"chunks": (1000, 3)}),
        "chunked, chunks not dividing the rows": (x, {"chunks": (777, 3)}),
        "deflate": (x, {"chunks": (1000, 3), "compression": "gzip"}),
        "shuffle and deflate": (x, {"chunks": (1024, 3), "compression": "gzip", "shuffle": True}),
        "shuffle only": (x, {"chunks": (500, 3), "shuffle": True}),
        "int32 shuffled, (N, 2, 2)": (rng.integers(-9, 9, (ROWS, 2, 2)).astype(np.int32),
                                      {"chunks": (333, 2, 2), "compression": 9, "shuffle": True}),
        "uint8 deflate": (rng.integers(0, 255, ROWS).astype(np.uint8),
                          {"chunks": (4096,), "compression": "gzip"}),
        "chunked big-endian, resizable": (x.astype(">f4"), {"chunks": (2000, 3),
                                                            "maxshape": (None, 3)}),
    }


def test_rows_match_h5py(tmp_path, thread_count):
    rng = np.random.default_rng(0)
    path = tmp_path / "layouts.h5"
    layouts = _layouts(rng)
    with h5py.File(path, "w") as f:
        for name, (data, options) in layouts.items():
            f.create_dataset(name, data=data, **options)
    with h5py.File(path, "r") as f:
        reader = direct.Reader(str(path), f)
        for name, (data, _) in layouts.items():
            ds = f[name]
            assert reader.storage(ds) is not None, name
            for lo, hi in RANGES:
                got = reader.read(ds, lo, hi)
                assert got.dtype == ds.dtype and got.shape == (hi - lo, *data.shape[1:])
                np.testing.assert_array_equal(got, data[lo:hi], err_msg=f"{name} {lo}:{hi}")
            out = np.full(data.shape, 7, data.dtype)
            assert reader.read(ds, 0, ROWS, out) is out  # into a buffer of the right kind
            np.testing.assert_array_equal(out, data)
            assert reader.read(ds, 0, ROWS, np.zeros(data.shape, np.float16)).dtype == ds.dtype


def test_rows_left_in_the_files_pages(tmp_path):
    """A Window over contiguous rows: the file's rows, read-only, from `skip` rows ahead of the
    first, at an address that is a multiple of 64 bytes, before the dataset's start and past
    its end where the file goes on; nothing for storage not contiguous as NumPy holds it, or
    a window past the file's end; read_rows reads into the fallback then."""
    from segcli.io.hdf5 import read_rows
    from segcli.memory import Window

    rng = np.random.default_rng(3)
    layouts = {name: layout for name, layout in _layouts(rng).items()
               if name in ("contiguous", "contiguous 1-D float32", "contiguous big-endian",
                           "chunked")}
    path = tmp_path / "windows.h5"
    with h5py.File(path, "w") as f:
        f.attrs["pad"] = np.zeros(5, np.uint8)  # moves the data off round offsets
        for name, (data, options) in layouts.items():
            f.create_dataset(name, data=data, **options)
    with h5py.File(path, "r") as f:
        reader = direct.Reader(str(path), f)
        for name in ("contiguous", "contiguous 1-D float32"):
            data = layouts[name][0]
            skips = set()
            for lo, hi in [(999, 1001), (1000, 3000), (123, 9876), (64, 65)]:
                request = Window(hi - lo + 64)
                rows = reader.window(f[name], lo, hi, request)
                assert rows is not None, (name, lo)
                assert not rows.flags.writeable and request.holds(rows)
                assert request.array.ctypes.data % 64 == 0 and 0 <= request.skip <= min(lo, 64)
                np.testing.assert_array_equal(rows, data[lo:hi])
                np.testing.assert_array_equal(request.array, data[lo - request.skip:][:len(
                    request.array)])
                assert not request.holds(rows[1:]) and not request.holds(rows.copy())
                skips.add(request.skip)
            assert len(skips) > 1, name  # windows from other rows than the first
            first = Window(69)  # from row 0: the file's bytes before the rows where unaligned
            np.testing.assert_array_equal(reader.window(f[name], 0, 5, first), data[:5])
            start = f[name].id.get_offset() - first.skip * data[:1].nbytes
            assert start % 64 == 0 and (first.skip > 0) == bool(f[name].id.get_offset() % 64)
            with open(path, "rb") as raw:
                raw.seek(start)
                assert first.array.tobytes() == raw.read(first.array.nbytes)
            past = Window(64)  # past the dataset's rows: the file's next bytes
            np.testing.assert_array_equal(reader.window(f[name], ROWS - 10, ROWS, past),
                                          data[ROWS - 10:])
            assert past.array.shape[0] == 64 and not past.array.flags.writeable
            end = os.path.getsize(path) // data[:1].nbytes  # rows of the file's size
            assert reader.window(f[name], 10, 20, Window(end)) is None  # past the file's end
        for name in ("contiguous big-endian", "chunked"):
            assert reader.window(f[name], 10, 20, Window(64)) is None, name
        fallback = np.zeros((64, 3))
        request = Window(64, fallback)
        rows = read_rows(str(path), f["chunked"], 10, 74, request, reader)
        assert rows is fallback and request.array is None
        np.testing.assert_array_equal(rows, layouts["chunked"][0][10:74])


def test_a_windows_pages_stay_mapped_while_an_array_over_them_lives(tmp_path):
    """A Window's pages are mapped (Linux: /proc/self/maps names the file) from the read until
    the last array over them goes, a view of a view included, and then unmapped."""
    from segcli.memory import Window

    path = tmp_path / "mapped.h5"
    data = np.random.default_rng(4).normal(size=(ROWS, 3))
    with h5py.File(path, "w") as f:
        f["x"] = data

    def maps():
        with open("/proc/self/maps") as lines:
            return sum(line.rstrip("\n").endswith(str(path)) for line in lines)

    with h5py.File(path, "r") as f:
        reader = direct.Reader(str(path), f)
        assert maps() == 0
        request = Window(2000)
        rows = reader.window(f["x"], 100, 1100, request)
        assert maps() == 1
        part = rows[10:20][::2]
        request.array = rows = None
        assert maps() == 1
        np.testing.assert_array_equal(part, data[110:120:2])
        del part
        assert maps() == 0


def test_pages_that_cannot_be_mapped_raise_and_leave_nothing_to_unmap(monkeypatch):
    """Mapping a closed descriptor raises OSError naming why; the half-made map is let go
    quietly (no error from its unmapping)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        direct._Pages(fd, 0, 4096)
    gc.collect()
    assert unraisable == []


def test_missing_chunks_and_skipped_filters(tmp_path, thread_count):
    """Chunks never written read as the dataset's fill value; a chunk stored with its filters
    skipped (its filter mask) is read raw."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 3))
    path = tmp_path / "gaps.h5"
    with h5py.File(path, "w") as f:
        gaps = f.create_dataset("gaps", (ROWS, 3), np.float64, chunks=(1000, 3),
                                fillvalue=np.nan, compression="gzip")
        gaps[2000:4500] = x[2000:4500]
        gaps[9000:] = x[9000:]
        raw = f.create_dataset("raw", data=x, chunks=(1000, 3), compression="gzip",
                               shuffle=True)
        raw.id.write_direct_chunk((3000, 0), x[3000:4000].tobytes(), filter_mask=0b11)
    expected = np.full_like(x, np.nan)
    expected[2000:4500], expected[9000:] = x[2000:4500], x[9000:]
    with h5py.File(path, "r") as f:
        reader = direct.Reader(str(path), f)
        for lo, hi in RANGES:
            np.testing.assert_array_equal(reader.read(f["gaps"], lo, hi), expected[lo:hi])
            np.testing.assert_array_equal(reader.read(f["raw"], lo, hi), x[lo:hi])
            np.testing.assert_array_equal(f["gaps"][lo:hi], expected[lo:hi])  # h5py agrees


def test_what_is_left_to_h5py(tmp_path):
    """Storage io.direct cannot read itself is read by h5py, the same rows."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 3))
    path = tmp_path / "others.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("fletcher32", data=x, chunks=(10, 3), fletcher32=True)
        f.create_dataset("lzf", data=x, chunks=(10, 3), compression="lzf")
        f.create_dataset("chunked across columns", data=x, chunks=(10, 1))
        f.create_dataset("bool", data=x[:, 0] > 0)
        f.create_dataset("text", data=np.array(["a", "b"], object), dtype=h5py.string_dtype())
        f.create_dataset("compound", data=np.zeros(3, [("a", "f8"), ("b", "i4")]))
        f.create_dataset("unwritten", (100, 3), np.float64)
        layout = h5py.VirtualLayout((100, 3), np.float64)
        layout[:] = h5py.VirtualSource(f["fletcher32"])
        f.create_virtual_dataset("virtual", layout)
    with h5py.File(path, "r") as f:
        reader = direct.Reader(str(path), f)
        for name in ("fletcher32", "lzf", "chunked across columns", "bool", "text", "compound",
                     "unwritten", "virtual"):
            assert reader.storage(f[name]) is None, name
            assert reader.read(f[name], 0, 2) is None
        from segcli.io.hdf5 import read_rows

        np.testing.assert_array_equal(read_rows(str(path), f["lzf"], 5, 50, reader=reader),
                                      x[5:50])


def test_files_not_read_through_a_descriptor_are_left_to_h5py(tmp_path):
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(12.0).reshape(4, 3)
    with open(path, "rb") as raw, h5py.File(raw, "r") as f:
        assert direct.Reader(str(path), f).read(f["x"], 0, 4) is None
    with h5py.File(path, "r", driver="core") as f:
        assert direct.Reader(str(path), f).read(f["x"], 0, 4) is None


def _deflated_file(path, damage):
    """A segcli file whose forces are deflated in chunks of 64 rows, its second chunk's bytes
    passed through `damage`."""
    rng = np.random.default_rng(3)
    n_atoms = np.full(64, 4)
    forces = rng.normal(size=(256, 3))
    with h5py.File(path, "w") as f:
        f.attrs["format"], f.attrs["version"] = "segcli-batch", 1
        f["structures/n_atoms"] = n_atoms
        f.create_dataset("atoms/forces", data=forces, chunks=(64, 3), compression="gzip")
        info = f["atoms/forces"].id.get_chunk_info_by_coord((64, 0))
    with open(path, "r+b") as f:
        f.seek(info.byte_offset)
        stored = f.read(info.size)
        f.seek(info.byte_offset)
        f.write(damage(stored))
    return forces


@pytest.mark.parametrize("damage, needle", [
    (lambda b: b[:2] + bytes(len(b) - 2), "does not inflate"),
    (lambda b: zlib.compress(b"\0" * 100)[:len(b)].ljust(len(b), b"\0"), "holds 100 bytes"),
])
def test_damaged_chunk_is_one_line(tmp_path, damage, needle):
    path = tmp_path / "damaged.h5"
    _deflated_file(path, damage)
    for count in ("1", "2"):
        result = CliRunner().invoke(main, ["reduce", str(path), "sum", "forces", "--threads",
                                           count])
        assert result.exit_code == 1, result.output
        line, = result.stderr.strip().splitlines()
        assert line.startswith(f"Error: {path}: /atoms/forces has a chunk at byte ") \
            and needle in line, line
        assert "Traceback" not in result.output


def test_threads_give_the_same_results(tmp_path):
    """reduce over a deflated file, as a converted file stores it, with 1 and 4 threads and
    SEGCLI_THREADS: the same bits, the right sums."""
    rng = np.random.default_rng(4)
    n_atoms = rng.integers(0, 40, 3000)
    forces = rng.normal(size=(int(n_atoms.sum()), 3))
    source = write_batch(tmp_path / "in.h5", n_atoms, {"forces": forces})
    packed = tmp_path / "packed.h5"
    assert CliRunner().invoke(main, ["convert", str(source), "-o", str(packed),
                                     "--compression", "gzip"]).exit_code == 0
    outputs = []
    for args, env in ((["--threads", "1"], {}), (["--threads", "4"], {}),
                      ([], {"SEGCLI_THREADS": "3"})):
        result = CliRunner(env=env).invoke(main, ["reduce", str(packed), "sum", "forces",
                                                  "--chunk-atoms", "5000", "--format", "npy",
                                                  *args])
        assert result.exit_code == 0, result.output
        outputs.append(result.stdout_bytes)
    assert outputs[0] == outputs[1] == outputs[2]
    expected = np.add.reduceat(forces, np.concatenate([[0], np.cumsum(n_atoms)[:-1]]))
    expected[n_atoms == 0] = 0
    np.testing.assert_allclose(np.load(io.BytesIO(outputs[0])), expected, rtol=1e-12,
                               atol=1e-12)
    assert threads._state.count is None  # the command's --threads ends with it


def test_threads_option_and_shares(monkeypatch):
    result = CliRunner().invoke(main, ["reduce", "sample_data/metals.h5", "sum", "forces",
                                       "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output
    monkeypatch.setenv("SEGCLI_THREADS", "5")
    assert threads.count() == 5
    monkeypatch.setenv("SEGCLI_THREADS", "x")
    assert threads.count() == min(threads.MOST, threads.cores())
    monkeypatch.setattr(threads, "cores", lambda: 16)
    assert [threads.share(k) for k in (1, 2, 8, 32)] == [8, 8, 2, 1]
    threads.set_count(3)
    assert threads.share(2) == 1 and threads.count() == 3
    threads.set_count(None)
    with pytest.raises(ValueError):
        threads.set_count(0)
    assert os.environ["SEGCLI_THREADS"] == "x"  # set_count leaves the environment alone


def test_run_waits_for_every_task_then_raises_the_first_error():
    threads.set_count(3)
    done = []

    def fail(message, delay=0.0):
        def task():
            time.sleep(delay)
            done.append(message)
            raise ValueError(message)
        return task

    with pytest.raises(ValueError, match="first"):
        threads.run([fail("first", 0.05), lambda: done.append("ok"), fail("second")])
    assert sorted(done) == ["first", "ok", "second"]
