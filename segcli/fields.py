"""Fields as every layer speaks of them: what one holds, where several are present, and
the error for one that is not there.

    held(np.dtype(np.float32))  # "float32 values"
"""

import numpy as np

from segcli.errors import DataError

NUMERIC_KINDS = "biufc"
STRING = np.dtype(object)
"""The dtype of a string field: an object array of Python str."""


def held(dtype):
    """What a field of `dtype` holds, for messages: "strings" or e.g. "int32 values"."""
    return "strings" if dtype == STRING else f"{dtype} values"


def all_of(masks):
    """Where every mask (None: everywhere) is True; None when that is everywhere."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    both = np.logical_and.reduce(masks)
    return None if both.all() else both


def unknown_field(path, name, fields):
    """The DataError for `name`, which is not one of `fields` (a dict, or Fields saying why)."""
    why = getattr(fields, "conflicts", {}).get(name)
    if why is not None:
        return DataError(f"{path}: {why}")
    return DataError(f"{path}: no field '{name}'; its fields are: "
                     f"{', '.join(sorted(fields)) or '(none)'}")
