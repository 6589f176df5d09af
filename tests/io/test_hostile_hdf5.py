"""Untrusted segcli HDF5 inputs: metadata of the wrong kind, lying atom counts, unwritten or
unmapped data, oversized attributes and damaged bytes each get one line naming the file and
the object from every command that reads the file, and leave no output."""

import re
import resource
import subprocess
import sys

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main
from segcli.io.core import _first_singular

N_ATOMS = [3, 2, 4]
FORCES = np.arange(27.0).reshape(9, 3)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def commands(path, out):
    """Every command that reads FILE, writing (where it writes) to `out`."""
    return [("info", path), ("info", "--json", path), ("convert", path, "-o", out),
            ("reduce", path, "sum", "forces"), ("grad", path, "sum", "forces", "-o", out),
            ("stats", path, "forces"), ("select", path, "-o", out, "--where", "energy < 10")]


def assert_refused(path, *needles):
    """Each command exits 1 with one line naming the file and `needles`, no traceback and no
    output file."""
    out = path.with_name("out.h5")
    for args in commands(path, out):
        result = run(*args)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 1, (args, result.output)
        assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), (args, result.stderr)
        assert "Traceback" not in result.output
        for needle in needles:
            assert needle in lines[0], (args, needle, lines[0])
        assert not out.exists(), args


def batch(path):
    return write_batch(path, N_ATOMS, {"forces": FORCES}, {"energy": np.arange(3.0)})


def replace(f, name, data, **kwargs):
    del f[name]
    f.create_dataset(name, data=data, **kwargs)


def virtual(f, tmp_path, source_name, dataset, rows):
    """/atoms/forces as a virtual dataset reading `rows` rows of `dataset` of tmp_path/src.h5
    (written with FORCES), `source_name` as the file name it records."""
    with h5py.File(tmp_path / "src.h5", "w") as src:
        src["forces"] = FORCES
    layout = h5py.VirtualLayout(shape=FORCES.shape, dtype=FORCES.dtype)
    layout[:rows] = h5py.VirtualSource(source_name, dataset, shape=FORCES.shape)[:rows]
    del f["atoms/forces"]
    f.create_virtual_dataset("atoms/forces", layout)


def link(group, raw_name, target):
    """A hard link named `raw_name` (bytes, any) in `group` to the object at `target`."""
    group.id.links.create_hard(raw_name, group.file.id, target.encode())


def no_atom_fields(f):
    del f["atoms/forces"]


BAD_UTF8 = h5py.string_dtype("utf-8", None)
HOSTILE = {
    # metadata of the wrong kind
    "array version": (lambda f, _: f.attrs.__setitem__("version", [1, 1]), ["version [1, 1]"]),
    "array format": (lambda f, _: f.attrs.__setitem__("format", ["segcli-batch", "x"]),
                     ["attribute format is"]),
    "opaque format": (lambda f, _: f.attrs.create("format", np.void(b"\xff\xfe")),
                      ["attribute format of /", "opaque"]),
    "/atoms a dataset": (lambda f, _: replace(f, "atoms", np.zeros(3)),
                         ["/atoms is a dataset, not a group"]),
    "/structures a dataset": (lambda f, _: replace(f, "structures", np.zeros(3)),
                              ["/structures is a dataset"]),
    "/present a dataset": (lambda f, _: f.create_dataset("present", data=np.zeros(3)),
                           ["/present is a dataset"]),
    "field a group": (lambda f, _: f.create_group("atoms/charges"), ["/atoms/charges is a group"]),
    "non-UTF-8 attribute": (lambda f, _: f["atoms/forces"].attrs.create(
        "units", b"eV\xff", dtype=BAD_UTF8), ["attribute units of /atoms/forces", "UTF-8"]),
    "non-UTF-8 per": (lambda f, _: (f.create_dataset("results/r", data=np.zeros(3)).attrs.create(
        "per", b"atom\xff", dtype=BAD_UTF8)), ["attribute per of /results/r", "UTF-8"]),
    "array per": (lambda f, _: f.create_dataset("results/r", data=np.zeros(3)).attrs.__setitem__(
        "per", ["structure", "atom"]), ["/results/r has per=['structure', 'atom']"]),
    "non-UTF-8 name": (lambda f, _: link(f["atoms"], b"bad\xffname", "atoms/forces"),
                       ["b'atoms/bad\\xffname'", "UTF-8"]),
    "object reference": (lambda f, _: f["atoms/forces"].attrs.__setitem__(
        "ref", f["structures/energy"].ref), ["attribute ref of /atoms/forces holds references"]),
    "region reference": (lambda f, _: f.attrs.__setitem__(
        "region", f["atoms/forces"].regionref[0:2]), ["attribute region of / holds references"]),
    "compound field": (lambda f, _: f.create_dataset(
        "atoms/pair", data=np.zeros(9, [("a", "f8"), ("b", "i4")])), ["/atoms/pair", "compound"]),
    "enum field": (lambda f, _: f.create_dataset(
        "structures/color", data=np.zeros(3, "i1"), dtype=h5py.enum_dtype({"RED": 0, "BLUE": 1})),
        ["/structures/color", "enum"]),
    # lying atom counts
    "n_atoms summing past int64": (lambda f, _: (no_atom_fields(f), replace(
        f, "structures/n_atoms", [2 ** 62] * 3)), ["n_atoms sums to more than"]),
    "negative n_atoms": (lambda f, _: replace(f, "structures/n_atoms", [5, -2, 6]),
                         ["n_atoms[1] is -2"]),
    "n_atoms past int64": (lambda f, _: replace(
        f, "structures/n_atoms", np.array([2 ** 63 + 5, 1, 1], np.uint64)),
        ["n_atoms[0] is 9223372036854775813"]),
    "float n_atoms": (lambda f, _: replace(f, "structures/n_atoms", [3.0, 2.0, 4.0]),
                      ["n_atoms must be a 1-D integer array, not float64"]),
    "string n_atoms": (lambda f, _: replace(f, "structures/n_atoms", [b"3", b"2", b"4"]),
                       ["n_atoms must be a 1-D integer array"]),
    "rows not n_atoms": (lambda f, _: replace(f, "structures/n_atoms", [3, 2, 5]),
                         ["/atoms/forces has 9 rows, but /structures/n_atoms sums to 10"]),
    # data that is not there: HDF5 would read zeros
    "sparse 10**12 atoms": (lambda f, _: (replace(f, "structures/n_atoms", [10 ** 12, 0, 0]),
                                          f.__delitem__("atoms/forces"),
                                          f.create_dataset("atoms/forces", shape=(10 ** 12, 3),
                                                           dtype="f8", chunks=(4096, 3))),
                            ["/atoms/forces stores 0 of the 3000000000000 values"]),
    "sparse, marked present": (lambda f, tmp: (HOSTILE["sparse 10**12 atoms"][0](f, tmp),
                                               f.create_dataset("present/forces",
                                                                data=np.ones(3, bool))),
                               ["/atoms/forces stores 0 of the 3000000000000 values"]),
    "unwritten contiguous": (lambda f, _: (f.__delitem__("atoms/forces"), f.create_dataset(
        "atoms/forces", shape=(9, 3), dtype="f8")), ["/atoms/forces stores 0 of the 27 values"]),
    "virtual, source missing": (lambda f, tmp: virtual(f, tmp, "gone.h5", "forces", 9),
                                ["/atoms/forces is a virtual dataset reading gone.h5"]),
    "virtual, dataset missing": (lambda f, tmp: virtual(f, tmp, "src.h5", "nope", 9),
                                 ["reading nope of src.h5, which has no such dataset"]),
    "virtual, rows unmapped": (lambda f, tmp: virtual(f, tmp, "src.h5", "forces", 4),
                               ["sources cover 12 of its 27 elements"]),
    # attributes too large to read
    "large fixed-length attribute": (lambda f, _: f.create_group("notes").attrs.__setitem__(
        "text", np.bytes_(b"x" * (2 << 20))), ["attribute text of /notes takes 2097152 bytes"]),
    "large text attribute": (lambda f, _: f.attrs.__setitem__("note", "x" * (2 << 20)),
                             ["attribute note of / holds 2097152 bytes of text"]),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_metadata_is_refused_in_one_line(tmp_path, case):
    path = batch(tmp_path / "batch.h5")
    damage, needles = HOSTILE[case]
    with h5py.File(path, "r+", libver=("v108", "latest")) as f:  # attributes of any size
        damage(f, tmp_path)
    assert_refused(path, *needles)


@pytest.mark.parametrize("offset", [112, 140, 700, 854, 861, 1008, 1302, 1869, 2058])
def test_damaged_metadata_is_named_by_the_reader(tmp_path, offset):
    """A byte of the metadata (superblock, object headers, B-trees, heaps) flipped: every
    command says the file is damaged."""
    path = batch(tmp_path / "batch.h5")
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    assert_refused(path, "damaged HDF5 file")


def test_a_structure_larger_than_memory_is_refused(tmp_path):
    """n_atoms claiming 10**12 atoms in a file without per-atom data: count would need ids for
    every atom at once, so the structure is named, not allocated."""
    path = write_batch(tmp_path / "lying.h5", [10 ** 12, 3], {}, {"energy": np.zeros(2)})
    result = run("reduce", path, "count", "--chunk-atoms", 1000)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert f"{path}: structure 0 has 1000000000000 atoms" in result.stderr
    assert result.stdout == ""  # not even the csv header: the error comes before any output


def test_empty_attributes_are_read(tmp_path):
    """Attributes of no elements (an op without fields lists none) have no storage: read."""
    path = write_batch(tmp_path / "empty.h5", N_ATOMS, {"forces": FORCES})
    with h5py.File(path, "a") as f:
        f.attrs["nothing"] = np.zeros(0)
        f["results/n"] = np.ones(3)
        f["results/n"].attrs.update(per="structure", fields=np.array([], h5py.string_dtype()))
    result = run("info", "--json", path)
    assert result.exit_code == 0, result.output
    assert '"fields": []' in result.stdout


def test_results_reached_through_links_are_results(tmp_path):
    """A result under a second name (a hard or soft link, a soft link to its group) is listed,
    read and converted as the result itself; a link back to /results ends."""
    path = write_batch(tmp_path / "links.h5", N_ATOMS, {"forces": FORCES})
    with h5py.File(path, "a") as f:
        f["results/a"] = np.arange(3.0)
        f["results/a"].attrs["per"] = "structure"
        f["results/hard"] = f["results/a"]
        f["results/soft"] = h5py.SoftLink("/results/a")
        f["results/g/d"] = FORCES * 2
        f["results/g/d"].attrs["per"] = "atom"
        f["results/loop"] = h5py.SoftLink("/results")
    result = run("info", path)
    assert result.exit_code == 0, result.output
    for name in ("a", "hard", "soft", "g/d"):
        assert f"\n  {name}  " in result.stdout.split("results:")[1], (name, result.stdout)
    result = run("convert", path, "-o", tmp_path / "out.h5", "--quiet")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "out.h5") as f:
        for name in ("a", "hard", "soft"):
            np.testing.assert_array_equal(f[f"results/{name}"][()], np.arange(3.0))
        np.testing.assert_array_equal(f["results/g/d"][()], FORCES * 2)


def loop_heap(path, text):
    """Damages the global heap collection holding `text` (bytes) as HDF5 (2.0.0 included)
    cannot survive: its free-space object claims 0 bytes, so that walking the collection
    never moves on. Returns the collection's byte offset."""
    data = bytearray(path.read_bytes())
    start = data.rfind(b"GCOL", 0, data.find(text))
    size = int.from_bytes(data[start + 8:start + 16], "little")
    position = 16
    while True:  # to the free-space object, index 0
        index = int.from_bytes(data[start + position:start + position + 2], "little")
        object_size = int.from_bytes(data[start + position + 8:start + position + 16], "little")
        if index == 0:
            break
        position += 16 + (object_size + 7) // 8 * 8
        assert position < size
    data[start + position + 8:start + position + 16] = bytes(8)
    path.write_bytes(bytes(data))
    return start


def refused_without_looping(path, *args):
    """`segcli ARGS PATH` in a child process (a loop inside HDF5 holds the GIL: it could not
    be stopped in this one) exits 1 within a minute, saying why in one line."""
    child = subprocess.run([sys.executable, "-c", "from segcli.cli import main; main()",
                            *map(str, args), str(path)], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 1, child.stderr
    assert child.stderr.strip().count("\n") == 0, child.stderr
    return child.stderr


@pytest.mark.parametrize("where", ["root attribute", "field attribute", "string field",
                                   "chunked gzip string field", "result string field"])
def test_a_global_heap_that_hdf5_would_walk_forever_is_refused(tmp_path, where):
    """A damaged collection of variable-length strings (fuzz finding 4: HDF5 loops forever
    reading it, in H5HG__cache_heap_deserialize) is walked by segcli first and refused,
    naming the file and the collection, by the commands that read it."""
    path = tmp_path / "batch.h5"
    labels = np.array([f"label-{i}" for i in range(3)], dtype=h5py.string_dtype())
    text = {"root attribute": b"segcli-batch", "field attribute": b"units-of-forces"}.get(
        where, b"label-1")
    with h5py.File(batch(path), "a") as f:
        if where == "field attribute":
            f["atoms/forces"].attrs["units"] = "units-of-forces"
        elif where == "string field":
            f["structures/label"] = labels
        elif where == "chunked gzip string field":
            f.create_dataset("structures/label", data=labels, chunks=(2,), compression="gzip",
                             shuffle=True)
        elif where == "result string field":
            f["results/label"] = labels
            f["results/label"].attrs["per"] = "structure"
    start = loop_heap(path, text)
    for command in (["info"], ["convert", "-o", tmp_path / "out.h5"]):
        message = refused_without_looping(path, *command)
        assert f"{path}: damaged HDF5 file (in the global heap collection at byte {start}" \
            in message
    assert not (tmp_path / "out.h5").exists()


def test_a_part_whose_global_heap_loops_is_refused_by_merge(tmp_path):
    """merge reads its parts' attributes through the same check."""
    path = batch(tmp_path / "batch.h5")
    parts = [tmp_path / f"part{i}.h5" for i in range(2)]
    for i, part in enumerate(parts):
        result = run("reduce", path, "sum", "forces", "--shard", f"{i}/2", "-o", part)
        assert result.exit_code == 0, result.output
    start = loop_heap(parts[1], b"segcli-batch")
    message = refused_without_looping(parts[1], "merge", parts[0], "-o", tmp_path / "m.h5")
    assert f"{parts[1]}: damaged HDF5 file (in the global heap collection at byte {start}" \
        in message
    assert not (tmp_path / "m.h5").exists()


def test_a_global_heap_collection_that_hdf5_reads_in_two_parts_is_walked_whole(tmp_path):
    """A collection claiming more than HDF5's first read of it (4 KiB) is read by HDF5 in two
    parts (fuzz finding 25): segcli walks it whole, from the file, and refuses the object
    past the first part that would have HDF5 loop."""
    path = batch(tmp_path / "batch.h5")
    with h5py.File(path, "a") as f:
        f["atoms/forces"].attrs["units"] = "units-of-forces"
    data = bytearray(path.read_bytes())
    start = data.rfind(b"GCOL", 0, data.find(b"units-of-forces"))
    size = int.from_bytes(data[start + 8:start + 16], "little")
    assert (size, start + size) == (4096, len(data))  # the last, 4 KiB long
    data[start + 8:start + 16] = (2 * size).to_bytes(8, "little")  # then zeros: objects of 0
    path.write_bytes(data + bytes(size))
    message = refused_without_looping(path, "info")
    assert message == f"Error: {path}: damaged HDF5 file (in the global heap collection at " \
                      f"byte {start}, object 0 at byte {start + size} claims 0 bytes of the " \
                      f"{size} left)\n"


@pytest.mark.parametrize("group", ["/", "/structures", "/atoms"])
def test_a_group_whose_local_heap_free_list_loops_is_refused(tmp_path, group):
    """A group's link names lie in a local heap, whose list of free blocks HDF5 follows,
    allocating a node a step, until it ends (fuzz finding 25: one that loops ran to 10 GB):
    segcli follows it first, and refuses it."""
    path = batch(tmp_path / "batch.h5")
    data = bytearray(path.read_bytes())
    with h5py.File(path) as f:
        names = [name.encode() for name in f[group]]
    for start in (m.start() for m in re.finditer(b"HEAP", data)):
        size, head, segment = (int.from_bytes(data[start + at:start + at + 8], "little")
                               for at in (8, 16, 24))
        if all(name + b"\0" in data[segment:segment + size] for name in names):
            break
    assert head + 16 <= size
    data[segment + head:segment + head + 8] = head.to_bytes(8, "little")  # the next is itself
    path.write_bytes(data)
    message = refused_without_looping(path, "info")
    assert message == f"Error: {path}: damaged HDF5 file (the free list of the local heap at " \
                      f"byte {start} loops)\n"


def test_text_in_every_storage_is_read_back(tmp_path):
    """Strings stored compact, contiguous, chunked with deflate (read for their heap IDs) or
    with lzf (read through HDF5), after a user block, an empty string among them, pass the
    heap check and read back as written."""
    path = tmp_path / "text.h5"
    labels = np.array(["", "ä-label", "x" * 5000], dtype=h5py.string_dtype())
    with h5py.File(path, "w", userblock_size=512) as f:
        f.attrs["format"] = "segcli-batch"
        f.attrs["version"] = 1
        f["structures/n_atoms"] = np.array(N_ATOMS, np.int64)
        f["atoms/forces"] = FORCES
        compact = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        compact.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f["structures"].id, b"compact",
                        h5py.h5t.py_create(h5py.string_dtype(), logical=True),
                        h5py.h5s.create_simple((3,)), compact)
        f["structures/compact"][:] = labels
        f["structures/contiguous"] = labels
        f.create_dataset("structures/chunked", data=labels, chunks=(1,), compression="gzip",
                         shuffle=True, maxshape=(None,))
        f.create_dataset("structures/lzf", data=labels, chunks=(2,), compression="lzf")
    result = run("convert", path, "-o", tmp_path / "out.h5")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "out.h5") as out:
        for name in ("compact", "contiguous", "chunked", "lzf"):
            assert out[f"structures/{name}"].asstr()[:].tolist() == labels.tolist(), name


def patch_first_string(path, name, field, value):
    """Overwrites `field` ("length", "address" or "index") of the first heap ID of the
    contiguous string dataset `name` (its stored bytes: length u32, address u64, index u32)."""
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset()
    at = {"length": 0, "address": 4, "index": 12}[field]
    size = 8 if field == "address" else 4
    data = bytearray(path.read_bytes())
    data[offset + at:offset + at + size] = value.to_bytes(size, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("field, value, needle", [
    ("length", 0xFF000002, "holds a string of 4278190082 bytes whose object 3 in the global "
                           "heap collection at byte"),
    ("index", 999, "holds a string of 7 bytes whose object 999"),
    ("address", 1 << 40, "holds a string in a global heap collection at byte 1099511627776, "
                         "where the file holds none"),
    ("address", (1 << 64) - 2, "holds a string in a global heap collection at byte "
                               "18446744073709551614, where the file holds none"),
])
def test_a_string_that_claims_more_than_its_heap_object_is_refused_before_hdf5_allocates(
        tmp_path, field, value, needle):
    """A damaged heap ID of a string field: HDF5 would allocate the length it claims (up to
    4 GiB per string) before finding that its object is smaller or missing."""
    path = batch(tmp_path / "batch.h5")
    with h5py.File(path, "a") as f:
        f["structures/label"] = np.array(["label-0", "label-1", "label-2"],
                                         dtype=h5py.string_dtype())
    patch_first_string(path, "structures/label", field, value)
    assert_refused(path, "damaged HDF5 file (/structures/label " + needle)


def test_a_dataset_claiming_more_rows_than_memory_is_one_line(tmp_path):
    """n_atoms of 2^44 rows, never written: refused before a row is read; and rows that
    would take more memory than there is are a DataError, not a MemoryError."""
    from segcli.errors import DataError
    from segcli.io.hdf5 import read_rows

    path = tmp_path / "batch.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="segcli-batch", version=1)
        f.create_dataset("structures/n_atoms", shape=(1 << 44,), maxshape=(None,),
                         dtype=np.int64, chunks=(1 << 20,))
        f.create_group("atoms")
    assert_refused(path, "/structures/n_atoms stores 0 of the 17592186044416 values")
    with h5py.File(path) as f, pytest.raises(DataError, match="/structures/n_atoms rows "
                                             "0:17592186044416 take more memory than this"):
        read_rows(path, f["structures/n_atoms"], 0, 1 << 44)


@pytest.mark.parametrize("cell", [[[1, 0, 0], [2, 0, 0], [0, 0, 1]],
                                  [[1, 1, 0], [0, 1, 1], [1, 2, 1]]])
def test_a_cell_that_cannot_be_inverted_is_named_by_scaled_positions(tmp_path, cell):
    path = write_batch(tmp_path / "cells.h5", [1, 2], {"positions": np.ones((3, 3))},
                       {"cell": np.array([np.eye(3), cell], float),
                        "pbc": np.ones((2, 3), bool)})
    result = run("reduce", path, "sum", "scaled_positions", "--device", "cpu")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith(f"Error: {path}: structures 0 to 1: a cell that cannot be "
                                    "inverted (")


@pytest.mark.parametrize("cell", [[[np.nan, 0, 0], [0, 0, 0], [0, 0, 1]],
                                  [[np.inf, 1, 0], [0, 1, 0], [0, 0, 0]]])
def test_a_cell_not_finite_is_named_when_positions_are_scaled(tmp_path, cell):
    """A cell holding NaN or infinity beside a zero vector, which completing as ASE does
    cannot (its SVD fails: fuzz finding 27), is named in one line by every reader of the
    scaled positions."""
    path = write_batch(tmp_path / "cells.h5", [1, 2], {"positions": np.ones((3, 3))},
                       {"cell": np.array([np.eye(3), cell], float),
                        "pbc": np.ones((2, 3), bool)})
    cells = np.array([np.eye(3), cell, np.zeros((3, 3))])
    assert _first_singular(cells) == 1  # where the completion of zero vectors would raise
    assert _first_singular(np.array([np.eye(3), np.eye(3), [[1, 0, 0], [2, 0, 0], [0, 0, 1]]]))\
        == 2
    result = run("reduce", path, "sum", "scaled_positions", "--device", "cpu")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"Error: {path}: ") and "structure 1" in result.stderr


@pytest.mark.parametrize("owner", ["/", "/structures/n_atoms"])
def test_an_attribute_whose_heap_id_claims_gigabytes_is_refused_before_hdf5_allocates(
        tmp_path, owner):
    """An attribute's heap ID lies in its object header: the text claiming 3.75 GiB is read
    with the address space capped, so HDF5's allocation fails at once, and the other
    attributes, and every later allocation, are as before."""
    path = batch(tmp_path / "batch.h5")
    text = "a text of 31 bytes, said once.."
    with h5py.File(path, "a") as f:
        f[owner].attrs["note"] = text
    data = bytearray(path.read_bytes())
    collections = [m.start() for m in re.finditer(b"GCOL", data)]
    heap_id, = (m.start() for m in re.finditer(len(text).to_bytes(4, "little") + b"(.{8})", data,
                                                re.S)
                if int.from_bytes(m.group(1), "little") in collections)
    data[heap_id:heap_id + 4] = (0xF0000000).to_bytes(4, "little")
    path.write_bytes(data)
    assert_refused(path, f"attribute note of {owner} claims more text than")
    limits = resource.getrlimit(resource.RLIMIT_AS)
    with h5py.File(path) as f:
        assert f["structures/n_atoms"][:].tolist() == N_ATOMS
    assert resource.getrlimit(resource.RLIMIT_AS) == limits
