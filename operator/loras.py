"""spec.loras: LoRA adapters every engine of the pool serves, as pod volumes and vLLM's
LoRA flags (pure functions, no I/O; the engine's side is engine/lora/).

    loras:
      maxLoras: 2          # distinct adapters in one batch (vLLM's --max-loras)
      maxRank: 16          # --max-lora-rank
      adapters:
        - name: support-bot
          pvc: adapters    # a claim holding the adapter, mounted read-only
          subPath: support # its folder in the claim (default: the claim's root)
        - name: legal
          path: /models/adapters/legal   # a folder already in the pod (the model volume)

Prefill and decode pods get the same adapters, so a P/D request finds its adapter on both
legs; requests pick one by `model`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .spec import SpecError

LORA_MOUNT = "/var/lib/pdpool/loras"
MAX_ADAPTERS = 64
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str | None = None
    pvc: str | None = None
    sub_path: str | None = None

    @property
    def volume_name(self) -> str:
        return f"lora-{self.name.lower().replace('_', '-').replace('.', '-')}"

    @property
    def folder(self) -> str:
        return self.path or f"{LORA_MOUNT}/{self.name}"


@dataclass(frozen=True)
class LoRASpec:
    adapters: tuple[LoRAAdapter, ...]
    max_loras: int
    max_rank: int

    def engine_args(self) -> list[str]:
        args = [
            "--enable-lora",
            f"--max-loras={self.max_loras}",
            f"--max-lora-rank={self.max_rank}",
        ]
        return args + [f"--lora-modules={a.name}={a.folder}" for a in self.adapters]

    def volumes(self) -> list[dict[str, Any]]:
        return [
            {"name": a.volume_name, "persistentVolumeClaim": {"claimName": a.pvc, "readOnly": True}}
            for a in self.adapters
            if a.pvc
        ]

    def mounts(self) -> list[dict[str, Any]]:
        out = []
        for a in self.adapters:
            if a.pvc:
                mount = {"name": a.volume_name, "mountPath": a.folder, "readOnly": True}
                if a.sub_path:
                    mount["subPath"] = a.sub_path
                out.append(mount)
        return out


def _int(section: dict[str, Any], key: str, default: int, hi: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise SpecError(f"spec.loras.{key} must be an integer in [1, {hi}], got {value!r}")
    return value


def _adapter(i: int, raw: Any) -> LoRAAdapter:
    where = f"spec.loras.adapters[{i}]"
    if not isinstance(raw, dict):
        raise SpecError(f"{where} must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(f"{where}.name must be 1-63 letters, digits, '.', '_' or '-'")
    path, pvc, sub = raw.get("path"), raw.get("pvc"), raw.get("subPath")
    if (path is None) == (pvc is None):
        raise SpecError(f"{where} needs exactly one of path or pvc")
    if path is not None and (not isinstance(path, str) or not path.startswith("/")):
        raise SpecError(f"{where}.path must be an absolute path")
    if pvc is not None and (not isinstance(pvc, str) or not pvc):
        raise SpecError(f"{where}.pvc must name a PersistentVolumeClaim")
    if sub is not None and (
        pvc is None or not isinstance(sub, str) or sub.startswith("/") or ".." in sub.split("/")
    ):
        raise SpecError(f"{where}.subPath must be a relative folder in the pvc (no '..')")
    return LoRAAdapter(name, path, pvc, sub)


def parse_loras(spec: dict[str, Any]) -> LoRASpec | None:
    section = spec.get("loras")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise SpecError("spec.loras must be an object")
    raw = section.get("adapters")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ADAPTERS:
        raise SpecError(f"spec.loras.adapters must list 1 to {MAX_ADAPTERS} adapters")
    adapters = tuple(_adapter(i, a) for i, a in enumerate(raw))
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise SpecError("spec.loras.adapters: names must be unique")
    if len({a.volume_name for a in adapters}) != len(adapters):
        raise SpecError("spec.loras.adapters: names must stay distinct as volume names")
    return LoRASpec(
        adapters,
        _int(section, "maxLoras", min(len(adapters), 4), MAX_ADAPTERS),
        _int(section, "maxRank", 16, 512),
    )
