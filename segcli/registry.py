"""The segment ops, each declared once: what it takes, what it gives, how it differentiates.

Every consumer (the engine, the commands and their help, gradcheck, the benchmarks, the
tests, the README's check) reads `OPS` and never restates the list of ops. Adding an op
means its `segcli.ops` function, its `segcli.reference` function and its entry here, with
its kink rule (`KINKS`) if it is not differentiable everywhere. Imports neither numpy, jax
nor warp, so the command line starts fast.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arg:
    """One array argument of an op: per atom (N rows) or per structure (S rows), its trailing
    shape (None: any, *F), and its kind: "float" data or integer "labels" (e.g. numbers)."""

    per: str
    shape: tuple | None = None
    kind: str = "float"
    invertible: bool = False
    """A per-structure square matrix that should be invertible (a cell): the commands count
    the structures where it is singular, warn about them or, with --strict, refuse them."""

    def describe(self):
        rows = "N" if self.per == "atom" else "S"
        tail = ", *F" if self.shape is None else "".join(f", {d}" for d in self.shape) or ","
        return f"({rows}{tail})" + (" labels" if self.kind == "labels" else "")


@dataclass(frozen=True)
class Op:
    """One segment op, `segcli.ops.segmented_<name>`.

    output_shape: the trailing shape of the result, None for the first input's, or a tuple
    whose strings name a static param (bincount's ("length",)). output_dtype: "float" (the
    computing precision), "input" (the first input's: integer data stays integer) or "count"
    (int32 from the library, as JAX's default integer; int64 in files and outputs, as every
    count there: n_atoms, integer sums, statistics).
    kinks: None, or the name of the rule in `KINKS` saying where the op is not differentiable
    (see `at_kink`). integers: integer data is reduced in its own dtype. takes_sorted: the
    function takes `indices_are_sorted`. params: static keyword parameters with their
    defaults.
    """

    name: str
    inputs: tuple
    output_per: str
    summary: str
    output_shape: tuple | None = None
    output_dtype: str = "float"
    differentiable: bool = True
    kinks: str | None = None
    integers: bool = False
    takes_sorted: bool = True
    params: dict = field(default_factory=dict, hash=False)

    @property
    def function(self):
        """The op's function in `segcli.ops`."""
        from segcli import ops

        return getattr(ops, "segmented_" + self.name)

    @property
    def reference(self):
        """The op's pure-JAX function in `segcli.reference`."""
        from segcli import reference

        return getattr(reference, "segmented_" + self.name)

    def trailing_shape(self, first, params):
        """The result's trailing shape, given the first input's trailing shape and the params."""
        if self.output_shape is None:
            return tuple(first)
        return tuple(params[d] if isinstance(d, str) else d for d in self.output_shape)

    def describe_output(self):
        """The result's shape as text: (S, *F), (N, 3), (S, length), ..."""
        rows = "N" if self.output_per == "atom" else "S"
        tail = ("*F",) if self.output_shape is None else self.output_shape
        return f"({', '.join((rows, *map(str, tail)))}{',' if not tail else ''})"

    def at_kink(self, rows):
        """Whether one structure's rows (a NumPy array, atoms x components of the first input)
        sit where the op is not differentiable, by its kink rule: False without a rule or
        without rows.

            OPS["rms_norm"].at_kink(np.zeros((2, 3)))  # True: the norm of 0 has no derivative
        """
        return self.kinks is not None and len(rows) > 0 and bool(KINKS[self.kinks](rows))

    def apply(self, *arrays, idx, num_segments, indices_are_sorted=False, **params):
        """Run the op on arrays (one per input) with segment ids `idx` and `num_segments`
        structures; `indices_are_sorted` promises sorted ids to the ops that take the promise;
        `params` override the op's static params."""
        promise = {"indices_are_sorted": indices_are_sorted} if self.takes_sorted else {}
        return self.function(*arrays, idx, num_segments, **{**self.params, **params}, **promise)


TIE_GAP = 1e-3
"""Relative gap below which two values tie (or a spread is zero) for the kink rules (the
finite differences of gradcheck, which move each entry by ~1e-5 relative, could cross it)."""


def _zero_norm(rows):
    return not rows.any()


def _norm_ties(rows):
    norms = (rows * rows).sum(axis=1) ** 0.5
    norms.sort()
    return norms[-1] == 0 or (len(norms) > 1 and norms[-2] >= norms[-1] * (1 - TIE_GAP))


def _value_ties(rows):
    if len(rows) < 2:
        return False
    ordered = rows.copy()
    ordered.sort(axis=0)
    gap = TIE_GAP * abs(rows).max(axis=0)
    return bool(((ordered[-1] - ordered[-2] <= gap) | (ordered[1] - ordered[0] <= gap)).any())


def _zero_spread(rows):
    return bool((rows.max(axis=0) - rows.min(axis=0) <= TIE_GAP * abs(rows).max(axis=0)).any())


KINKS = {"zero_norm": _zero_norm, "norm_ties": _norm_ties, "value_ties": _value_ties,
         "zero_spread": _zero_spread}
"""Op.kinks -> whether a structure's rows (a NumPy array, atoms x components of the first
input, at least one row) sit at a kink: all entries 0 (a norm at 0); the largest norm 0 or
tied within TIE_GAP (the max of norms); a component's largest or smallest value tied (max,
min); a component without spread (std). Written with array methods only, so that this
module needs no NumPy until a rule runs."""


_ATOMS = Arg("atom")
_VEC3 = Arg("atom", (3,))
_SCALAR = Arg("structure", ())
_LABELS = Arg("atom", (), "labels")

OPS = {
    op.name: op
    for op in (
        Op("sum", (_ATOMS,), "structure", "sum over each structure's atoms",
           output_dtype="input", integers=True),
        Op("mean", (_ATOMS,), "structure", "mean over each structure's atoms (0 if empty)"),
        Op("dot", (_ATOMS, _ATOMS), "structure", "sum of <a_i, b_i> over each structure",
           output_shape=()),
        Op("mul", (_ATOMS, _SCALAR), "atom", "each atom's value times its structure's scalar",
           takes_sorted=False),
        Op("rms_norm", (_ATOMS,), "structure", "sqrt(mean over atoms of |x_i|^2)",
           output_shape=(), kinks="zero_norm"),
        Op("max_norm", (_ATOMS,), "structure", "largest |x_i| over each structure's atoms",
           output_shape=(), kinks="norm_ties"),
        Op("matvec", (_VEC3, Arg("structure", (3, 3), invertible=True)), "atom",
           "m_sᵀ @ v_i, e.g. scaled_positions × cell", output_shape=(3,), takes_sorted=False),
        Op("count", (), "structure", "atoms in each structure", output_shape=(),
           output_dtype="count", differentiable=False),
        Op("max", (_ATOMS,), "structure", "componentwise max over each structure (-inf if empty)",
           output_dtype="input", kinks="value_ties", integers=True),
        Op("min", (_ATOMS,), "structure", "componentwise min over each structure (+inf if empty)",
           output_dtype="input", kinks="value_ties", integers=True),
        Op("var", (_ATOMS,), "structure", "componentwise population variance (0 if empty)"),
        Op("std", (_ATOMS,), "structure", "componentwise population standard deviation",
           kinks="zero_spread"),
        Op("logsumexp", (_ATOMS,), "structure",
           "componentwise log sum exp, stable (-inf if empty)"),
        Op("softmax", (_ATOMS,), "atom", "componentwise exp(x_i) / sum over its structure"),
        Op("bincount", (_LABELS,), "structure", "per structure, rows of each label in [0, length)",
           output_shape=("length",), output_dtype="count", differentiable=False,
           params={"length": 119}),
    )
}
"""name -> Op, in the order the commands list them. bincount's default length 119 counts
atomic numbers 0..118 (the composition)."""
