"""segcli's Python API over datasets: every command is a function first (SPEC §1c)."""

from segcli.api.curate import Statistics, fit_e0, select, stats
from segcli.api.data import Batch, convert, merge, open

__all__ = ["Batch", "Statistics", "convert", "fit_e0", "merge", "open", "select", "stats"]
