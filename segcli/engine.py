"""The op table and chunked evaluation: what each op takes, gives, and how it is applied.

This layer sits between `segcli.ops` (pure math) and the I/O and command layers. It never
imports jax or warp at module level, so the command line starts fast.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class InputSpec:
    """One argument of an op: per-atom or per-structure, and its trailing shape (None: any)."""

    per: str
    shape: tuple | None = None

    def describe(self):
        rows = "N" if self.per == "atom" else "S"
        tail = ", *F" if self.shape is None else "".join(f", {d}" for d in self.shape)
        return f"({rows}{tail})"


@dataclass(frozen=True)
class OpSpec:
    """One segment op: its `segcli.ops` function, its inputs and where its output lives."""

    name: str
    function: str
    inputs: tuple
    output_per: str
    output_shape: str
    summary: str
    differentiable: bool = True

    def apply(self, *arrays, idx, num_segments):
        """Run the op on arrays (one per input) with segment ids `idx` and `num_segments` structures."""
        from segcli import ops

        return getattr(ops, self.function)(*arrays, idx, num_segments)


_ATOM = InputSpec("atom")
_VEC3 = InputSpec("atom", (3,))

OPS = {
    spec.name: spec
    for spec in (
        OpSpec("sum", "segmented_sum", (_ATOM,), "structure", "(S, *F)", "sum over each structure's atoms"),
        OpSpec("mean", "segmented_mean", (_ATOM,), "structure", "(S, *F)", "mean over each structure's atoms (0 if empty)"),
        OpSpec("dot", "segmented_dot", (_ATOM, _ATOM), "structure", "(S,)", "sum of <a_i, b_i> over each structure"),
        OpSpec("mul", "segmented_mul", (_ATOM, InputSpec("structure", ())), "atom", "(N, *F)", "each atom's value times its structure's scalar"),
        OpSpec("rms_norm", "segmented_rms_norm", (_ATOM,), "structure", "(S,)", "sqrt(mean over atoms of |x_i|^2)"),
        OpSpec("max_norm", "segmented_max_norm", (_ATOM,), "structure", "(S,)", "largest |x_i| over each structure's atoms"),
        OpSpec("matvec", "segmented_matvec", (_VEC3, InputSpec("structure", (3, 3))), "atom", "(N, 3)", "m_sᵀ @ v_i, e.g. scaled_positions × cell"),
        OpSpec("count", "segmented_count", (), "structure", "(S,)", "atoms in each structure", differentiable=False),
    )
}
