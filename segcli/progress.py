"""Progress of long work: a bar on stderr, or a caller's function told (done, total)."""

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
def progress(enabled, label, total=None, unit="structure"):
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
    bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, dynamic_ncols=sized,
               **({} if sized else {"ncols": 80, "nrows": 24}))
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()


class _Calls:
    """A progress object (`update(n)`, `reset(total)`) that calls `report(done, total)`."""

    def __init__(self, report, total):
        self._report, self.total, self.done = report, total, 0

    def update(self, n=1):
        self.done += int(n)
        self._report(self.done, self.total)

    def reset(self, total=None):
        self.total, self.done = total, 0


@contextlib.contextmanager
def tracked(how, label, total=None, unit="structure"):
    """What a library function's `progress=` asks for: False or None, nothing (None); True,
    the bar of `progress`; a function, an object that calls it with (done, total) as work is
    done (total None while unknown).

        with tracked(lambda done, total: print(done, total), "reading", 10) as p:
            p.update(4)  # prints 4 10
    """
    if callable(how):
        yield _Calls(how, total)
    elif how in (True, False, None):
        with progress(bool(how), label, total, unit) as bar:
            yield bar
    else:
        raise TypeError(f"progress= takes True, False or a function (done, total), got "
                        f"{type(how).__name__}")
