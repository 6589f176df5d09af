"""References for the engine, reduce and grad tests: random segcli HDF5 files written with
h5py, random arguments of any op from its registry data, and every op through its pure-JAX
reference (segcli.reference, independent of the kernels) over the structures of n_atoms."""

import collections

import h5py
import numpy as np

from segcli.registry import OPS


def write_batch(path, n_atoms, atoms=(), structures=()):
    """A segcli HDF5 file (SPEC §4) holding the given per-atom and per-structure arrays."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "segcli-batch"
        f.attrs["version"] = 1
        f["structures/n_atoms"] = np.asarray(n_atoms, np.int64)
        for group, arrays in (("atoms", dict(atoms)), ("structures", dict(structures))):
            f.require_group(group)
            for name, array in arrays.items():
                f[f"{group}/{name}"] = array
    return path


def random_batch(path, seed, n_structures=40, max_atoms=9):
    """A random file: n_atoms (some 0) and, per atom, x, y (N, 3), v (N,), t (N, 2, 2),
    x32 (N, 3) float32, z (N,) int; per structure s, w (S,) and m (S, 3, 3).
    Returns (n_atoms, {name: array}) of everything written."""
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(0, max_atoms + 1, n_structures)
    n_atoms[rng.choice(n_structures, 3, replace=False)] = 0
    n = int(n_atoms.sum())
    atoms = {"x": rng.normal(size=(n, 3)), "y": rng.normal(size=(n, 3)), "v": rng.normal(size=n),
             "t": rng.normal(size=(n, 2, 2)), "x32": rng.normal(size=(n, 3)).astype(np.float32),
             "z": rng.integers(1, 9, n)}
    structures = {"s": rng.normal(size=n_structures), "w": rng.uniform(0.5, 2, n_structures),
                  "m": rng.normal(size=(n_structures, 3, 3))}
    write_batch(path, n_atoms, atoms, structures)
    return n_atoms, {**atoms, **structures}


RANDOM_FIELDS = {
    ("atom", None, "float"): [("x", "y"), ("t", "t"), ("v", "v"), ("x32", "x")],
    ("atom", (3,), "float"): [("x",)],
    ("structure", (), "float"): [("s",)],
    ("structure", (3, 3), "float"): [("m",)],
    ("atom", (), "labels"): [("z",)],
}
"""(per, shape, kind) of an op's argument -> alternative field names of random_batch for
the first, second, ... argument of that kind."""


def fields_for(op, choices=RANDOM_FIELDS, turn=0):
    """Field names for the inputs of `op` (a registry.Op): for the inputs of each kind
    (per, shape, kind), in order, the names of alternative `turn` (modulo their number) of
    choices[kind]."""
    seen = collections.Counter()
    names = []
    for arg in op.inputs:
        kind = (arg.per, arg.shape, arg.kind)
        alternatives = choices[kind]
        names.append(alternatives[turn % len(alternatives)][seen[kind]])
        seen[kind] += 1
    return names


def random_args(rng, op, n, m, features=(3,), dtype=np.float64):
    """Random NumPy arguments of `op` (a registry.Op) for n rows in m segments: per atom
    (n, *features) or (n, *shape), per structure (m, *shape), labels ints in [0, length)."""
    args = []
    for arg in op.inputs:
        shape = ((n,) if arg.per == "atom" else (m,)) + (
            features if arg.shape is None else arg.shape)
        args.append(rng.integers(0, op.params["length"], shape) if arg.kind == "labels"
                    else rng.normal(size=shape).astype(dtype))
    return tuple(args)


def reduce_jax(op, n_atoms, *arrays, **params):
    """OP (a name) over the structures of n_atoms by its reference, in the arrays' dtypes
    (integers as the op reduces them, else float64), differentiable."""
    from segcli._jax import enable_x64

    spec = OPS[op]
    idx = np.repeat(np.arange(len(n_atoms)), n_atoms)
    with enable_x64(True):
        kept = [np.issubdtype(a.dtype, np.integer) and (spec.integers or arg.kind == "labels")
                for a, arg in zip(arrays, spec.inputs)]
        arrays = [a if keep else a.astype(np.float64) for a, keep in zip(arrays, kept)]
        return spec.reference(*arrays, idx, len(n_atoms), **{**spec.params, **params})


def reduce_reference(op, n_atoms, *arrays, **params):
    """reduce_jax as a NumPy array."""
    return np.asarray(reduce_jax(op, n_atoms, *arrays, **params))


def objective_jax(op, n_atoms, weights, *arrays):
    """Σ over every entry of OP's result of w_s (s: the entry's structure) times the entry."""
    import jax.numpy as jnp

    out = reduce_jax(op, n_atoms, *arrays)
    w = np.repeat(weights, n_atoms) if OPS[op].output_per == "atom" else weights
    return jnp.sum(out * jnp.asarray(w).reshape(-1, *(1,) * (out.ndim - 1)))


def assert_reduced(got, op, n_atoms, arrays, precision):
    """got == OP(arrays) within rounding: |error| <= rtol · max(|OP(arrays)|, OP(|arrays|))
    entry by entry (OP(|arrays|): the size of the terms summed, so cancelling sums are
    judged fairly), rtol for the precision; equal infinities agree."""
    rtol = {"float64": 1e-12, "float32": 2e-6}[precision]
    expected = reduce_reference(op, n_atoms, *arrays).astype(np.float64)
    bound = np.maximum(np.abs(expected),
                       reduce_reference(op, n_atoms, *(np.abs(a) for a in arrays)))
    got = np.asarray(got, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf, where the two agree
        error = np.where(got == expected, 0, np.abs(got - expected))
    np.testing.assert_array_less(error, rtol * bound + 1e-300)
