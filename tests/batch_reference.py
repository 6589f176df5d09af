"""Independent references for the engine, reduce and grad tests: random segcli HDF5 files
written with h5py, and every op of `segcli reduce` in NumPy float64 (values, one structure at
a time) and in JAX (for jax.grad and jax.jvp). Never imports segcli."""

import h5py
import numpy as np

PER_ATOM_OUTPUT = ("mul", "matvec")


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


def reduce_numpy(op, n_atoms, *arrays):
    """OP over each structure, in NumPy float64, one structure at a time."""
    arrays = [np.asarray(a, np.float64) for a in arrays]
    bounds = np.concatenate([[0], np.cumsum(n_atoms)])
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    if op == "count":
        return np.asarray(n_atoms)
    if op in PER_ATOM_OUTPUT:
        x, per_structure = arrays
        rows = [x[p] * per_structure[s] if op == "mul" else x[p] @ per_structure[s]
                for s, p in enumerate(parts)]
        return np.concatenate(rows) if rows else x
    one = {
        "sum": lambda a: a.sum(axis=0),
        "mean": lambda a: a.mean(axis=0) if len(a) else np.zeros(a.shape[1:]),
        "dot": lambda a, b: np.sum(a * b),
        "rms_norm": lambda a: np.sqrt(np.sum(a * a) / max(len(a), 1)),
        "max_norm": lambda a: np.sqrt((a * a).sum(axis=tuple(range(1, a.ndim)))).max(initial=0.0),
    }[op]
    return np.array([one(*(a[p] for a in arrays)) for p in parts]).reshape(
        len(parts), *(arrays[0].shape[1:] if op in ("sum", "mean") else ()))


def reduce_jax(op, n_atoms, *arrays):
    """OP over each structure in plain JAX (jax.ops.segment_sum / segment_max), differentiable."""
    import jax
    import jax.numpy as jnp

    def sqrt(a):  # SPEC §1: derivatives 0 (not NaN) where the norm is 0
        return jnp.where(a > 0, jnp.sqrt(jnp.where(a > 0, a, 1)), 0)

    s = len(n_atoms)
    idx = np.repeat(np.arange(s), n_atoms)
    x = arrays[0]
    flat = x.reshape(len(x), -1)
    count = jnp.asarray(np.maximum(n_atoms, 1), x.dtype)
    trailing = (1,) * (x.ndim - 1)
    if op == "sum":
        return jax.ops.segment_sum(x, idx, s)
    if op == "mean":
        return jax.ops.segment_sum(x, idx, s) / count.reshape(-1, *trailing)
    if op == "dot":
        return jax.ops.segment_sum(jnp.sum(flat * arrays[1].reshape(len(x), -1), axis=1), idx, s)
    if op == "mul":
        return x * arrays[1][idx].reshape(-1, *trailing)
    if op == "rms_norm":
        return sqrt(jax.ops.segment_sum(jnp.sum(flat * flat, axis=1), idx, s) / count)
    if op == "max_norm":
        best = jax.ops.segment_max(sqrt(jnp.sum(flat * flat, axis=1)), idx, s)
        return jnp.where(np.asarray(n_atoms) > 0, best, 0.0)
    if op == "matvec":
        return jnp.einsum("ni,nij->nj", x, arrays[1][idx])
    raise ValueError(op)


def objective_jax(op, n_atoms, weights, *arrays):
    """Σ over every entry of OP's result of w_s (s: the entry's structure) times the entry."""
    import jax.numpy as jnp

    out = reduce_jax(op, n_atoms, *arrays)
    w = np.repeat(weights, n_atoms) if op in PER_ATOM_OUTPUT else weights
    return jnp.sum(out * jnp.asarray(w).reshape(-1, *(1,) * (out.ndim - 1)))


def assert_reduced(got, op, n_atoms, arrays, precision):
    """got == OP(arrays) within rounding: |error| <= rtol · OP(|arrays|) entry by entry (the
    size of the terms summed, so cancelling sums are judged fairly), rtol for the precision."""
    rtol = {"float64": 1e-12, "float32": 2e-6}[precision]
    expected = reduce_numpy(op, n_atoms, *arrays)
    bound = reduce_numpy(op, n_atoms, *(np.abs(a) for a in arrays))
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - expected),
                                 rtol * bound + 1e-300)
