"""Reads a Hugging Face checkpoint folder into one of our model classes."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED = {
    "Qwen3ForCausalLM": "pdpool.engine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM": "pdpool.engine.models.qwen3_5:Qwen3_5ForCausalLM",
}

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
        config = {**config["text_config"], "architectures": config.get("architectures")}
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs or '(none)'}; "
                             f"supported: {', '.join(SUPPORTED)}")
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
        state.update(load_file(str(shard), device="cpu"))
    if getattr(model, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != state[name].shape:
                raise ModelLoadError(f"{name}: checkpoint shape {tuple(state[name].shape)} "
                                     f"!= model shape {tuple(param.shape)}")
            param.copy_(state[name].to(dtype))
    model = model.to(device=device, dtype=dtype).eval()
    # Buffers (rotary tables) were created on meta: rebuild them, in float32.
    for module in model.modules():
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()
    return model
