"""The engine core's adapters: weights read on first use (kept in an LRU of
--max-cpu-loras), copied into one of --max-loras slots of every LoRA layer when a step's
batch needs them, and each step's per-token slot mapping.

The scheduler admits at most --max-loras distinct adapters among running requests, so a
step's adapters always fit the slots; a slot no running request uses may be reassigned.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from pdpool.engine.lora.adapter_dir import SUPPORTED_TARGETS, AdapterError, read_adapter
from pdpool.engine.lora.linear import LoRABatch, LoRALinear, StepLoRA
from pdpool.engine.lora.registry import LoRARef
from pdpool.kernels.lora_reference import RUN_MIN_TOKENS, slot_mask, slot_runs
from pdpool.kernels.ops import use_triton

log = logging.getLogger("pdpool.engine.lora")

AdapterKey = tuple[str, str]  # (name, digest): a re-registered name is another adapter


@dataclass
class LoadedAdapter:
    ref: LoRARef
    # module path -> (A [r, in], B * scaling [out, r]), in the model's dtype, on the CPU
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def wrap_lora_layers(
    model: nn.Module, num_slots: int, max_rank: int, dtype, device
) -> tuple[StepLoRA, dict[str, LoRALinear]]:
    """Replaces every supported projection under `model.layers` by a LoRALinear."""
    step = StepLoRA()
    swaps = [
        (parent, name, f"{prefix}.{name}" if prefix else name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if name in SUPPORTED_TARGETS
        and hasattr(child, "in_features")
        and ".layers." in f"{prefix}."
    ]
    layers = {}
    for parent, name, path, child in swaps:
        layer = LoRALinear(child, num_slots, max_rank, step, dtype, device)
        setattr(parent, name, layer)
        layers[path] = layer
    return step, layers


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.step, self.layers = wrap_lora_layers(model, max_loras, max_rank, dtype, device)
        self.cpu: OrderedDict[AdapterKey, LoadedAdapter] = OrderedDict()
        self.slots: list[Optional[AdapterKey]] = [None] * max_loras
        self.slot_used = [0] * max_loras  # the step that last used each slot (LRU)
        self.steps = 0
        self.stats = {"lora_loads": 0, "lora_slot_loads": 0}
        log.info("LoRA: %d layers, %d slots of rank %d", len(self.layers), max_loras, max_rank)

    # --- weights ------------------------------------------------------------------------
    def ensure_loaded(self, ref: LoRARef) -> LoadedAdapter:
        """The adapter's weights (read and checked on first use); raises AdapterError."""
        key = (ref.name, ref.digest)
        loaded = self.cpu.get(key)
        if loaded is not None:
            self.cpu.move_to_end(key)
            return loaded
        loaded = self._read(ref)
        self.cpu[key] = loaded
        self.stats["lora_loads"] += 1
        while len(self.cpu) > self.max_cpu_loras:
            old = next(iter(self.cpu))
            if old in self.slots:  # resident in a slot: keep it, evict the next
                break
            self.cpu.pop(old)
        return loaded

    def _read(self, ref: LoRARef) -> LoadedAdapter:
        from safetensors.torch import load_file

        files = read_adapter(ref.path, self.max_rank)
        if files.digest != ref.digest:
            raise AdapterError(f"LoRA adapter {ref.name!r}: its files changed since it was loaded")
        unknown = sorted(set(files.modules) - set(self.layers))
        if unknown:
            raise AdapterError(
                f"LoRA adapter {ref.name!r} targets layers this model lacks: {unknown[:3]}"
            )
        tensors = load_file(f"{files.path}/adapter_model.safetensors", device="cpu")
        weights = {}
        for module, (a_shape, b_shape) in files.modules.items():
            layer = self.layers[module]
            if a_shape[1] != layer.in_features or b_shape[0] != layer.out_features:
                raise AdapterError(
                    f"LoRA adapter {ref.name!r}: {module} is {a_shape[1]} -> {b_shape[0]}, "
                    f"the model's is {layer.in_features} -> {layer.out_features}"
                )
            prefix = f"base_model.model.{module}"
            a = tensors[f"{prefix}.lora_A.weight"].float()
            b = tensors[f"{prefix}.lora_B.weight"].float() * files.scaling
            weights[module] = (a.to(self.dtype), b.to(self.dtype))
        return LoadedAdapter(ref, weights)

    # --- a step -------------------------------------------------------------------------
    def prepare(self, refs: Sequence[Optional[LoRARef]], num_tokens: Sequence[int]) -> None:
        """This step's mapping: `refs[i]` is the adapter of the i-th scheduled request
        (None: base), which computes `num_tokens[i]` tokens."""
        self.steps += 1
        if not any(r is not None for r in refs):
            self.step.batch = None
            return
        slot_of: dict[AdapterKey, int] = {}
        for ref in refs:
            if ref is not None and (ref.name, ref.digest) not in slot_of:
                slot_of[(ref.name, ref.digest)] = self._slot_for(ref, slot_of)
        per_request = [-1 if r is None else slot_of[(r.name, r.digest)] for r in refs]
        slots = torch.tensor(per_request, dtype=torch.int64).repeat_interleave(
            torch.tensor(list(num_tokens), dtype=torch.int64)
        )
        if use_triton(self.device):
            self.step.batch = LoRABatch(slots.to(self.device), None)
            return
        runs = slot_runs(per_request, list(num_tokens))
        if sum(e - s for s, e, _ in runs) >= RUN_MIN_TOKENS * len(runs):
            self.step.batch = LoRABatch(slots, None, runs)  # prompt chunks: run by run
            return
        mask = slot_mask(slots, self.max_loras, self.max_rank, self.dtype)
        self.step.batch = LoRABatch(slots, mask)

    def finish_step(self) -> None:
        self.step.batch = None

    def _slot_for(self, ref: LoRARef, taken: dict[AdapterKey, int]) -> int:
        key = (ref.name, ref.digest)
        if key in self.slots:
            slot = self.slots.index(key)
        else:
            busy = set(taken.values())
            free = [s for s in range(self.max_loras) if s not in busy]
            if not free:
                raise RuntimeError(f"more adapters in one step than --max-loras {self.max_loras}")
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_used[s]))
            self._fill(slot, self.ensure_loaded(ref))
        self.slot_used[slot] = self.steps
        return slot

    def _fill(self, slot: int, adapter: LoadedAdapter) -> None:
        with torch.no_grad():
            for path, layer in self.layers.items():
                pair = adapter.weights.get(path)
                if pair is None:
                    layer.set_slot(slot, None, None)
                else:
                    layer.set_slot(slot, pair[0].to(self.device), pair[1].to(self.device))
        self.slots[slot] = (adapter.ref.name, adapter.ref.digest)
        self.stats["lora_slot_loads"] += 1
