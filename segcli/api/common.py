"""What every function of segcli.api does with its inputs, its selection and its output
before computing: the files `inputs` stands for, the structures chosen, the checks that
refuse a call (ArgumentError) or bad data (DataError) before any work."""

import contextlib
import os

import numpy as np

from segcli.errors import ArgumentError, DataError, literal


def input_name(inputs):
    """How messages name `inputs`: as given (a path, a glob, @LIST), several joined by
    spaces."""
    if isinstance(inputs, (list, tuple)):
        return " ".join(os.fspath(i) for i in inputs)
    return os.fspath(inputs)


def input_paths(inputs, in_place=False):
    """The files `inputs` stands for (a path, glob, directory or @LIST, see
    segcli.io.expand_inputs, or a list of those); ArgumentError when `in_place` meets more than
    one, or a stream read through a temporary copy (results stored there would be lost);
    DataError when it meets a file this process may not write."""
    from segcli.io import expand_inputs
    from segcli.io.multi import is_stream

    many = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    if not many:
        raise ArgumentError("{0} names no file", "inputs")
    if in_place and any(is_stream(os.fspath(i)) for i in many):
        raise ArgumentError(f"{{0}} stores results in {{1}} itself; {literal(input_name(inputs))} "
                            "is a stream (stdin, a pipe or a /proc file), whose copy is read: "
                            "use {2}", "in_place", "inputs", "output")
    paths = [path for i in many for path in expand_inputs(os.fspath(i))]
    if in_place and len(paths) > 1:
        raise ArgumentError(f"{{0}} adds to one file; {literal(input_name(inputs))} is "
                            f"{len(paths)} files", "in_place")
    if in_place and not os.access(paths[0], os.W_OK):
        raise DataError(f"{paths[0]}: cannot store results in it (Permission denied: it is "
                        "read-only to this user); use -o")
    return paths


@contextlib.contextmanager
def read_inputs(paths, name, in_place=False, input_format=None):
    """The batch of `paths` (segcli.io.open_inputs, named `name`, read as `input_format` if
    given); with `in_place`, read under the lock of the file the results go into, so that no
    other writer replaces it between this read and that write."""
    from segcli.io import open_inputs
    from segcli.io.outputs import locked

    with (locked(paths[0]) if in_place else contextlib.nullcontext(),
          open_inputs(paths, name=name, input_format=input_format) as batch):
        yield batch


def refuse_output_among_inputs(output, inputs, hint):
    """ArgumentError when the file `output` names is one of the `inputs` (`hint` says what to
    do)."""
    for path in inputs:
        if output and os.path.exists(output) and os.path.exists(path) and \
                os.path.samefile(output, path):
            raise ArgumentError(f"{{0}} {literal(output)} is {{1}} itself ({literal(path)}); "
                                f"{literal(hint)}", "output", "inputs")


def check_result_name(name):
    """ArgumentError unless `name` is a result name: NAME or GROUP/NAME, none of its parts
    empty, `.`, `..` or holding a NUL."""
    if not isinstance(name, str) or not name or any(part in ("", ".", "..") or "\0" in part
                                                    for part in name.split("/")):
        raise ArgumentError(f"{{0}}: {literal(repr(name))} is not a result name (NAME or "
                            "GROUP/NAME)", "name")


def refuse_structures_in_place(in_place, structures):
    """ArgumentError when `in_place` (a result for every structure) meets `structures`."""
    if in_place and structures:
        raise ArgumentError("{0} stores a result for every structure; {1} cannot be used with "
                            "it", "in_place", "structures")


def structure_slice(structures):
    """`structures` (None, an index, a slice or a range of step 1) as a slice; ArgumentError
    for anything else."""
    if structures is None or (isinstance(structures, slice) and structures.step in (None, 1)):
        return structures
    if isinstance(structures, range) and structures.step == 1:
        return slice(structures.start, structures.stop)
    if isinstance(structures, (int, np.integer)) and not isinstance(structures, bool):
        return slice(int(structures), int(structures) + 1 or None)
    raise ArgumentError(f"{{0}} must be an index, a slice or a range, not "
                        f"{literal(repr(structures))}", "structures")


def selection(batch, name, structures):
    """The slice of `batch`'s structures that `structures` (a slice) selects, or all, with
    non-negative bounds; DataError when it selects none of a file that has some."""
    start, stop, _ = (structures or slice(None)).indices(batch.n_structures)
    if structures and start >= stop:
        given = ":".join("" if v is None else str(v) for v in (structures.start, structures.stop))
        raise DataError(f"{name}: --structures {given} selects no structure "
                        f"(the file has {batch.n_structures})")
    return slice(start, max(start, stop))


def names_hdf5(output):
    """Whether the file name `output` (None: none) is a segcli HDF5 file's: .h5, .hdf5 or no
    suffix."""
    return os.path.splitext(os.path.basename(os.fspath(output or "")))[1].lower() in \
        ("", ".h5", ".hdf5")


def check_output_place(output):
    """DataError, before any computation, when `output` names a file in a directory that is
    missing or not writable (the writer would find it only at the end of the setup)."""
    if output is None:
        return
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        reason = "Not a directory" if os.path.exists(directory) else "No such file or directory"
        raise DataError(f"{output}: cannot write there ({reason})")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(f"{output}: cannot write there (Permission denied)")


def where_conditions(where):
    """The segcli.curate.selection.Condition of each of `where`: one 'NAME OP VALUE' text, or a list
    of texts or Conditions (all must hold); ArgumentError for one that does not parse."""
    from segcli.curate.selection import Condition, parse_condition

    if not where:
        return ()
    texts = [where] if isinstance(where, (str, Condition)) else list(where)
    for text in texts:
        if not isinstance(text, (str, Condition)):
            raise TypeError(f"where= takes 'NAME OP VALUE' strings, got {type(text).__name__}")
    try:
        return tuple(t if isinstance(t, Condition) else parse_condition(t) for t in texts)
    except ValueError as err:
        raise ArgumentError(f"{{0}}: {literal(err)}", "where") from None


def where_selection(batch, name, where, structures, needed=False, notify=None):
    """(S,) bool: the structures of `batch` in the slice `structures` where every condition
    of `where` holds (None without conditions). When none does: DataError if they are
    `needed`, else `notify` (if given) is told so."""
    from segcli.curate.selection import where_mask

    if not where:
        return None
    keep = where_mask(batch, where, structures=structures)
    if not keep.any():
        start, stop, _ = structures.indices(batch.n_structures)
        message = (f"{name}: --where {' --where '.join(repr(c.text) for c in where)} selects "
                   f"none of the {max(stop - start, 0)} structure(s)")
        if needed:
            raise DataError(f"{message}; nothing to compute")
        if notify is not None:
            notify(message)
    return keep


def shard_pair(shard):
    """`shard` as (I, N): from (I, N), or from "I/N" or "auto" (segcli.shards.parse_shard);
    ArgumentError for another."""
    from segcli.shards import parse_shard

    if shard is None or isinstance(shard, tuple):
        if shard is not None and not (len(shard) == 2 and 0 <= shard[0] < shard[1]):
            raise ArgumentError(f"{{0}} must be (I, N) with 0 <= I < N, not {literal(shard)}",
                                "shard")
        return shard
    if not isinstance(shard, str):
        raise TypeError(f"shard= takes 'I/N', 'auto' or (I, N), got {type(shard).__name__}")
    try:
        return parse_shard(shard)
    except ValueError as err:
        raise ArgumentError(f"{{0}}: {literal(err)}", "shard") from None


def shard_output(output, shard):
    """`output` for `shard` (I, N): {shard} replaced (see segcli.shards.part_path), its
    directory made if missing (the tasks of an array job race to make it)."""
    if output and "{shard}" in output and not shard:
        raise ArgumentError(f"{{0}} {literal(output)} has {{{{shard}}}} in it, which {{1}} I/N "
                            "fills; give {1} or another name", "output", "shard")
    if not (shard and output):
        return output
    from segcli.shards import part_path

    output = part_path(output, *shard)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    return output


def shard_selection(batch, name, structures, shard):
    """The leaf boundaries (see segcli.shards.shard_of) of the structures that `structures`
    and `shard` select in `batch`, and the attributes that tie the output to them: the range
    `structures`, the input's `source_fingerprint` and `source_structures` (its count) and, for
    a shard, `shard` and `selection` (the range of all its shards)."""
    from segcli.shards import fingerprint, shard_of

    start, stop, _ = selection(batch, name, structures).indices(batch.n_structures)
    leaves = shard_of(batch.n_atoms[start:max(start, stop)], start, shard)
    attrs = {"structures": f"{leaves[0]}:{leaves[-1]}",
             "source_fingerprint": fingerprint(batch.sources, batch.n_atoms),
             "source_structures": batch.n_structures}
    if shard:
        attrs.update(shard=f"{shard[0]}/{shard[1]}", selection=f"{start}:{max(start, stop)}")
    return leaves, attrs


def check_cluster_usage(shard, scheduler, in_place):
    """ArgumentError for `shard` with `scheduler` or `in_place`."""
    if shard and scheduler:
        raise ArgumentError("{0} runs one shard here; {1} runs them all on a cluster: give one "
                            "of them", "shard", "scheduler")
    if shard and in_place:
        raise ArgumentError("{0} writes a part of the result; {1} stores a result for every "
                            "structure: use {2} 'part-{{shard}}.h5' and segcli merge",
                            "shard", "in_place", "output")


@contextlib.contextmanager
def on_cluster(scheduler):
    """A dask.distributed Client for `scheduler` (None without it), closed afterwards;
    ArgumentError without the cluster extra."""
    if not scheduler:
        yield None
        return
    import importlib.util

    if importlib.util.find_spec("distributed") is None:
        raise ArgumentError("{0} needs dask.distributed: pip install 'segcli[cluster]'",
                            "scheduler")
    from segcli.cluster import cluster_client

    with cluster_client(scheduler) as client:
        yield client
