"""A PEFT LoRA adapter folder, read and checked without torch (the HTTP process reads it).

PEFT saves `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with tensors named
`base_model.model.<module path>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]).
The safetensors header is JSON, so names, shapes and dtypes are checked here; the engine
core checks the shapes against its model's layers when it loads the weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
# The linear layers an adapter may target (Qwen3 and Qwen3.5 attention and MLP projections,
# and Qwen3.5's linear-attention projections).
SUPPORTED_TARGETS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "in_proj_qkv",
        "in_proj_z",
        "out_proj",
    }
)
FLOAT_DTYPES = {"F32", "F16", "BF16"}
_TENSOR_NAME = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.[\w.]+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served; the message says why (an HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class AdapterFiles:
    """What the adapter folder says, checked: its rank and scaling, and per module the
    (A shape, B shape) of its weights."""

    path: str
    rank: int
    scaling: float
    modules: dict[str, tuple[tuple[int, int], tuple[int, int]]]
    digest: str  # sha256 of the config and weights: the adapter's identity in KV hashes


def linear_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """The base checkpoint's LoRA-targetable layers, `module path -> (in, out)`, from its
    safetensors headers (no weights read)."""
    shapes: dict[str, tuple[int, int]] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        for name, entry in _read_header(shard).items():
            name = name.replace("model.language_model.", "model.", 1)
            module, _, leaf = name.rpartition(".")
            shape = entry.get("shape")
            if (
                leaf == "weight"
                and module.rsplit(".", 1)[-1] in SUPPORTED_TARGETS
                and module.startswith("model.layers.")
                and isinstance(shape, list)
                and len(shape) == 2
            ):
                shapes[module] = (shape[1], shape[0])
    return shapes


def check_against_model(files: AdapterFiles, shapes: dict[str, tuple[int, int]]) -> None:
    """Raises AdapterError unless every module the adapter holds is a layer of the model
    with the adapter's input and output sizes."""
    for module, (a_shape, b_shape) in files.modules.items():
        have = shapes.get(module)
        if have is None:
            raise AdapterError(f"{files.path}: the base model has no layer {module}")
        if (a_shape[1], b_shape[0]) != have:
            raise AdapterError(
                f"{files.path}: {module} maps {a_shape[1]} -> {b_shape[0]}, the base model's "
                f"layer maps {have[0]} -> {have[1]} (an adapter for another model?)"
            )


def read_adapter(path: str, max_rank: int) -> AdapterFiles:
    """Reads and checks the adapter at `path`; raises AdapterError naming the problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter path {path!r} is not a directory")
    config = _read_config(folder / CONFIG_FILE)
    rank, scaling = _rank_and_scaling(config, max_rank)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        found = "adapter_model.bin" if (folder / "adapter_model.bin").exists() else "nothing"
        raise AdapterError(f"{path}: {WEIGHTS_FILE} is missing (found {found}; only safetensors)")
    header = _read_header(weights)
    modules = _modules_of(header, rank, path)
    return AdapterFiles(str(folder.resolve()), rank, scaling, modules, _digest(folder))


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise AdapterError(f"{file.parent}: {CONFIG_FILE} is missing")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: must hold a JSON object")
    return config


def _rank_and_scaling(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    where = CONFIG_FILE
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"LoRA rank {rank} is greater than --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    _refuse_unsupported(config)
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets] if not targets.startswith("(") else []
    unsupported = sorted(t for t in targets if isinstance(t, str) and t not in SUPPORTED_TARGETS)
    if unsupported or not all(isinstance(t, str) for t in targets):
        raise AdapterError(
            f"{where}: target_modules {unsupported} are not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_TARGETS))})"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _refuse_unsupported(config: dict[str, Any]) -> None:
    for key, why in (
        ("use_dora", "DoRA adapters are not supported"),
        ("modules_to_save", "modules_to_save (full weights besides LoRA) is not supported"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (transposed weights) is not supported"),
    ):
        if config.get(key):
            raise AdapterError(f"{CONFIG_FILE}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}: bias must be 'none', got {config.get('bias')!r}")


def _read_header(file: Path) -> dict[str, Any]:
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise AdapterError(f"{file}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or n + 8 > size:
            raise AdapterError(f"{file}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{file}: not a safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: not a safetensors file")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= size - 8 - n
        ):
            raise AdapterError(f"{file}: tensor {name!r} lies outside the file")
    return header


def _modules_of(
    header: dict[str, Any], rank: int, path: str
) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    halves: dict[str, dict[str, tuple[int, int]]] = {}
    for name, entry in header.items():
        m = _TENSOR_NAME.match(name)
        if m is None:
            raise AdapterError(f"{path}: unexpected tensor {name!r} (only LoRA A/B weights)")
        module, half = m.group(1), m.group(2)
        if module.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS:
            raise AdapterError(f"{path}: {module} is not a supported LoRA target")
        shape = entry.get("shape")
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise AdapterError(f"{path}: {name} has dtype {entry.get('dtype')!r}")
        if not (
            isinstance(shape, list)
            and len(shape) == 2
            and all(isinstance(d, int) and d > 0 for d in shape)
        ):
            raise AdapterError(f"{path}: {name} must be a 2-D tensor, got shape {shape!r}")
        halves.setdefault(module, {})[half] = (shape[0], shape[1])
    if not halves:
        raise AdapterError(f"{path}: the adapter holds no LoRA weights")
    modules = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} lacks its lora_A or lora_B weight")
        a, b = pair["A"], pair["B"]
        if a[0] != rank or b[1] != rank:
            raise AdapterError(
                f"{path}: {module} has rank {a[0]}/{b[1]}, adapter_config.json says r={rank}"
            )
        modules[module] = (a, b)
    return modules


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with (folder / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]
