"""--scheduler on real dask.distributed clusters of worker processes: reduce, grad and stats
give the bits of a local run, even when a worker is killed; and the split into shards."""

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner
from terminal import BAR, final_screen, on_terminal
from test_input_format import poscars
from test_shards import assert_identical
from test_stats import assert_rows_match, make_random_file, reference_rows, run, stats_json

from segcli.cli import main
from segcli.shards import shard_bounds

pytest.importorskip("dask.distributed", reason="the cluster extra: pip install 'segcli[cluster]'")


@pytest.mark.parametrize("n_atoms, shards", [
    ([3, 1, 4, 1, 5, 9, 2, 6], 3), ([5] * 10, 4), ([0, 0, 7, 0], 3), ([], 2), ([2, 2], 5),
    (list(range(100)), 7)])
def test_shards_are_contiguous_whole_structures_of_nearly_equal_atoms(n_atoms, shards):
    bounds = shard_bounds(np.array(n_atoms, dtype=np.int64), shards)
    assert len(bounds) == shards + 1 and bounds[0] == 0 and bounds[-1] == len(n_atoms)
    assert all(a <= b for a, b in itertools.pairwise(bounds))
    atoms = [sum(n_atoms[a:b]) for a, b in itertools.pairwise(bounds)]
    assert sum(atoms) == sum(n_atoms)
    biggest = max(n_atoms, default=0)
    assert all(abs(a - sum(n_atoms) / shards) <= biggest for a in atoms)


@pytest.mark.parametrize("seed", range(6))
def test_in_order_passes_each_shard_on_once_those_before_it_have_come(seed):
    """What a cluster's stream of results gets: shards done in any order, each passed on in
    shard order as soon as it can be, none held longer."""
    from segcli.executor import in_order

    done = np.random.default_rng(seed).permutation(9).tolist()
    events = []

    def finishing():
        for k in done:
            events.append(("done", k))
            yield k, f"part-{k}"

    for k, value in in_order(finishing()):
        events.append(("out", k))
        assert value == f"part-{k}"
    out = [k for what, k in events if what == "out"]
    assert out == list(range(9))
    for at, (what, _) in enumerate(events + [("done", None)]):
        if what == "done":  # before awaiting the next shard, every one it can pass on is out
            came = {k for w, k in events[:at] if w == "done"}
            ready = next(k for k in range(10) if k not in came)
            assert [k for w, k in events[:at] if w == "out"] == list(range(ready))


def test_stats_on_a_cluster_equal_one_pass_and_numpy(tmp_path, dask_cluster):
    path, n_atoms, data = make_random_file(tmp_path)
    args = [path, "forces", "energy", "--per-element", "--per-atom"]
    alone = stats_json(*args)
    remote = stats_json(*args, "--scheduler", dask_cluster.scheduler_address)
    local = stats_json(*args[:2], "--scheduler", "local:2", "--structures", "5:")
    assert remote["stats"] == alone["stats"]
    numbers = data["numbers"]
    wanted = [row for z in np.unique(numbers)
              for row in reference_rows("forces", data["forces"][numbers == z], int(z))]
    wanted += reference_rows("energy", data["energy"][n_atoms > 0] / n_atoms[n_atoms > 0])
    assert_rows_match(remote["stats"], wanted)
    first = int(n_atoms[:5].sum())
    assert_rows_match(local["stats"], reference_rows("forces", data["forces"][first:]))


def test_an_unreachable_scheduler_is_one_line(tmp_path):
    import dask

    path = write_batch(tmp_path / "f.h5", [2] * 4, {"forces": np.ones((8, 3))})
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        result = run("stats", path, "forces", "--scheduler", "tcp://127.0.0.1:9")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.startswith("Error: the dask scheduler at tcp://127.0.0.1:9 cannot be "
                                    "reached"), result.stderr


def test_workers_read_the_format_forced_on_the_inputs(tmp_path, dask_cluster):
    """--input-format travels with the inputs' layout to each worker, which opens its files so."""
    _, frames = poscars(tmp_path)
    args = [tmp_path / "cell*.dat", "positions", "--input-format", "vasp"]
    remote = stats_json(*args, "--scheduler", dask_cluster.scheduler_address)
    assert remote["stats"] == stats_json(*args)["stats"]
    assert_rows_match(remote["stats"], reference_rows(
        "positions", np.concatenate([a.positions for a in frames])))


@pytest.mark.parametrize("address, env", [
    ("local:0", {}), ("local:x", {}), (f"local:{4 * os.cpu_count() + 1}", {}), ("foo", {}),
    ("tcp://", {}), ("tcp://:8786", {}), ("tcp://host:99999", {}), ("tcp://[::1", {}),
    (None, {"DASK_SCHEDULER_ADDRESS": "garbage"})])
def test_bad_scheduler_is_a_usage_error_before_any_connection(tmp_path, address, env):
    path = write_batch(tmp_path / "f.h5", [1], {"forces": np.ones((1, 3))})
    args = ["stats", str(path), "forces"] + (["--scheduler", address] if address else [])
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 2 and "Invalid value for '--scheduler'" in result.stderr
    assert "Traceback" not in result.output



def run_killing_a_worker(*args):
    """stdout of `segcli ARGS --scheduler ADDRESS` on a LocalCluster of 2 worker processes,
    one of which is SIGKILLed as soon as the shards run; asserts exit 0 and the worker gone."""
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        pids = list(client.run(os.getpid).values())
        process = subprocess.Popen(
            [sys.executable, "-m", "segcli", *map(str, args), "--scheduler",
             cluster.scheduler_address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        while not any(client.processing().values()):
            assert process.poll() is None, process.communicate()
            time.sleep(0.01)
        os.kill(pids[0], signal.SIGKILL)
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        assert pids[0] not in client.run(os.getpid).values()
    return out


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_no_shard_counted_twice(tmp_path):
    """SIGKILL one worker process while the shards run: its tasks run again elsewhere, and the
    statistics are one pass's, bit for bit."""
    rng = np.random.default_rng()
    n_atoms = rng.integers(1, 40, 100_000)
    forces = rng.normal(1.0, 2.0, (int(n_atoms.sum()), 3))
    path = write_batch(tmp_path / "f.h5", n_atoms, {"forces": forces})
    out = run_killing_a_worker("stats", path, "forces", "--json", "--chunk-atoms", "500")
    assert_rows_match(json.loads(out)["stats"], reference_rows("forces", forces))
    assert json.loads(out)["stats"] == stats_json(path, "forces", "--chunk-atoms", "500")["stats"]


def segcli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "segcli", *map(str, args)], capture_output=True,
                          **kwargs)


def test_reduce_and_grad_on_a_cluster_equal_a_local_run_bit_for_bit(tmp_path, dask_cluster):
    from batch_reference import random_batch

    path = tmp_path / "random.h5"
    random_batch(path, seed=5, n_structures=300)
    jobs = [(["reduce", path, "mul", "x", "w"], "csv"),
            (["grad", path, "max_norm", "t", "--order", "2", "--direction", "t"], "npy")]
    address = dask_cluster.scheduler_address
    for k, (job, fmt) in enumerate(jobs):  # the client here, the workers as processes
        local, remote = tmp_path / f"local-{k}.h5", tmp_path / f"remote-{k}.h5"
        assert run(*job, "-o", local, "--structures", "7:").exit_code == 0
        result = run(*job, "-o", remote, "--structures", "7:", "--scheduler", address)
        assert result.exit_code == 0, result.output
        assert_identical(remote, local)
        alone = run(*job, "--format", fmt)
        shared = CliRunner().invoke(main, [str(a) for a in (*job, "--format", fmt)],
                                    env={"DASK_SCHEDULER_ADDRESS": address})
        assert shared.exit_code == 0 and shared.stdout_bytes == alone.stdout_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["random.h5"] + [f"{w}-{k}.h5" for w in ("local", "remote") for k in range(2)])


def test_where_on_a_cluster_equals_a_local_run(tmp_path, dask_cluster):
    from batch_reference import random_batch

    path = tmp_path / "random.h5"
    random_batch(path, seed=6, n_structures=200)
    where = ["--where", "s > 0", "--where", "w < 1.5"]
    address = dask_cluster.scheduler_address
    for job in (["reduce", path, "rms_norm", "x", "+", "count"], ["stats", path, "x", "--json"]):
        alone = run(*job, *where)
        remote = run(*job, *where, "--scheduler", address)
        assert alone.exit_code == remote.exit_code == 0, remote.output
        assert remote.stdout == alone.stdout != ""
    for job in (["count"], ["mul", "x", "w"]):  # NaN rows per structure, and per atom
        local, remote = tmp_path / "local.h5", tmp_path / "remote.h5"
        assert run("reduce", path, *job, *where, "-o", local, "--force").exit_code == 0
        assert run("reduce", path, *job, *where, "-o", remote, "--force", "--scheduler",
                   address).exit_code == 0
        assert_identical(remote, local)


@pytest.mark.slow
def test_progress_counts_structures_of_finished_shards_and_in_place_lands(tmp_path):
    path = write_batch(tmp_path / "f.h5", [2] * 30, {"forces": np.ones((60, 3))})
    code, shown, _ = on_terminal("reduce", path, "sum", "forces", "--in-place", "--scheduler",
                                 "local:2", cwd=tmp_path)
    assert code == 0, shown
    bars = [m for m in map(BAR.fullmatch, final_screen(shown)) if m]
    assert [(m["label"], m["done"], m["total"]) for m in bars] == [
        (f"reducing {path} (shards)", "30", "30")], shown
    import h5py

    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["results/sum_forces"][()], np.full((30, 3), 2.0))


def test_a_killed_worker_loses_no_reduce_shard(tmp_path):
    """SIGKILL one worker while reduce's shards run: the output is still one run's."""
    rng = np.random.default_rng()
    n_atoms = rng.integers(1, 40, 30_000)
    path = write_batch(tmp_path / "f.h5", n_atoms,
                       {"forces": rng.normal(size=(int(n_atoms.sum()), 3))})
    local = run("reduce", path, "rms_norm", "forces", "-o", tmp_path / "local.h5")
    assert local.exit_code == 0, local.output
    run_killing_a_worker("reduce", path, "rms_norm", "forces", "-o", tmp_path / "remote.h5",
                         "--chunk-atoms", "500")
    assert_identical(tmp_path / "remote.h5", tmp_path / "local.h5")


def _shape_of(layout):
    from segcli.io import open_inputs

    with open_inputs(layout) as batch:
        return batch.n_structures, int(batch.n_atoms.sum())


def test_a_shared_layout_outlives_the_worker_that_held_it(tmp_path):
    """Dask keeps one replica of what no task waits for (its active memory manager). The one
    worker left holding a batch's shared layout is SIGKILLed, and tasks sent after it still
    get the layout, computed again: scattered, it was lost and they were cancelled."""
    from dask.distributed import Client, LocalCluster, futures_of

    from segcli.cluster import shared
    from segcli.io import open_batch

    n_atoms = np.arange(1, 2001) % 37
    path = write_batch(tmp_path / "f.h5", n_atoms, {"x": np.ones(int(n_atoms.sum()))})
    with open_batch(str(path)) as batch:
        expected, layout_value = (len(n_atoms), int(n_atoms.sum())), batch.layout
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        pids = client.run(os.getpid)
        layout = shared(client, layout_value)
        assert client.gather([client.submit(_shape_of, layout, workers=[address], pure=False)
                              for address in pids]) == [expected] * 2

        def holders():
            return set().union(*client.who_has(futures_of(layout)).values())

        assert len(holders()) == 2
        client.amm.run_once()
        while len(holders()) != 1:
            time.sleep(0.01)
        os.kill(pids[holders().pop()], signal.SIGKILL)
        assert client.gather([client.submit(_shape_of, layout, pure=False)
                              for _ in range(4)]) == [expected] * 4


def _kill_own_worker():
    os.kill(os.getpid(), signal.SIGKILL)


def _nap():
    time.sleep(60)


def test_a_shard_the_cluster_loses_is_one_line():
    """A shard whose worker dies on every try (Dask's KilledWorker; one try allowed here), and
    one that the scheduler cancels, are each a DataError of one line naming the shard."""
    import dask
    from dask.distributed import Client, Future, LocalCluster

    from segcli.cluster import shards_as_done
    from segcli.errors import DataError

    with (dask.config.set({"distributed.scheduler.allowed-failures": 0}),
          LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                       dashboard_address=":0") as cluster, Client(cluster) as client):
        with pytest.raises(DataError, match=r"^shard 2 of 2 was not computed: its worker died on "
                                            r"each of its 1 tries \(the last at tcp://[^)]+\); "
                                            r"the workers' logs say why$"):
            list(shards_as_done(client, lambda k: _kill_own_worker() if k else k, [(0,), (1,)]))

        def cancel_the_running_task():
            while not (keys := [key for keys in client.processing().values() for key in keys]):
                time.sleep(0.01)
            client.cancel([Future(key, client) for key in keys], force=True)

        canceller = threading.Thread(target=cancel_the_running_task)
        canceller.start()
        with pytest.raises(DataError, match=r"^shard 1 of 1 was not computed: the cluster "
                                            r"cancelled it$"):
            list(shards_as_done(client, _nap, [()]))
        canceller.join()


def test_local_workers_start_loaded_and_keep_freed_blocks():
    """The workers of local:K are forked with the tasks' modules loaded (never JAX or Warp),
    and keep a freed block of 32 MiB for reuse where a spawned worker would have imported
    them all and unmapped the block (glibc's mallinfo2: its free bytes)."""
    from segcli.cluster import WORKER_MODULES, cluster_client

    def state():
        import ctypes
        import sys

        import numpy as np

        loaded = {name: name in sys.modules for name in (*WORKER_MODULES, "jax", "warp")}

        class Info(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in [
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost"]]

        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = Info
        block = np.ones(1 << 22)
        del block
        return loaded, mallinfo2().fordblks

    with cluster_client("local:2") as client:
        states = list(client.run(state).values())
    expected = {**dict.fromkeys(WORKER_MODULES, True), "jax": False, "warp": False}
    assert len(states) == 2 and all(loaded == expected for loaded, _ in states)
    assert all(free >= 32 << 20 for _, free in states)


@pytest.mark.slow
def test_local_gpus_starts_one_worker_per_visible_gpu(tmp_path, monkeypatch):
    """local:gpus gives each worker one device of CUDA_VISIBLE_DEVICES (the real GPUs where
    there are some; on a machine without, two named ones, and the workers compute on the
    CPU); with none visible it is one line and exit 1."""
    from segcli.cluster import cluster_client, visible_gpus

    devices = visible_gpus() or ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(devices))
    with cluster_client("local:gpus") as client:
        seen = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert sorted(seen.values()) == sorted(devices)
        assert list(client.nthreads().values()) == [1] * len(devices)
    path = write_batch(tmp_path / "f.h5", [3, 0, 5], {"forces": np.arange(24.0).reshape(8, 3)})
    alone = segcli("reduce", path, "max_norm", "forces")
    shared = segcli("reduce", path, "max_norm", "forces", "--scheduler", "local:gpus")
    assert shared.returncode == 0 and shared.stdout == alone.stdout, shared.stderr
    nothing = segcli("reduce", path, "max_norm", "forces", "--scheduler", "local:gpus",
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert nothing.returncode == 1 and nothing.stderr.count(b"\n") == 1
    assert b"no GPU is visible" in nothing.stderr


def test_bad_data_on_a_cluster_is_one_line_without_worker_logs(tmp_path):
    """NaN in one shard: the workers (processes of a local cluster, sharing stderr) log
    nothing; the error is the one line a run without a cluster gives."""
    forces = np.ones((300, 3))
    forces[250, 0] = np.nan
    path = write_batch(tmp_path / "nan.h5", [3] * 100, {"forces": forces})
    done = segcli("reduce", path, "sum", "forces", "-o", tmp_path / "out.h5",
                  "--scheduler", "local:2", text=True)
    assert done.returncode == 1 and sorted(os.listdir(tmp_path)) == ["nan.h5"]
    assert done.stderr == (f"Error: {path}: field 'forces' holds 1 NaN value(s), the first in "
                           "structure 83\n")
