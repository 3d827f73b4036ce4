"""The adapters a server serves, by name (no torch: the HTTP process owns this).

Requests name an adapter as their `model`; the server resolves it here and sends the
adapter's `LoRARef` with the request to the engine core, which loads the weights on first
use. Names come from `--lora-modules` at start and, when vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, from `/v1/load_lora_adapter`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any, Optional

from pdpool.lora_paths import is_under_allowed_dir, resolved_dirs
from pdpool.engine.lora.adapter_dir import (
    AdapterError,
    AdapterFiles,
    check_against_model,
    read_adapter,
)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_NAME_CHARS = 256


@dataclasses.dataclass(frozen=True)
class LoRARef:
    """An adapter as a request carries it to the engine core."""

    name: str
    lora_id: int  # vLLM's lora_int_id: 1, 2, ... in registration order
    path: str
    digest: str

    @property
    def hash_key(self) -> tuple[str, str, str]:
        """What goes into the first block's hash: the adapter's name and content."""
        return ("lora", self.name, self.digest)


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: invalid JSON {text!r}: {exc}") from exc
        name, path = obj.get("name") if isinstance(obj, dict) else None, None
        if isinstance(obj, dict):
            path = obj.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f"--lora-modules: JSON needs string name and path, got {text!r}")
        base = obj.get("base_model_name")
        return LoRAModule(name, path, base if isinstance(base, str) else None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path or JSON, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def registry_from_config(config: Any, base_model: str) -> LoRARegistry:
    """The adapters of --lora-modules, read and checked (AdapterError or ValueError on the
    first bad one: the server does not start)."""
    from pdpool.engine.lora.adapter_dir import linear_shapes

    registry = LoRARegistry(
        base_model,
        config.max_lora_rank,
        tuple(config.lora_allowed_dirs),
        linear_shapes(config.model),
    )
    for text in config.lora_modules:
        module = parse_lora_module(text)
        registry.add(module.name, registry.check_new(module.name, module.path, dynamic=False))
    return registry


def runtime_updates_enabled() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


class LoRARegistry:
    def __init__(
        self,
        base_model: str,
        max_rank: int,
        allowed_dirs: tuple[str, ...] = (),
        shapes: Optional[dict[str, tuple[int, int]]] = None,
    ) -> None:
        self.base_model = base_model
        self.shapes = shapes  # the base model's LoRA-targetable layers (adapter_dir.linear_shapes)
        self.max_rank = max_rank
        self.allowed_dirs = resolved_dirs(allowed_dirs)
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARef] = {}
        self._next_id = 1

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def get(self, name: object) -> Optional[LoRARef]:
        with self._lock:
            return self._by_name.get(name) if isinstance(name, str) else None

    def check_new(self, name: object, path: object, dynamic: bool) -> AdapterFiles:
        """Reads and checks an adapter before it is added; raises AdapterError."""
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
            raise AdapterError(f"lora_name must be a non-empty string of at most {MAX_NAME_CHARS}")
        if not isinstance(path, str) or not path.strip():
            raise AdapterError("lora_path must be a non-empty string")
        if name == self.base_model:
            raise AdapterError(f"{name!r} is the base model's name")
        if self.get(name) is not None:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        if dynamic:
            self._check_allowed(path)
        files = read_adapter(path, self.max_rank)
        if self.shapes is not None:
            check_against_model(files, self.shapes)
        return files

    def _check_allowed(self, path: str) -> None:
        # Fail closed: a runtime load reads files the operator named, never any path.
        if not self.allowed_dirs:
            raise AdapterError(
                "runtime LoRA loading needs --lora-allowed-dir (the folders adapters may be "
                "loaded from)"
            )
        if not is_under_allowed_dir(path, self.allowed_dirs):
            raise AdapterError(f"LoRA adapter path {path!r} is outside --lora-allowed-dir")

    def add(self, name: str, files: AdapterFiles) -> LoRARef:
        with self._lock:
            if name in self._by_name:
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
            ref = LoRARef(name, self._next_id, files.path, files.digest)
            self._next_id += 1
            self._by_name[name] = ref
            return ref

    def remove(self, name: object) -> LoRARef:
        with self._lock:
            ref = self._by_name.pop(name, None) if isinstance(name, str) else None
        if ref is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.")
        return ref
