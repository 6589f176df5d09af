"""Reading and writing batches of structures: segcli HDF5, ASE-readable files, conformer groups,
and many files as one batch (a directory, a glob pattern, an @LIST: see open_inputs).

    with open_batch(path) as batch:
        for chunk in batch.iter_chunks(["forces", "energy"], chunk_atoms=1_000_000):
            chunk.atoms["forces"], chunk.structures["energy"], chunk.n_atoms
"""

import os

from segcli.errors import DataError
from segcli.io.core import Batch, Chunk, FieldInfo, check_readable
from segcli.io.multi import Layout, MultiBatch, expand_inputs, open_inputs
from segcli.io.writers import ResultWriter, convert

__all__ = ["Batch", "Chunk", "FieldInfo", "Layout", "MultiBatch", "ResultWriter", "convert",
           "expand_inputs", "open_batch", "open_inputs", "reads"]


def open_batch(path, input_format=None, counts=None):
    """Open a file in the first format of `segcli.io.formats.FORMATS` that recognises it (segcli
    HDF5, conformer-layout HDF5, an ASE database, extended XYZ, any file ASE reads, ...), or
    in `input_format` (a name of segcli.io.formats.named) whatever its content. `counts`: its
    n_atoms, read by an earlier open of the unchanged file (see Layout.open), which a format
    that can takes as they are.

    Raises DataError naming the file and the problem when it is none of these.
    """
    from segcli.io.formats import detect, named

    path = os.fspath(path)
    check_readable(path)
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a file")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file (a pipe, FIFO or device); segcli reads "
                        "files it can seek in: save the stream to a file first")
    fmt = detect(path) if input_format is None else named(input_format)
    if fmt is None:
        raise DataError(f"{path}: neither HDF5 nor a file format that ASE can read "
                        "(`--input-format NAME` names its format)")
    batch = fmt.open(path) if counts is None or not fmt.takes_counts else \
        fmt.open(path, counts=counts)
    batch.input_format = input_format
    return batch


def reads(path):
    """Whether `path` is a non-empty regular file that a reader recognises as structures by its
    content; what a directory given as FILE is filtered by."""
    from segcli.io.formats import recognised

    path = os.fspath(path)
    return os.path.isfile(path) and os.path.getsize(path) > 0 and recognised(path)
