"""segcli.check_ops: the checks of `segcli gradcheck` as a function (the same report as the
command's --json and table), the kink rules of the registry, and its refusals."""

import json

import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

import segcli
from segcli.cli import main
from segcli.registry import OPS, TIE_GAP

N_ATOMS = [3, 4, 5, 2, 1]


def command(*args):
    result = CliRunner().invoke(main, ["gradcheck", *map(str, args)])
    return result.exit_code, result.output


def kinked_forces(rng):
    """Forces of N_ATOMS structures: 0 without kinks, 1 all zero, 2 two atoms tied for the
    largest norm, 3 a component tied at its max and one without spread, 4 one atom."""
    n = sum(N_ATOMS)
    directions = rng.normal(size=(n, 3))
    forces = directions / np.linalg.norm(directions, axis=1, keepdims=True)
    forces *= (1 + 0.1 * rng.permutation(n))[:, None]  # no two norms within 1e-3
    forces[3:7] = 0
    forces[8], forces[10] = 10 * forces[0], -10 * forces[0]
    forces[12:14, 0] = 5.0
    forces[12:14, 1] = -0.5
    return forces


def numpy_kinks(rule, rows):
    """Whether one structure's rows sit at `rule`'s kink, by NumPy in float64."""
    rows = np.asarray(rows, np.float64)
    scale = TIE_GAP * np.abs(rows).max(axis=0)
    if rule == "zero_norm":
        return bool(np.all(rows == 0))
    if rule == "norm_ties":
        norms = np.sort(np.linalg.norm(rows, axis=1))
        return bool(norms[-1] == 0 or (len(norms) > 1 and norms[-1] - norms[-2] <= TIE_GAP *
                                       norms[-1]))
    if rule == "value_ties":
        ordered = np.sort(rows, axis=0)
        return len(rows) > 1 and bool(np.any((ordered[-1] - ordered[-2] <= scale) |
                                             (ordered[1] - ordered[0] <= scale)))
    return bool(np.any(np.ptp(rows, axis=0) <= scale))  # zero_spread


@pytest.mark.parametrize("name, kinked", [("rms_norm", {1}), ("max_norm", {1, 2}),
                                          ("max", {1, 3}), ("min", {1, 3}),
                                          ("std", {1, 3, 4}), ("sum", set())])
def test_each_kink_rule_finds_exactly_the_structures_numpy_finds(name, kinked):
    forces = kinked_forces(np.random.default_rng(5))
    ends = np.cumsum(N_ATOMS)
    structures = [forces[end - n:end] for n, end in zip(N_ATOMS, ends)]
    found = {s for s, rows in enumerate(structures) if OPS[name].at_kink(rows)}
    assert found == kinked
    if OPS[name].kinks:
        assert found == {s for s, rows in enumerate(structures)
                         if numpy_kinks(OPS[name].kinks, rows)}
    assert not OPS[name].at_kink(np.zeros((0, 3)))


def test_the_function_gives_the_commands_json_and_table_and_leaves_kinks_out(tmp_path):
    rng = np.random.default_rng(3)
    path = write_batch(tmp_path / "kinks.h5", N_ATOMS,
                       {"forces": kinked_forces(rng), "positions": rng.normal(size=(15, 3))})
    checked = segcli.check_ops(path, op="max_norm", order=1, structures=slice(None))
    assert checked.passed and checked.atoms == 15 and checked.skipped == {}
    assert checked.source == {"file": str(path), "structures": [0, 5]}
    first = [row for row in checked.summary.rows if row.order == 1]
    assert len(first) == 1 and "leave out 2 structure(s) where max_norm is not " \
        "differentiable (norm_ties)" in first[0].note
    code, output = command(path, "--op", "max_norm", "--order", "1", "--structures", ":",
                           "--json")
    assert code == 0 and json.loads(output) == json.loads(json.dumps(checked.to_dict()))


def test_random_data_gives_the_commands_json_and_table():
    checked = segcli.check_ops(random=(20, 4), op=["count", "bincount"], seed=2)
    assert checked.passed and checked.source == {"random": [20, 4]} and checked.atoms == 20
    assert [(row.function, row.order) for row in checked.summary.rows] == [("count", 0),
                                                                           ("bincount", 0)]
    args = ["--random", "20:4", "--op", "count,bincount", "--seed", "2"]
    code, output = command(*args, "--json")
    assert code == 0 and json.loads(output) == checked.to_dict()
    code, output = command(*args)
    assert code == 0 and output == f"{checked}\n"
    assert output.startswith("random data: 20 atoms in 4 structures, order 2, device ")


@pytest.mark.parametrize("arguments, named", [
    ({"order": 0}, "order must be an integer from 1 to 8, not 0"), ({"order": 9}, "not 9"),
    ({"seed": -1}, "seed must be an integer from 0"),
    ({"inputs": "x.h5", "field": 3}, "field must be a field's name, not 3"),
    ({"random": (0, 3)}, "random: ATOMS and STRUCTURES must be at least 1 and at most 10000000"),
    ({"random": "10:2"}, "random must be (atoms, structures), not '10:2'"),
    ({"op": "median"}, "op: unknown op 'median'"), ({"op": []}, "op: no op given"),
    ({"device": "tpu"}, "device must be one of auto, cpu, gpu"),
    ({"structures": slice(0, 2)}, "structures= and field= need inputs"),
    ({"inputs": "x.h5", "random": (4, 2)}, "give inputs or random=, not both"),
])
def test_bad_arguments_raise_value_errors_naming_them(arguments, named):
    with pytest.raises(ValueError) as raised:
        segcli.check_ops(**arguments)
    assert isinstance(raised.value, segcli.ArgumentError) and named in str(raised.value)


def test_an_op_whose_field_the_file_lacks_is_a_data_error(tmp_path):
    path = write_batch(tmp_path / "no_energy.h5", [2, 3], {"forces": np.ones((5, 3))})
    with pytest.raises(segcli.DataError, match="no field 'energy'"):
        segcli.check_ops(path, op="mul")
