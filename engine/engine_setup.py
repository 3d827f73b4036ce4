"""Building an engine's parts from its config and checkpoint: the device, the end-of-sequence
ids, the KV memory (groups, how many blocks fit, the cache tensor, recurrent-state slots),
the KV connector and the KV-events publisher. engine_core.LLMEngine wires them together."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import TYPE_CHECKING, Any, Optional

import torch

from pdpool.engine.config import EngineConfig
from pdpool.engine.kv.facts import KVCacheSpec
from pdpool.engine.kv.groups import KVGroup, attention_groups
from pdpool.engine.model_info import ModelInfo
from pdpool.engine.models.base import head_dim_of

if TYPE_CHECKING:
    from pdpool.engine.connector.base import KVConnector
    from pdpool.engine.connector.offload_tier import KVOffload
    from pdpool.kv_events import KVEventPublisher

DEFAULT_KV_MEMORY_CPU = 256 << 20


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def eos_token_ids(info: ModelInfo, tokenizer: Any) -> tuple[int, ...]:
    """The checkpoint's generation_config end-of-sequence ids and the tokenizer's."""
    ids = set()
    gen_file = info.path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def assign_kv_groups(model: torch.nn.Module) -> list[KVGroup]:
    """Groups the model's attention layers by kind and tells each layer its group and its
    layer slot in the KV cache tensor."""
    from pdpool.engine.models.layers import PagedAttention

    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    groups, placement = attention_groups([m.sliding_window for m in layers])
    for module, (group, slot) in zip(layers, placement, strict=True):
        module.group, module.layer_index = group, slot
    return groups


class KVMemory:
    """The engine's KV memory: the cache tensor (block-major), the recurrent-state pool of
    state models, and the spec the scheduler builds its KV cache manager from."""

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        model: torch.nn.Module,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config, self.info, self.dtype, self.device = config, info, dtype, device
        self.groups = assign_kv_groups(model)
        # The cache holds as many layer slots as the largest group has layers.
        self.num_layers = max((g.num_layers for g in self.groups), default=1)
        self.num_kv_heads: int = info.config["num_key_value_heads"]
        self.head_dim = head_dim_of(info.config)
        self.num_blocks = self._num_blocks()
        self.cache = torch.zeros(
            self.num_blocks,
            self.num_layers,
            2,
            config.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=dtype,
            device=device,
        )
        # Recurrent-state models (Qwen3.5): a running-state slot per schedulable request,
        # plus as many slots again for prefix-cache snapshots.
        allocate_state = getattr(model, "allocate_state", None)
        has_state = allocate_state is not None
        num_slots = config.max_num_seqs if has_state else 0
        num_snapshots = config.max_num_seqs if has_state and config.enable_prefix_caching else 0
        self.state = allocate_state(num_slots + num_snapshots, device) if allocate_state else None
        self.spec = KVCacheSpec(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            num_slots,
            tuple(self.groups),
            num_snapshots,
        )

    @property
    def block_bytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.config.block_size
            * self.num_kv_heads
            * self.head_dim
            * torch.finfo(self.dtype).bits
            // 8
        )

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        memory = self.config.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                memory = int(free * 0.8)
            else:
                memory = DEFAULT_KV_MEMORY_CPU
        n = memory // self.block_bytes
        if n < 1:
            raise ValueError(
                f"--kv-cache-memory {memory} bytes holds no block "
                f"(one block is {self.block_bytes} bytes)"
            )
        return int(n)

    @functools.cached_property
    def fingerprint(self) -> str:
        """The KV fingerprint (kv/offload/keys.py): the layout and the checkpoint's
        identity. Offload records and signed leases carry it; a mismatch is a miss."""
        from pdpool.engine.kv.offload.identity import weights_digest
        from pdpool.engine.kv.offload.keys import kv_fingerprint

        return kv_fingerprint(self.layout(), weights_digest(self.info.path))

    def layout(self) -> dict[str, Any]:
        """What must match for a KV block to mean the same thing in two engines."""
        keys = (
            "architectures",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "layer_types",
        )
        model = json.dumps({k: self.info.config.get(k) for k in keys}, sort_keys=True)
        return {
            "model": hashlib.sha256(model.encode()).hexdigest()[:16],
            "dtype": str(self.dtype).replace("torch.", ""),
            "block_size": self.config.block_size,
            "kv_layout": "block-major[num_blocks,num_layers,2,block_size,kv_heads,head_dim]",
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "kv_groups": [g.name for g in self.groups],
        }


def build_offload(config: EngineConfig, memory: KVMemory) -> Optional[KVOffload]:
    """The KV offload tier (--kv-offloading-size), or None."""
    if config.kv_offloading_size is None:
        return None
    from pdpool.engine.connector.lease_token import load_secret
    from pdpool.engine.kv.offload.memory_store import MemoryStore
    from pdpool.engine.kv.offload.store import FileStore, RecordStore
    from pdpool.engine.connector.offload_tier import MEDIUM_CPU, MEDIUM_STORAGE, KVOffload
    from pdpool.engine.runner import state_tensors

    backend = config.kv_offloading_backend
    shared = backend == "shared"
    store: RecordStore
    if backend == "native":
        store = MemoryStore(config.kv_offloading_bytes)
    else:
        assert config.kv_offloading_path is not None  # validated
        store = FileStore(
            config.kv_offloading_path,
            config.kv_offloading_bytes,
            shared,
            config.kv_offloading_fsync,
        )
    return KVOffload(
        store,
        memory.fingerprint,
        memory.cache,
        [g.num_layers for g in memory.groups],
        config.block_size,
        state_tensors(memory.state) if memory.state is not None else [],
        secret=load_secret(config.kv_secret_file),
        locality="REMOTE" if shared else "LOCAL",
        medium=MEDIUM_CPU if backend == "native" else MEDIUM_STORAGE,
    )


def build_connector(config: EngineConfig, memory: KVMemory) -> KVConnector:
    """The `--kv-connector`: none, or NIXL over this engine's KV memory."""
    if config.kv_connector == "none":
        from pdpool.engine.connector.base import KVConnector

        return KVConnector()
    from pdpool.engine.connector.lease_token import load_secret
    from pdpool.engine.connector.nixl_connector import NixlConnector

    return NixlConnector(
        config,
        memory.spec.layout,
        memory.cache,
        memory.layout(),
        memory.state,
        secret=load_secret(config.kv_secret_file),
        fingerprint=memory.fingerprint,
    )


def start_kv_events(config: EngineConfig) -> Optional[KVEventPublisher]:
    """vLLM's --kv-events-config: a ZeroMQ publisher of this engine's cache changes."""
    from pdpool.kv_events import AllBlocksCleared, KVEventPublisher, KVEventsConfig

    cfg = KVEventsConfig.parse(config.kv_events_config)
    if cfg is None or not cfg.active:
        return None
    publisher = KVEventPublisher(cfg)
    publisher.record(AllBlocksCleared())  # a (re)started engine holds nothing
    return publisher
