"""segcli.executor: reduce and stats give the same bits in this process and as --shard parts
merged (and stats as tasks on a Dask cluster, a slow test; test_cluster.py runs the rest
there); a unit's DataError is the same line in every mode, and
progress ends at its total."""

import glob
import itertools

import h5py
import numpy as np
import pytest
from batch_reference import write_batch

import segcli
from segcli import executor
from segcli.errors import DataError
from segcli.progress import tracked

N_STRUCTURES = 1500  # more than segcli.shards.LEAVES: leaves of several structures
BAD = 1234  # the structure with a non-finite force in the broken file


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A file of N_STRUCTURES structures (0 to 6 atoms: forces, energy) and its copy with a
    NaN force in structure BAD."""
    rng = np.random.default_rng(5)
    n_atoms = rng.integers(0, 7, N_STRUCTURES)
    n_atoms[BAD] = 3
    forces = rng.normal(size=(int(n_atoms.sum()), 3))
    energy = rng.normal(size=N_STRUCTURES)
    folder = tmp_path_factory.mktemp("executor")
    good = write_batch(folder / "good.h5", n_atoms, {"forces": forces}, {"energy": energy})
    broken = forces.copy()
    broken[int(n_atoms[:BAD].sum()) + n_atoms[BAD] - 1, 1] = np.nan
    assert n_atoms[BAD] > 0
    bad = write_batch(folder / "bad.h5", n_atoms, {"forces": broken}, {"energy": energy})
    return str(good), str(bad)


class Told:
    """A progress= function that keeps every (done, total) it is told."""

    def __init__(self):
        self.calls = []

    def __call__(self, done, total):
        self.calls.append((done, total))

    def ended(self):
        done, total = self.calls[-1]
        return done == total and total > 0 and all(d <= total for d, _ in self.calls)


def results_of(path, name):
    with h5py.File(path, "r") as h5:
        return h5["results"][name][()]


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_reduce_gives_the_same_bits_here_and_as_shards_merged(files, tmp_path):
    """(On a cluster: test_cluster.py, whose workers start JAX once for every test there.)"""
    good, _ = files
    where = "energy < 0.8"
    here = Told()
    one = segcli.reduce(good, "rms_norm", "forces", where=where, progress=here,
                        output=tmp_path / "one.h5")["rms_norm_forces"]
    in_memory = segcli.reduce(good, "rms_norm", "forces", where=where)["rms_norm_forces"]
    assert here.ended()
    for index in range(3):
        told = Told()
        segcli.reduce(good, "rms_norm", "forces", where=where, shard=(index, 3),
                      output=tmp_path / "r-{shard}.h5", progress=told)
        assert told.ended()
    segcli.merge(sorted(glob.glob(str(tmp_path / "r-*.h5"))), tmp_path / "merged.h5")
    reference = results_of(tmp_path / "one.h5", "rms_norm_forces")
    assert same_bits(results_of(tmp_path / "merged.h5", "rms_norm_forces"), reference)
    assert same_bits(one, reference[~np.isnan(reference)]) and same_bits(in_memory, one)
    with h5py.File(good, "r") as h5:  # against NumPy, where the condition holds
        n_atoms, forces = h5["structures/n_atoms"][()], h5["atoms/forces"][()]
        energy = h5["structures/energy"][()]
    starts = np.concatenate([[0], np.cumsum(n_atoms)])
    expected = [np.sqrt(np.mean(np.sum(forces[a:b] ** 2, axis=1))) if b > a else 0.0
                for a, b in itertools.pairwise(starts)]
    np.testing.assert_allclose(one, np.array(expected)[energy < 0.8], rtol=1e-12)


def test_stats_give_the_same_bits_here_and_as_shards_merged(files, tmp_path):
    good, _ = files
    here = Told()
    one = segcli.stats(good, "forces", "energy", progress=here).rows
    assert here.ended()
    for index in range(3):
        told = Told()
        segcli.stats(good, "forces", "energy", shard=(index, 3),
                     output=tmp_path / "s-{shard}.h5", progress=told)
        assert told.ended()
    segcli.merge(sorted(glob.glob(str(tmp_path / "s-*.h5"))), tmp_path / "s.h5")
    assert segcli.stats(tmp_path / "s.h5", "forces", "energy").rows == one
    energy_row = next(row for row in one if row["field"] == "energy")
    with h5py.File(good, "r") as h5:
        energy = h5["structures/energy"][()]
    assert energy_row["count"] == N_STRUCTURES
    assert energy_row["mean"] == pytest.approx(energy.mean(), rel=1e-13)
    assert energy_row["std"] == pytest.approx(energy.std(), rel=1e-12)


def stats_error(path, **options):
    """The line of the DataError that segcli.stats raises, None if it raises none."""
    try:
        segcli.stats(path, "forces", **options)
    except DataError as err:
        return str(err)
    return None


def test_a_units_data_error_is_the_same_line_here_and_in_its_shard(files):
    _, bad = files
    here = stats_error(bad)
    assert here.startswith(f"{bad}: ") and "\n" not in here and str(BAD) in here
    assert [stats_error(bad, shard=(index, 3)) for index in range(3)] == [None, None, here]


@pytest.mark.slow  # a cluster of worker processes: about 5 s
def test_on_a_cluster_stats_give_the_same_bits_and_errors(files, dask_cluster):
    good, bad = files
    told = Told()
    remote = segcli.stats(good, "forces", "energy", scheduler=dask_cluster.scheduler_address,
                          progress=told)
    assert remote.rows == segcli.stats(good, "forces", "energy").rows
    assert told.ended() and len(told.calls) > 1
    assert stats_error(bad, scheduler=dask_cluster.scheduler_address) == stats_error(bad)


def refuse_second(unit, progress):
    """A unit's work that refuses the second unit's data."""
    if unit.index == 1:
        raise DataError(f"f.h5: structure {unit.lo} is bad")
    return unit.size


def _size(unit, progress):
    return unit.size


def test_run_joins_in_unit_order_and_passes_a_units_error_on():
    """Here and on a Dask cluster of threads in this process (the work reads no file)."""
    from dask.distributed import Client, LocalCluster

    units = executor.split(np.ones(40, np.int64), np.arange(41), 4)
    assert [u.leaves[0] for u in units] == [0, 10, 20, 30]
    order, told = [], Told()
    assert executor.run(units, _size, sink=lambda unit, size: order.append(unit.index)) == \
        [10] * 4
    assert order == [0, 1, 2, 3]
    with pytest.raises(DataError, match="^f.h5: structure 10 is bad$"):
        executor.run(units, refuse_second)
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                       dashboard_address=":0") as cluster, Client(cluster) as client):
        with tracked(told, "units", 40) as progress:
            assert executor.run(units, _size, client=client, progress=progress,
                                combine=sum) == 40
        with pytest.raises(DataError, match="^f.h5: structure 10 is bad$"):
            executor.run(units, refuse_second, client=client)
    assert told.ended() and len(told.calls) == 4
