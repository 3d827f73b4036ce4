"""spec.loras: LoRA adapters every engine of the pool serves, as pod volumes, init steps and
vLLM's LoRA flags (pure functions, no I/O; the engine's side is engine/lora/).

    loras:
      maxLoras: 2          # distinct adapters in one batch (vLLM's --max-loras)
      maxRank: 16          # --max-lora-rank
      runtimeUpdates: true # /v1/load_lora_adapter on every engine (from allowedDirs only),
      allowedDirs: [/models/adapters]  # and the sidecar may load an adapter on a prefill leg
      adapters:
        - name: support-bot
          pvc: adapters    # a claim holding the adapter, mounted read-only
          subPath: support # its folder in the claim (default: the claim's root)
        - name: legal
          path: /models/adapters/legal   # a folder already in the pod (the model volume)
        - name: sql
          hub: acme/qwen3-sql-lora       # a Hugging Face repo, fetched by an init container
          revision: v2                   # as the base model is (spec.model.hfTokenSecret)
          rollout:                       # optional: GIE's weighted rollout (gie_adapters.py)
            - {adapter: sql-v3, weight: 10}

Prefill and decode pods get the same adapters, so a P/D request finds its adapter on both
legs; requests pick one by `model`. Every check raises SpecError with one line: the pool's
Ready condition shows it and nothing is applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdpool.command_lines import Adapters

from .spec import SpecError

LORA_MOUNT = "/var/lib/pdpool/loras"  # claims, one folder per adapter
HUB_MOUNT = "/var/lib/pdpool/lora-hub"  # hub adapters, fetched into one emptyDir
HUB_VOLUME = "lora-hub"
MAX_ADAPTERS = 64
# A served name: a folder name and one `--lora-modules name=path` entry, so no path
# separator and no '='; short enough that `fetch-lora-<name>` is a DNS label.
MAX_NAME = 48
_NAME = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}$")
# Hugging Face's repo id rule: [namespace/]name, letters, digits, '-', '_', '.', no '--'
# or '..', no '-' or '.' at either end, at most 96 characters a part.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")
# A branch, tag or commit (git ref characters; no '..', no leading '-' or '/').
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}$")
SOURCES = ("path", "pvc", "hub")
FIELDS = {"name", "path", "pvc", "subPath", "hub", "revision", "rollout"}
MAX_WEIGHT = 1_000_000  # GIE's InferenceModelRewrite weight bound


@dataclass(frozen=True)
class RolloutTarget:
    adapter: str  # another served name of spec.loras.adapters (or this one)
    weight: int


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str | None = None
    pvc: str | None = None
    sub_path: str | None = None
    hub: str | None = None
    revision: str | None = None
    # GIE: requests for `name` go to these adapters by weight (this one included only when
    # it is listed); empty: `name` is served as itself.
    rollout: tuple[RolloutTarget, ...] = ()

    @property
    def volume_name(self) -> str:
        return f"lora-{self.name.lower().replace('_', '-').replace('.', '-')}"

    @property
    def folder(self) -> str:
        if self.hub:
            return f"{HUB_MOUNT}/{self.name}"
        return self.path or f"{LORA_MOUNT}/{self.name}"


@dataclass(frozen=True)
class LoRASpec:
    adapters: tuple[LoRAAdapter, ...]
    max_loras: int
    max_rank: int
    runtime_updates: bool = False
    allowed_dirs: tuple[str, ...] = ()

    def launch(self) -> Adapters:
        """The engines' adapters, as pdpool/command_lines.py renders them."""
        return Adapters(
            self.max_loras,
            self.max_rank,
            tuple((a.name, a.folder) for a in self.adapters),
            self.allowed_dirs if self.runtime_updates else (),
        )

    def engine_env(self) -> list[dict[str, Any]]:
        if not self.runtime_updates:
            return []
        return [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"}]

    @property
    def sidecar_allowed_dirs(self) -> tuple[str, ...]:
        """Where the decode sidecar may load a decode engine's adapter from onto a prefill
        engine: only when the pool allows runtime updates."""
        return self.allowed_dirs if self.runtime_updates else ()

    @property
    def hub_adapters(self) -> tuple[LoRAAdapter, ...]:
        return tuple(a for a in self.adapters if a.hub)

    def volumes(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"name": a.volume_name, "persistentVolumeClaim": {"claimName": a.pvc, "readOnly": True}}
            for a in self.adapters
            if a.pvc
        ]
        if self.hub_adapters:
            out.append({"name": HUB_VOLUME, "emptyDir": {}})
        return out

    def mounts(self) -> list[dict[str, Any]]:
        out = []
        for a in self.adapters:
            if a.pvc:
                mount = {"name": a.volume_name, "mountPath": a.folder, "readOnly": True}
                if a.sub_path:
                    mount["subPath"] = a.sub_path
                out.append(mount)
        if self.hub_adapters:
            out.append({"name": HUB_VOLUME, "mountPath": HUB_MOUNT, "readOnly": True})
        return out


def _int(section: dict[str, Any], key: str, default: int, hi: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise SpecError(f"spec.loras.{key} must be an integer in [1, {hi}], got {value!r}")
    return value


def _name(where: str, name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(
            f"{where} must be 1-{MAX_NAME} letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit), got {name!r}"[:300]
        )
    return name


def _rollout(where: str, raw: Any) -> tuple[RolloutTarget, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ADAPTERS:
        raise SpecError(f"{where}.rollout must list 1 to {MAX_ADAPTERS} {{adapter, weight}}")
    out = []
    for j, item in enumerate(raw):
        at = f"{where}.rollout[{j}]"
        if not isinstance(item, dict) or set(item) - {"adapter", "weight"}:
            raise SpecError(f"{at} must be an object with adapter and weight")
        weight = item.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT:
            raise SpecError(f"{at}.weight must be an integer in [1, {MAX_WEIGHT}]")
        out.append(RolloutTarget(_name(f"{at}.adapter", item.get("adapter")), weight))
    if len({t.adapter for t in out}) != len(out):
        raise SpecError(f"{where}.rollout names an adapter twice")
    return tuple(out)


def _adapter(i: int, raw: Any) -> LoRAAdapter:
    where = f"spec.loras.adapters[{i}]"
    if not isinstance(raw, dict):
        raise SpecError(f"{where} must be an object")
    unknown = sorted(str(k) for k in set(raw) - FIELDS)
    if unknown:
        raise SpecError(f"{where} has unknown fields: {', '.join(unknown)}"[:300])
    name = _name(f"{where}.name", raw.get("name"))
    given = [s for s in SOURCES if raw.get(s) is not None]
    if len(given) != 1:
        found = f" (got {', '.join(given)})" if given else ""
        raise SpecError(f"{where} needs exactly one source: path, pvc or hub{found}")
    path, pvc, sub = raw.get("path"), raw.get("pvc"), raw.get("subPath")
    hub, revision = raw.get("hub"), raw.get("revision")
    if path is not None and (
        not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/")
    ):
        raise SpecError(f"{where}.path must be an absolute path (no '..')")
    if pvc is not None and (not isinstance(pvc, str) or not pvc):
        raise SpecError(f"{where}.pvc must name a PersistentVolumeClaim")
    if sub is not None and (
        pvc is None or not isinstance(sub, str) or sub.startswith("/") or ".." in sub.split("/")
    ):
        raise SpecError(f"{where}.subPath must be a relative folder in the pvc (no '..')")
    if hub is not None and (
        not isinstance(hub, str) or not _HUB_ID.match(hub) or "--" in hub or ".." in hub
    ):
        raise SpecError(
            f"{where}.hub must be a Hugging Face repo id (org/name: letters, digits, "
            f"'-', '_', '.'), got {hub!r}"[:300]
        )
    if revision is not None and (
        hub is None
        or not isinstance(revision, str)
        or not _REVISION.match(revision)
        or ".." in revision
    ):
        raise SpecError(f"{where}.revision must be a branch, tag or commit of its hub repo")
    return LoRAAdapter(name, path, pvc, sub, hub, revision, _rollout(where, raw.get("rollout")))


def _allowed_dirs(section: dict[str, Any], adapters: tuple[LoRAAdapter, ...]) -> tuple[str, ...]:
    raw = section.get("allowedDirs")
    if raw is None:  # the operator's own adapter folders
        dirs = [LORA_MOUNT] if any(a.pvc for a in adapters) else []
        return tuple(dirs + ([HUB_MOUNT] if any(a.hub for a in adapters) else []))
    if not isinstance(raw, list) or not 1 <= len(raw) <= 16:
        raise SpecError("spec.loras.allowedDirs must list 1 to 16 absolute folders")
    for d in raw:
        if not isinstance(d, str) or not d.startswith("/") or ".." in d.split("/") or d == "/":
            raise SpecError(
                f"spec.loras.allowedDirs: {d!r} is not an absolute folder (not /)"[:300]
            )
    return tuple(raw)


def _check_rollouts(adapters: tuple[LoRAAdapter, ...]) -> None:
    served = {a.name for a in adapters}
    for i, a in enumerate(adapters):
        for t in a.rollout:
            if t.adapter not in served:
                raise SpecError(
                    f"spec.loras.adapters[{i}].rollout: {t.adapter!r} is not an adapter "
                    "of spec.loras.adapters"
                )


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
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"spec.loras.adapters: names must be unique ({', '.join(dupes)} twice)")
    if len({a.volume_name for a in adapters}) != len(adapters):
        raise SpecError("spec.loras.adapters: names must stay distinct as volume names")
    _check_rollouts(adapters)
    runtime = section.get("runtimeUpdates", False)
    if not isinstance(runtime, bool):
        raise SpecError("spec.loras.runtimeUpdates must be true or false")
    dirs = _allowed_dirs(section, adapters)
    if runtime and not dirs:
        raise SpecError(
            "spec.loras.runtimeUpdates needs spec.loras.allowedDirs (the folders adapters "
            "may be loaded from)"
        )
    return LoRASpec(
        adapters,
        _int(section, "maxLoras", min(len(adapters), 4), MAX_ADAPTERS),
        _int(section, "maxRank", 16, 512),
        runtime,
        dirs,
    )
