"""Builds a C source of kernels/csrc/ into a shared library with the system's C compiler, once
per source, compiler, flags and CPU, and loads it with ctypes. The one builder of the CPU
attention kernels.

The library is cached under $PDPOOL_KERNEL_CACHE, else ~/.cache/pdpool/cpu-kernels (a
temporary folder when neither is writable). Without a compiler, or when the build fails,
`load` returns None and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("pdpool.kernels")

CACHE_ENV = "PDPOOL_KERNEL_CACHE"
# Sources are compiled for this CPU (`-march=native`): the cache key holds its flags.
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-c")
LINK_FLAGS = ("-shared",)

SOURCE_DIR = Path(__file__).with_name("csrc")

_lock = threading.Lock()
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


def available(disable_env: str, library: Callable[[], Optional[ctypes.CDLL]]) -> bool:
    """Whether a kernel may run here: not disabled by `disable_env` set to "0", and
    `library()` (its build, on first call) loaded."""
    if os.environ.get(disable_env, "1").strip() == "0":
        return False
    return library() is not None


def compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "pdpool", "cpu-kernels"
    )
    for candidate in (Path(base), Path(tempfile.gettempdir()) / "pdpool-cpu-kernels"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no writable folder for the CPU kernels")


def _build(name: str, source: str, cc: str, compile_flags, libs) -> Path:
    key = "\0".join([source, cc, *compile_flags, *LINK_FLAGS, *libs, _cpu_signature()])
    folder = _cache_dir()
    lib_path = folder / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if lib_path.exists():
        return lib_path
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, obj, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.o", Path(tmp) / "lib.so"
        src.write_text(source)
        for argv in (
            [cc, *compile_flags, "-o", str(obj), str(src)],
            [cc, *LINK_FLAGS, "-o", str(built), str(obj), *libs],
        ):
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
        os.replace(built, lib_path)  # atomic: concurrent builders each write a whole file
    return lib_path


def source(name: str) -> str:
    """The C source kernels/csrc/<name>.c."""
    return (SOURCE_DIR / f"{name}.c").read_text()


def load(
    name: str,
    declare: Callable[[ctypes.CDLL], None],
    extra_flags: tuple[str, ...] = (),
    libs: tuple[str, ...] = (),
    variant: str = "",
) -> Optional[ctypes.CDLL]:
    """The library built from kernels/csrc/<name>.c (once per process and `variant`, a
    build with other `extra_flags`), its functions typed by `declare`; None when it cannot
    be built here."""
    key = f"{name}_{variant}" if variant else name
    with _lock:
        if key not in _loaded:
            lib, cc = None, compiler()
            if cc:
                try:
                    built = _build(key, source(name), cc, COMPILE_FLAGS + extra_flags, libs)
                    lib = ctypes.CDLL(str(built))
                    declare(lib)  # CDLL calls release the GIL
                except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                    detail = getattr(exc, "stderr", b"") or b""
                    log.warning(
                        "CPU kernel %s not built (%s %s): torch path",
                        key,
                        exc,
                        detail.decode(errors="replace")[-500:],
                    )
                    lib = None
            _loaded[key] = lib
        return _loaded[key]
