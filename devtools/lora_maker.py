"""Tiny PEFT LoRA adapters for a tiny checkpoint (tests and benchmarks).

PEFT initialises B to zero (an adapter that changes nothing); these get random nonzero A
and B, scaled so that the adapter visibly changes the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    std: float = 0.3,
) -> Path:
    """Writes adapter_config.json + adapter_model.safetensors for `base_dir` into `out_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none"
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def load_with_adapter(base_dir: str | Path, adapter_dir: str | Path):
    """transformers + peft: the reference an engine serving the adapter must equal."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
