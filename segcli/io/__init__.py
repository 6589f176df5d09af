"""Reading and writing batches of structures: segcli HDF5, ASE-readable files, conformer groups,
and many files as one batch (a directory, a glob pattern, an @LIST: see open_inputs).

    with open_batch(path) as batch:
        for chunk in batch.iter_chunks(["forces", "energy"], chunk_atoms=1_000_000):
            chunk.atoms["forces"], chunk.structures["energy"], chunk.n_atoms
"""

import os

from segcli.errors import DataError
from segcli.io.core import Batch, Chunk, FieldInfo
from segcli.io.multi import Layout, MultiBatch, expand_inputs, open_inputs
from segcli.io.writers import ResultWriter, convert

__all__ = ["Batch", "Chunk", "FieldInfo", "Layout", "MultiBatch", "ResultWriter", "convert",
           "expand_inputs", "open_batch", "open_inputs", "reads"]


def open_batch(path):
    """Open a segcli HDF5 file, a conformer-layout HDF5 file or any file ASE reads.

    Raises DataError naming the file and the problem when it is none of these.
    """
    import h5py

    from segcli.io.asefiles import AseBatch, ase_format
    from segcli.io.core import EmptyBatch
    from segcli.io.hdf5 import ConformerBatch, SegcliBatch

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a file")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file (a pipe, FIFO or device); segcli reads "
                        "files it can seek in: save the stream to a file first")
    if os.path.getsize(path) == 0:
        return EmptyBatch(path)
    if not h5py.is_hdf5(path):
        return AseBatch(path, ase_format(path))
    try:
        h5 = h5py.File(path, "r", rdcc_nbytes=0)
    except OSError as err:
        raise DataError(f"{path}: truncated or corrupt HDF5 file ({err})") from err
    try:
        return SegcliBatch(path, h5) if "format" in h5.attrs else ConformerBatch(path, h5)
    except (OSError, KeyError) as err:
        h5.close()
        raise DataError(f"{path}: corrupt HDF5 file ({err})") from err
    except BaseException:
        h5.close()
        raise


def reads(path):
    """Whether `path` is a regular file that segcli recognises as structures by its content or
    name (HDF5, or a format ASE reads); what a directory given as FILE is filtered by."""
    import h5py

    from segcli.io.asefiles import ase_format

    path = os.fspath(path)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return False
    if h5py.is_hdf5(path):
        return True
    try:
        ase_format(path)
    except DataError:
        return False
    return True
