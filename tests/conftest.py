"""Shared fixtures, and XLA's CPU backend without its slower LLVM passes: the tests compile
many hundreds of small programs and check their values, not their speed (a caller's own
XLA_FLAGS are kept). The programs compiled in the test processes are kept in a compilation
cache of this run's own (see `compilation_cache_of_this_run`)."""

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true")


@pytest.fixture(scope="session", autouse=True)
def compilation_cache_of_this_run(tmp_path_factory):
    """JAX's persistent compilation cache in a directory that this run's test processes (the
    xdist workers) share and no other run sees: a program compiled by one worker is loaded by
    the other instead of compiled again, and every run starts empty, so its time does not
    depend on an earlier run's. Programs run by `segcli` processes are not affected (their
    cache is the program's own, set from their environment; tests/cli/test_startup.py tests it);
    a cache given by the caller (JAX_COMPILATION_CACHE_DIR) is kept."""
    import jax

    if jax.config.jax_compilation_cache_dir is not None:
        yield
        return
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is in the run's
        root = root.parent
    path = root / "jax-compilation-cache"
    path.mkdir(exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(path),
                "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": -1}
    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    yield
    for name, value in previous.items():
        jax.config.update(name, value)


@pytest.fixture
def frames():
    """Fresh structures of varied sizes: periodic cells, a slab (one zero cell vector), molecules
    without a cell and a single atom, with momenta, numeric and string info entries, and
    calculator energy, forces and stress."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(7)
    out = []
    for i, (n, kind) in enumerate([(5, "bulk"), (1, "atom"), (12, "molecule"), (4, "slab"),
                                   (30, "bulk"), (7, "molecule"), (2, "bulk")]):
        atoms = Atoms(numbers=rng.integers(1, 80, n), positions=rng.normal(0, 3, (n, 3)))
        if kind == "bulk":
            atoms.set_cell(np.diag(rng.uniform(6, 9, 3)) + rng.normal(0, 0.5, (3, 3)))
            atoms.pbc = True
        elif kind == "slab":
            atoms.set_cell([[5.0, 0.0, 0.0], [1.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
            atoms.pbc = [True, True, False]
        atoms.set_momenta(rng.normal(0, 1, (n, 3)))
        atoms.info.update(temperature=float(rng.uniform(100, 900)), step=i, label=f"frame{i}")
        atoms.calc = SinglePointCalculator(atoms, energy=float(rng.normal()),
                                           forces=rng.normal(0, 1, (n, 3)),
                                           stress=rng.normal(0, 0.1, 6))
        out.append(atoms)
    return out


@pytest.fixture
def ase_reference():
    """Read a file with ase.io.read: (n_atoms, per-atom arrays, per-structure arrays), each
    field concatenated over the structures, built from ASE's own accessors."""

    def read(path, **kwargs):
        import ase.io

        images = ase.io.read(path, ":", **kwargs)
        per_atom = {
            "numbers": [a.numbers for a in images],
            "positions": [a.positions for a in images],
            "momenta": [a.get_momenta() for a in images],
            "forces": [a.get_forces() for a in images],
            "velocities": [a.get_velocities() for a in images],
            "scaled_positions": [a.get_scaled_positions(wrap=False) for a in images],
        }
        per_structure = {
            "cell": [a.cell.array for a in images],
            "pbc": [a.pbc for a in images],
            "energy": [a.get_potential_energy() for a in images],
            "stress": [a.get_stress() for a in images],
            "temperature": [a.info["temperature"] for a in images],
            "step": [a.info["step"] for a in images],
        }
        return (np.array([len(a) for a in images]),
                {k: np.concatenate(v) for k, v in per_atom.items()},
                {k: np.stack(v) for k, v in per_structure.items()})

    return read


@pytest.fixture
def extxyz(tmp_path, frames):
    """The `frames` written to tmp_path/frames.extxyz."""
    import ase.io

    path = tmp_path / "frames.extxyz"
    ase.io.write(path, frames, format="extxyz")
    return path


@pytest.fixture
def batch_h5(extxyz):
    """`extxyz` converted to tmp_path/batch.h5."""
    from segcli.io import convert

    out = extxyz.with_name("batch.h5")
    convert([extxyz], out)
    return out


@pytest.fixture
def device_label():
    """The results' device attribute of a run on JAX's default device: `cpu`, or e.g.
    `gpu:0 (NVIDIA H200)`."""
    import jax

    device = jax.devices()[0]
    return ("cpu" if device.platform == "cpu"
            else f"{device.platform}:{device.id} ({device.device_kind})")


@pytest.fixture
def x64():
    """JAX's 64-bit mode for the test, restored after it."""
    import jax

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def strict_numpy():
    """JAX's strict NumPy rules for the test, as JAX's own tests set them: no implicit rank
    promotion (broadcasting (M, G) with (G,) raises) and no implicit dtype promotion."""
    import jax

    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(scope="module")
def dask_cluster():
    """A Dask LocalCluster of 2 single-threaded worker processes, shared by a module's tests
    that only send it work (those that kill a worker start their own); closed after them, so
    its threads never run beside another module's measurements."""
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:
        yield cluster
