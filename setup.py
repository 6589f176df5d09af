"""segcli's C parts (segcli/native.py's PARTS), built at install time as plain shared libraries
that segcli loads with ctypes. Each is optional: without a C compiler the install goes on,
and segcli takes that part's fallback. The launch handler is built against XLA's FFI header
from `jax.ffi.include_dir()` (jax is a build requirement). The rest of the project's
metadata is in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

_spec = importlib.util.spec_from_file_location(
    "segcli_native_parts", Path(__file__).parent / "segcli" / "native.py")
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)


class BuildParts(build_ext):
    """build_ext for libraries loaded with ctypes: they export no module initialiser, and the
    launch handler gets the FFI header's directory."""

    def get_export_symbols(self, ext):
        return []

    def build_extension(self, ext):
        if ext.name == native.LAUNCH.name:
            try:
                import jax.ffi
            except ImportError as err:
                raise CompileError(f"no jax to give XLA's FFI header: {err}") from err
            ext.include_dirs.append(jax.ffi.include_dir())
        super().build_extension(ext)


setup(
    ext_modules=[Extension(part.name, [part.source], extra_compile_args=list(part.flags),
                           libraries=list(part.libraries), optional=True)
                 for part in native.PARTS],
    cmdclass={"build_ext": BuildParts},
)
