"""segcli's commands as Python functions (docs/api.md): each takes what the command takes,
under the same names, and returns what it computed. Each name is imported from its module
when first asked for, so that a command importing one module of the API loads no other."""

import importlib

_MODULES = {
    "check_ops": "check", "OpsCheck": "check",
    "reduce": "compute", "grad": "compute", "neighbors": "compute", "Results": "compute",
    "stats": "curate", "fit_e0": "curate", "select": "curate", "Statistics": "curate",
    "convert": "data", "merge": "data", "open": "data", "Batch": "data",
}

__all__ = sorted(_MODULES)


def __getattr__(name):
    if name not in _MODULES:
        raise AttributeError(f"module 'segcli.api' has no attribute {name!r}")
    return getattr(importlib.import_module(f"segcli.api.{_MODULES[name]}"), name)


def __dir__():
    return sorted([*globals(), *_MODULES])
