"""Reads a Hugging Face checkpoint folder into one of our model classes."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED = {
    "Qwen3ForCausalLM": "pdpool.engine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM": "pdpool.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    # Qwen3.5 as published: the text model under `model.language_model.*` plus a vision
    # tower (`model.visual.*`) and MTP head (`mtp.*`), which this text-only engine ignores.
    "Qwen3_5ForConditionalGeneration": "pdpool.engine.models.qwen3_5:Qwen3_5ForCausalLM",
}
# Published multimodal layouts: text weights under this prefix are the causal LM's `model.*`.
LANGUAGE_MODEL_PREFIX = "model.language_model."
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")

log = logging.getLogger("pdpool.engine.model_loader")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(ValueError):
    pass


@dataclass
class ModelInfo:
    path: Path
    config: dict
    architecture: str
    name: str


def read_model_info(model_dir: str | Path) -> ModelInfo:
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} is not a model folder: no config.json")
    config = json.loads(cfg_file.read_text())
    if "text_config" in config and "num_hidden_layers" not in config:
        # Multimodal wrappers keep the language model's settings under text_config.
        outer = config
        config = {**config["text_config"], "architectures": config.get("architectures")}
        if "tie_word_embeddings" in outer and "tie_word_embeddings" not in outer["text_config"]:
            config["tie_word_embeddings"] = outer["tie_word_embeddings"]
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or '(none)'}; supported: {', '.join(SUPPORTED)}"
        )
    return ModelInfo(path, config, arch, path.resolve().name)


def resolve_dtype(config: dict, override: str | None) -> torch.dtype:
    name = override or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name == "auto":
        name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from safetensors.torch import load_file

    module_name, cls_name = SUPPORTED[info.architecture].split(":")
    cls = getattr(__import__(module_name, fromlist=[cls_name]), cls_name)
    with torch.device("meta"):
        model = cls(info.config)
    model = model.to_empty(device=device)
    shards = sorted(info.path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no *.safetensors files in {info.path}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard), device="cpu"))
        except Exception as exc:  # safetensors' own error type: a truncated or foreign file
            raise ModelLoadError(f"{shard.name} is not a readable safetensors file: {exc}")
    state = text_weights(state)
    if getattr(model, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != state[name].shape:
                raise ModelLoadError(
                    f"{name}: checkpoint shape {tuple(state[name].shape)} "
                    f"!= model shape {tuple(param.shape)}"
                )
            param.copy_(state[name].to(dtype))
    model = model.to(device=device, dtype=dtype).eval()
    # Buffers (rotary tables) were created on meta: rebuild them, in float32.
    for module in model.modules():
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()
    from pdpool.engine.models.cpu_linear import pack_cpu_linears

    packed = pack_cpu_linears(model, device, dtype)
    if packed:
        log.info("%d linear layers run through oneDNN (weights packed)", packed)
    return model


def text_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A published multimodal checkpoint's tensors as the text-only model names them:
    `model.language_model.X` -> `model.X`; the vision tower and MTP head are dropped (logged).
    A causal-LM checkpoint is returned unchanged."""
    if not any(k.startswith(LANGUAGE_MODEL_PREFIX) for k in state):
        return state
    out: dict[str, torch.Tensor] = {}
    ignored: dict[str, int] = {}
    for name, tensor in state.items():
        if name.startswith(LANGUAGE_MODEL_PREFIX):
            out["model." + name[len(LANGUAGE_MODEL_PREFIX) :]] = tensor
        elif name.startswith(IGNORED_PREFIXES):
            prefix = next(p for p in IGNORED_PREFIXES if name.startswith(p))
            ignored[prefix] = ignored.get(prefix, 0) + 1
        else:
            out[name] = tensor
    if ignored:
        log.info(
            "text-only engine: ignoring %s",
            ", ".join(
                f"{n} tensors under {p}*" + (" (vision tower)" if "visual" in p else " (MTP head)")
                for p, n in sorted(ignored.items())
            ),
        )
    return out
