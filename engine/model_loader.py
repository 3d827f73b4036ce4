"""Reads a Hugging Face checkpoint folder into one of our model classes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdpool.engine.model_info import (  # noqa: F401 (re-exported)
    SUPPORTED,
    ModelInfo,
    ModelLoadError,
    read_model_info,
)

if TYPE_CHECKING:
    from pdpool.engine.models.base import PagedCausalLM

# Published multimodal layouts: text weights under this prefix are the causal LM's `model.*`.
LANGUAGE_MODEL_PREFIX = "model.language_model."
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")

log = logging.getLogger("pdpool.engine.model_loader")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(config: dict, override: str | None) -> torch.dtype:
    name = override or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name == "auto":
        name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors shards, on the CPU."""
    from safetensors.torch import load_file

    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard), device="cpu"))
        except Exception as exc:  # safetensors' own error type: a truncated or foreign file
            raise ModelLoadError(f"{shard.name} is not a readable safetensors file: {exc}") from exc
    return state


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> PagedCausalLM:
    module_name, cls_name = SUPPORTED[info.architecture].split(":")
    cls = getattr(__import__(module_name, fromlist=[cls_name]), cls_name)
    with torch.device("meta"):
        model = cls(info.config)
    model = model.to_empty(device=device)
    state = text_weights(_read_checkpoint(info.path))
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
