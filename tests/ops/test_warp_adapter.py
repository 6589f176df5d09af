"""Warp's private API behind one adapter (segcli/ops/_warp_private.py): every name it takes is
in the installed Warp with the kind and parameters it is used with, the Warp installed is one
pyproject.toml allows, and nothing else in segcli touches `warp._src`."""

import re
from pathlib import Path

import warp as wp
from packaging.requirements import Requirement

from segcli.ops import _native
from segcli.ops import _warp_private as private

ROOT = Path(__file__).resolve().parents[2]


def test_every_private_name_is_there_as_used():
    """Fails naming each name of PRIVATE that this Warp lacks or changed."""
    problems = private.changed()
    assert not problems, f"Warp {wp.__version__} changed its private API:\n" + "\n".join(problems)


def test_a_missing_or_changed_name_is_named():
    """The check names what is missing and what changed kind or parameters."""
    assert private.check({
        "warp._src.types.segcli_no_such_name": ("function", ()),
        "warp._src.types.array_t": ("function", ()),
        "warp._src.types.strides_from_shape": ("function", ("dtype", "shape")),
        "warp._src.jax.ffi.FfiArg": ("class", ("name", "type", "in_out")),
    }) == [
        "warp._src.types.segcli_no_such_name is missing",
        "warp._src.types.array_t is no longer a function",
        "warp._src.types.strides_from_shape takes ('shape', 'dtype'), not ('dtype', 'shape') "
        "first",
    ]


def test_what_the_handler_reads_of_warps_objects_is_there():
    """The attributes the handler reads of a kernel, its FFI arguments and Warp's runtime."""

    @wp.kernel
    def double(x: wp.array(dtype=float), out: wp.array(dtype=float)):
        out[wp.tid()] = 2.0 * x[wp.tid()]

    wp.init()
    assert hasattr(double, "grid_stride") and double.module is not None
    assert [a.label for a in double.adj.args] == ["x", "out"]
    arg = private.ffi_arg("x", double.adj.args[0].type, False)
    assert arg.is_array and arg.warp_ndim == 1 and not arg.in_out
    assert private.cuda_launch_address()
    assert private.scalar_type(wp.float32)(1.5).value == 1.5


def test_the_installed_warp_is_one_pyproject_allows():
    [warp] = [Requirement(d) for d in re.findall(r'^\s*"(warp-lang[^"]*)"',
                                                 (ROOT / "pyproject.toml").read_text(), re.M)]
    assert warp.specifier.contains(wp.__version__), (wp.__version__, str(warp.specifier))
    assert any(s.operator == "<" for s in warp.specifier), "no upper bound: versions unchecked"


def test_only_the_adapter_uses_warps_private_api():
    uses = [str(path.relative_to(ROOT)) for path in (ROOT / "segcli").rglob("*.py")
            if re.search(r"\b(warp|wp)\._src\b", path.read_text())]
    assert uses == ["segcli/ops/_warp_private.py"]
    assert _native.available(), _native.unavailable()
