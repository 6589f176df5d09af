"""The moments of `_moments.c` in NumPy, bit for bit: the path of `segcli stats` where the C
was not built with the package.

Every operation of the C is done here in the same order on the same float64 values: rows in
blocks of a leaf's rows, put in group order (stably), a vector field's norms (√Σ x², summed
in the order of the components); each group's run of a block gives a mean and an M2, each
sum in two chains (row i of the run in chain i % 2) summed from zero in order (a step of
every chain at a time: `np.sum` would pair them), then added; min and max keep the first of
equal values (which decides the sign of a zero), as the C's comparisons do; each block is
merged into its leaf by Chan, Golub and LeVeque's formulas, written as in the C.

    ok = moments(rows, True, count, labels, out, block=4096)
"""

import numpy as np

BLOCK_VALUES = 65536
"""Values of a block's columns at most (`_moments.c`'s BLOCK_VALUES): fewer rows if wide."""


def moments(rows, with_norm, count, labels, out, block):
    """The moments of `rows` (n, k) added to `out` (Moments (L, G, K), in place), as
    `_moments.c` adds them: rows in L leaves of `count` (L,) rows, row i in group labels[i]
    (integers; None: all in group 0), each row's norm as component k where `with_norm`, in
    blocks of at most `block` rows. Returns whether every label was one of the G groups (if
    not, `out` is left as it was).

    >>> out = segcli.moments.Moments.empty(1, 4, leaves=1)
    >>> moments(np.ones((5, 3)), True, np.array([5]), None, out, 4096)
    True
    """
    n_groups, n_columns = out.mean.shape[1:]
    if labels is not None:
        if labels.dtype.kind not in "iu":
            labels = labels.astype(np.uint8)
        else:  # a negative integer's bits are a large one, as the C reads them
            labels = np.ascontiguousarray(labels, labels.dtype.newbyteorder("="))
            labels = labels.view(f"u{labels.itemsize}")
        if len(labels) and labels.max() >= n_groups:
            return False
    columns = _columns(np.asarray(rows, np.float64), with_norm)
    rows_per_block = min(block, max(BLOCK_VALUES // n_columns, 1))

    # each block of each leaf, in order, its rows by group (stably): runs of segments
    blocks = -(-count // rows_per_block)
    first_block = np.cumsum(blocks) - blocks
    position = np.arange(len(columns)) - np.repeat(np.cumsum(count) - count, count)
    key = (np.repeat(first_block, count) + position // rows_per_block) * n_groups
    if labels is not None and n_groups > 1:
        key += labels.astype(np.int64)
        order = np.argsort(key, kind="stable")
        key, columns = key[order], columns[order]
    starts = np.flatnonzero(np.diff(key, prepend=-1))
    size = np.diff(starts, append=len(key))
    place = np.arange(len(key)) - np.repeat(starts, size)
    chain, step = 2 * np.repeat(np.arange(len(starts)), size) + place % 2, place // 2

    sums, low, high, first_zero = _chains(columns, chain, step, 2 * len(starts), True)
    mean = (sums[0::2] + sums[1::2]) / size[:, None]
    deviations = columns - np.repeat(mean, size, axis=0)
    m2_chains = _chains(deviations * deviations, chain, step, 2 * len(starts), False)[0]
    m2 = m2_chains[0::2] + m2_chains[1::2]

    block, group = np.divmod(key[starts], n_groups)
    leaf = np.repeat(np.arange(len(count)), blocks)[block]
    nth = block - first_block[leaf]  # the block's place in its leaf
    by_nth = np.argsort(nth, kind="stable")
    for s in np.split(by_nth, np.flatnonzero(np.diff(nth[by_nth])) + 1):  # merged in order
        cell = (leaf[s], group[s])
        for extreme, better, chains in ((out.min, np.less, low), (out.max, np.greater, high)):
            start = 0.0 + extreme[cell]  # the leaf's so far, in every chain (+0.0 for ±0)
            kept = [_chain_extreme(start, chains[2 * s + j], first_zero[2 * s + j], better)
                    for j in (0, 1)]
            extreme[cell] = np.where(better(kept[1], kept[0]), kept[1], kept[0])
        before = out.count[cell].astype(np.float64)[:, None]
        added = size[s].astype(np.float64)[:, None]
        total = before + added
        delta = mean[s] - out.mean[cell]
        out.mean[cell] = out.mean[cell] + delta * (added / total)
        out.m2[cell] = out.m2[cell] + (m2[s] + delta * delta * (before * added / total))
        out.count[cell] += size[s]
    return True


def _columns(values, with_norm):
    """The float64 rows (n, k), with their norms as a last column where `with_norm`: each
    √Σ x², summed from zero in the order of the components."""
    if not with_norm:
        return values
    k = values.shape[1]
    columns = np.empty((len(values), k + 1))
    columns[:, :k] = values
    squares = np.zeros(len(values))
    for c in range(k):
        squares += values[:, c] * values[:, c]
    np.sqrt(squares, out=columns[:, k])
    return columns


def _chains(values, chain, step, n_chains, extremes):
    """For the values (n, K) of `n_chains` chains, value i at `step[i]` of chain `chain[i]`:
    each chain's sum from zero in order (n_chains, K), and where `extremes`, its min, max and
    first zero (NaN where none; its sign is what the C's min and max keep of ±0). A step of
    every chain at a time, the values laid out step by step, the longest chains first."""
    length = np.bincount(chain, minlength=n_chains)
    order = np.argsort(-length, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(n_chains)
    ascending = length[order][::-1]
    active = n_chains - np.searchsorted(ascending, np.arange(ascending[-1] if n_chains else 0),
                                        side="right")
    offset = np.concatenate([[0], np.cumsum(active)])
    laid = np.empty_like(values)
    laid[offset[step] + rank[chain]] = values
    shape = (n_chains, values.shape[1])
    sums = np.zeros(shape)
    low, high, first_zero = np.full(shape, np.inf), np.full(shape, -np.inf), np.full(shape, np.nan)
    for i, n in enumerate(active):
        value = laid[offset[i]:offset[i + 1]]
        sums[:n] += value
        if extremes:
            np.minimum(low[:n], value, out=low[:n])
            np.maximum(high[:n], value, out=high[:n])
            zero = first_zero[:n]
            np.copyto(zero, value, where=(value == 0) & np.isnan(zero))
    return sums[rank], low[rank], high[rank], first_zero[rank]


def _chain_extreme(start, extreme, first_zero, better):
    """A chain's min (`better` np.less) or max (np.greater) as the C keeps it, starting from
    `start`: the first of the values equal to the extreme, which decides only the sign of a
    zero."""
    value = np.where(better(extreme, start), extreme, start)
    zero = (value == 0) & (start != 0)  # start itself is +0.0 where it is zero
    return np.where(zero, first_zero, value)
