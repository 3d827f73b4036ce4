"""What a Hugging Face checkpoint folder holds, read without torch (the engine server process
reads it too): its config, architecture and name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = {
    "Qwen3ForCausalLM": "pdpool.engine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM": "pdpool.engine.models.qwen3_5:Qwen3_5ForCausalLM",
    # Qwen3.5 as published: the text model under `model.language_model.*` plus a vision
    # tower (`model.visual.*`) and MTP head (`mtp.*`), which this text-only engine ignores.
    "Qwen3_5ForConditionalGeneration": "pdpool.engine.models.qwen3_5:Qwen3_5ForCausalLM",
}


class ModelLoadError(ValueError):
    pass


@dataclass
class ModelInfo:
    path: Path
    config: dict[str, Any]
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
