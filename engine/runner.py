"""Turns a scheduled batch into tensors, runs the model, and samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdpool.engine.attention_metadata import AttentionMetadata
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.sampling import Sampler
from pdpool.engine.scheduler import SchedulerOutput


@dataclass
class StepResult:
    # request_id -> sampled token, for requests whose scheduled tokens reached their end.
    sampled: dict[str, int]
    num_computed_tokens: int
    logits: dict[str, torch.Tensor] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, kv_cache: torch.Tensor,
                 device: torch.device, keep_logits: bool = False, state=None):
        self.model = model
        self.state = state  # the model's recurrent-state pool, if it has one
        self.kv = kv
        self.kv_cache = kv_cache
        self.device = device
        self.sampler = Sampler()
        self.keep_logits = keep_logits  # tests compare logits with transformers

    def prepare(self, out: SchedulerOutput):
        bs = self.kv.block_size
        ids, positions, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        for item in out.scheduled:
            req, n = item.request, item.num_new_tokens
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n]
            table = self.kv.block_ids(req.request_id)
            pos = range(start, start + n)
            ids.extend(tokens)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens=q_lens)
        if self.state is not None:
            meta.state_slots = torch.tensor(
                [self.kv.state_slot(s.request.request_id) for s in out.scheduled],
                dtype=torch.int64, device=dev)
            meta.state_has_initial = [s.request.num_computed_tokens > 0 for s in out.scheduled]
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        input_ids, positions, meta = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.state)
        # Only requests whose scheduled tokens reach the end of what they know need a token;
        # a chunk in the middle of a prompt produces none.
        rows, reqs = [], []
        end = 0
        for item in out.scheduled:
            end += item.num_new_tokens
            req = item.request
            if req.num_computed_tokens + item.num_new_tokens == req.num_tokens:
                rows.append(end - 1)
                reqs.append(req)
        if not rows:
            return StepResult({}, int(input_ids.shape[0]))
        logits = self.model.compute_logits(hidden[rows])
        suppress = [list(r.eos_token_ids) + r.sampling_params.stop_token_ids
                    if len(r.output_token_ids) < r.sampling_params.min_tokens else None
                    for r in reqs]
        tokens = self.sampler.sample(logits, [r.request_id for r in reqs],
                                     [r.sampling_params for r in reqs], suppress)
        kept = {r.request_id: logits[i].float().cpu() for i, r in enumerate(reqs)} \
            if self.keep_logits else None
        return StepResult({r.request_id: t for r, t in zip(reqs, tokens)},
                          int(input_ids.shape[0]), kept)
