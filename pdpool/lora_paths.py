"""Where a LoRA adapter may be loaded from at runtime: under one of the allowed folders,
after `..` and symlinks are resolved. One rule for the engine's /v1/load_lora_adapter
(engine/lora/registry.py) and the sidecar, which loads a decode engine's adapter on a
prefill engine from a path it must not trust (sidecar/proxy/adapter_legs.py). No torch."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def resolved_dirs(dirs: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(Path(d).resolve()) for d in dirs)


def is_under_allowed_dir(path: str, resolved: tuple[str, ...]) -> bool:
    """True when `path` (resolved) is one of `resolved` (resolved_dirs) or inside one."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return False
    real = str(Path(path).resolve())
    return any(real == d or real.startswith(d.rstrip("/") + "/") for d in resolved)
