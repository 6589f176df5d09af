"""The neighbour kernel: pairs of atoms within cutoffs in periodic cells, from a cell list
(segcli.neighbors builds the bins)."""

import warp as wp

from segcli.ops.kernels._registry import ANY, kernel, variants


@wp.func
def _image(t: int, bins: int, periodic: int):
    # Bin t of an axis of `bins` bins, as (the bin it is, the periodic image it lies in, whether
    # it exists): periodic axes wrap, the others end.
    if periodic != 0:
        # the floor of t / bins, dividing non-negative integers only (so whatever the sign
        # convention of integer division)
        image = t / bins
        if t < 0:
            image = -((-t - 1) / bins) - 1
        return t - image * bins, image, True
    return t, 0, t >= 0 and t < bins


def _neighbors_kernel(
    positions: wp.array(dtype=wp.vec3d),
    row: wp.array(dtype=wp.int32),
    structure: wp.array(dtype=wp.int32),
    bin_xyz: wp.array(dtype=wp.vec3i),
    bin_start: wp.array(dtype=wp.int32),
    lattice: wp.array(dtype=wp.mat33d),
    bins: wp.array(dtype=wp.vec3i),
    reach: wp.array(dtype=wp.vec3i),
    periodic: wp.array(dtype=wp.vec3i),
    first_bin: wp.array(dtype=wp.int32),
    first_row: wp.array(dtype=wp.int32),
    cutoffs: wp.array(dtype=wp.float64),
    histogram_scale: wp.array(dtype=wp.float64),
    counts: wp.array2d(dtype=wp.int64),
    nearest: wp.array(dtype=wp.float64),
    partner: wp.array(dtype=wp.int32),
    histogram: wp.array(dtype=wp.int32),
):
    # One thread per atom p (in bin order): every atom q of the bins within `reach` of its own,
    # in each periodic image those bins lie in, counted per cutoff (distance < cutoff, the atom
    # itself only in other images), the nearest kept (the lowest index on a tie) and, with a
    # histogram, each distance's bin counted. Results go to the atom's row of the chunk.
    p = wp.tid()
    s = structure[p]
    if s < 0:
        return
    i = row[p]
    xi = positions[p]
    b = bin_xyz[p]
    n = bins[s]
    r = reach[s]
    wrap = periodic[s]
    cell = lattice[s]
    top = cutoffs[cutoffs.shape[0] - 1]
    best = wp.float64(wp.inf)
    best_j = int(-1)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    for d0 in range(-r[0], r[0] + 1):
        w0, n0, ok0 = _image(b[0] + d0, n[0], wrap[0])
        if not ok0:
            continue
        for d1 in range(-r[1], r[1] + 1):
            w1, n1, ok1 = _image(b[1] + d1, n[1], wrap[1])
            if not ok1:
                continue
            for d2 in range(-r[2], r[2] + 1):
                w2, n2, ok2 = _image(b[2] + d2, n[2], wrap[2])
                if not ok2:
                    continue
                shift = (wp.float64(n0) * cell[0] + wp.float64(n1) * cell[1]
                         + wp.float64(n2) * cell[2])
                same = n0 == 0 and n1 == 0 and n2 == 0
                k = first_bin[s] + (w0 * n[1] + w1) * n[2] + w2
                for q in range(bin_start[k], bin_start[k + 1]):
                    if same and q == p:
                        continue
                    # (x_j - x_i) + shift is exactly minus the pair j, i: ties are exact
                    v = (positions[q] - xi) + shift
                    distance = wp.length(v)
                    if distance < wp.float64(1e-150):  # its square may have underflowed
                        scale = wp.max(wp.max(wp.abs(v[0]), wp.abs(v[1])), wp.abs(v[2]))
                        if scale > wp.float64(0.0):
                            distance = scale * wp.length(v / scale)
                    if distance < top:
                        for c in range(cutoffs.shape[0]):
                            if distance < cutoffs[c]:
                                counts[i, c] = counts[i, c] + wp.int64(1)
                        j = row[q] - first_row[s]
                        if distance < best or (distance == best and j < best_j):
                            best = distance
                            best_j = j
                        if histogram_scale[0] > wp.float64(0.0):
                            h = wp.min(int(distance * histogram_scale[0]), histogram.shape[0] - 1)
                            wp.atomic_add(histogram, h, 1)
    nearest[i] = best
    partner[i] = best_j


NEIGHBOURS = variants(
    # op, step, device, ordering, size, kernel
    ("neighbors", "", ANY, ANY, ANY, kernel("neighbors", _neighbors_kernel, dtypes=("float64",))),
)
"""Neighbour pairs, a thread an atom."""
