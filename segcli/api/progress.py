"""Progress of long work: the command line's bar on stderr, or a caller's function."""

import contextlib
import os
import sys


def stderr_is_terminal():
    """Whether stderr is open and a terminal (closed stderr, `2>&-`, is None in Python)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def bar(enabled, label, total=None, unit="structure"):
    """A tqdm bar on stderr (done of `total`, rate and ETA; a count and rate while `total` is
    None) when `enabled` and stderr is a terminal, else None. The bar stays when the block
    succeeds and is cleared when it raises. Library functions take it as `progress` and call
    its `update(n)` (and `reset(total)` once they know the total)."""
    if not enabled or not stderr_is_terminal():
        yield None
        return
    from tqdm import tqdm

    try:  # follow the terminal's width, unless it reports none (a bare pseudo-terminal)
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError):
        sized = False
    shown = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, dynamic_ncols=sized,
               **({} if sized else {"ncols": 80, "nrows": 24}))
    try:
        yield shown
    except BaseException:
        shown.leave = False
        raise
    finally:
        shown.close()


class _Calls:
    """Progress as calls of `report(done, total)`, in the interface of a bar."""

    def __init__(self, report, total):
        self.report, self.total, self.done = report, total, 0

    def update(self, n=1):
        self.done += n
        self.report(self.done, self.total)

    def reset(self, total=None):
        self.total, self.done = total, 0


@contextlib.contextmanager
def reporting(progress, label, total=None, unit="structure"):
    """What library functions take as `progress` for a caller's `progress` argument: False
    (None: nothing), True (the command's bar, see `bar`) or a function called as
    `progress(done, total)` (total None while unknown).

        with reporting(lambda done, total: print(done, total), "reading", 10) as p:
            p.update(4)  # prints 4 10
    """
    if callable(progress):
        yield _Calls(progress, total)
    elif progress in (True, False, None):
        with bar(bool(progress), label, total, unit) as shown:
            yield shown
    else:
        raise TypeError(f"progress= takes True, False or a function (done, total), got "
                        f"{type(progress).__name__}")
