"""segcli's C sources, compiled on first use with the system's C compiler.

A source is built once per text, compiler and flags into the cache directory
($XDG_CACHE_HOME/segcli), as `<name>-<hash>.so`, and loaded with ctypes (whose calls release
the GIL). Where that fails, `Unavailable` says why in one line, and the caller takes its
NumPy route.

    lib = library(Path("segcli/_moments.c"), ["-O3"], ["-lm"], "SEGCLI_NATIVE_STATS")
"""

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from segcli import cache_directory


class Unavailable(Exception):
    """Why a C source cannot be had."""


def compiler():
    """The C compiler: $CC, else the first of cc, gcc, clang and Python's own on the PATH."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang", *shlex.split(sysconfig.get_config_var("CC") or "")[:1]):
        if shutil.which(name):
            return [name]
    raise Unavailable("no C compiler (cc, gcc or clang) on the PATH")


def compiled(source, flags, libraries=()):
    """The shared library built from `source` (`_name.c`) with `flags` and linked with
    `libraries`, cached by its text, the compiler and the flags; Unavailable saying why it
    cannot be built."""
    command = compiler()
    key = hashlib.sha256(b"\0".join([source.read_bytes(),
                                     " ".join([*command, *flags, *libraries]).encode()]))
    path = Path(cache_directory()) / f"{source.stem.lstrip('_')}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            built = Path(scratch) / path.name
            subprocess.run([*command, *flags, "-shared", "-fPIC", str(source), "-o", str(built),
                            *libraries], check=True, capture_output=True, timeout=120)
            os.replace(built, path)  # whole, even with other processes building it too
    except subprocess.CalledProcessError as err:
        errors = [line for line in err.stderr.decode(errors="replace").splitlines()
                  if "error" in line] or [f"exit status {err.returncode}"]
        raise Unavailable(f"{shlex.join(err.cmd)} failed: {errors[0].strip()}") from None
    except (OSError, subprocess.SubprocessError) as err:
        raise Unavailable(f"cannot build {path}: {err}") from None
    return path


def library(source, flags, libraries, switch):
    """`source` built (see compiled) and loaded, or None where it cannot be, or where the
    environment variable `switch` is 0."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(compiled(source, flags, libraries)))
    except (Unavailable, OSError):
        return None
