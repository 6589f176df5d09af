"""segcli's commands as Python functions (docs/api.md): each takes what the command takes,
under the same names, and returns what it computed."""

from segcli.api.compute import Results, grad, neighbors, reduce

# curation:

__all__ = ["Results", "grad", "neighbors", "reduce"]
