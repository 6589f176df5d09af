"""segcli's commands as Python functions (docs/api.md): each takes what the command takes,
under the same names, and returns what it computed."""

from segcli.api.check import OpsCheck, check_ops
from segcli.api.compute import Results, grad, neighbors, reduce
from segcli.api.curate import Statistics, fit_e0, select, stats
from segcli.api.data import Batch, convert, merge, open

__all__ = ["Batch", "OpsCheck", "Results", "Statistics", "check_ops", "convert", "fit_e0", "grad",
           "merge", "neighbors", "open", "reduce", "select", "stats"]
