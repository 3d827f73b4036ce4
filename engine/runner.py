"""Turns a scheduled batch into tensors, runs the model, and samples."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdpool.engine.attention_metadata import AttentionMetadata
from pdpool.engine.kv.facts import KVLayout
from pdpool.engine.prompt_logprobs import score_prompt_rows
from pdpool.engine.sampling import Sampler, TokenLogprob
from pdpool.engine.structured.logits import GuidedMasks
from pdpool.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pdpool.engine.models.base import PagedCausalLM


@dataclass
class StepResult:
    # request_id -> sampled token, for requests whose scheduled tokens reached their end.
    sampled: dict[str, int]
    num_computed_tokens: int
    logits: dict[str, torch.Tensor] | None = None
    # request_id -> logprobs of its sampled token (requests that asked for them).
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> the error that ended its sampling (that request only).
    errors: dict[str, Exception] = field(default_factory=dict)
    # request_id -> the logprobs of the prompt tokens this step's rows scored (in order).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


# Test-only fault injection: a batch holding a request whose id contains this string fails
# in the model forward (armed from the engine process's environment, never by a client).
FAIL_FORWARD_ENV = "PDPOOL_TEST_FAIL_FORWARD_FOR"


class ModelRunner:
    def __init__(
        self,
        model: PagedCausalLM,
        shape: KVLayout,
        kv_cache: torch.Tensor,
        device: torch.device,
        keep_logits: bool = False,
        state: Any = None,
        lora: Any = None,
    ) -> None:
        self.model = model
        self.lora = lora  # engine/lora/slots.LoRAManager, with --enable-lora
        self.state = state  # the model's recurrent-state pool, if it has one
        self.block_size = shape.block_size
        self.num_groups = shape.num_groups
        self.kv_cache = kv_cache
        self.device = device
        self.sampler = Sampler()
        self.guided_masks = GuidedMasks(model.config["vocab_size"])
        self.keep_logits = keep_logits  # tests compare logits with transformers
        self.fail_forward_for = os.environ.get(FAIL_FORWARD_ENV) or None

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Lists become tensors through numpy: torch.tensor(list) costs ~0.1 us per element,
        # numpy a quarter of that, and the slot arithmetic is a few numpy calls per step.
        bs = self.block_size
        num_groups = self.num_groups
        view = out.kv_view  # the scheduler's copy of this step's blocks and slots
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        for item in out.scheduled:
            req, n = item.request, item.num_new_tokens
            start = req.num_computed_tokens
            ids += req.token_ids_between(start, start + n)
            positions += range(start, start + n)
            q_lens.append(n)
            seq_lens.append(start + n)
            for g, block_table in enumerate(view.block_tables[req.request_id]):
                tables[g].append(block_table)
        dev = self.device
        pos = np.array(positions, dtype=np.int64)
        rows = np.repeat(np.arange(len(q_lens)), q_lens)
        block_index, offset = pos // bs, pos % bs
        group_tensors = []
        for g in range(num_groups):
            table = _pad_tables(tables[g])
            slots = table[rows, block_index].astype(np.int64) * bs + offset
            group_tensors.append((_to_device(slots, dev), _to_device(table, dev)))
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=group_tensors[0][0],
            block_tables=group_tensors[0][1],
            query_start_loc=_to_device(np.array(qsl, dtype=np.int32), dev),
            seq_lens=_to_device(np.array(seq_lens, dtype=np.int32), dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens=q_lens,
            extra_groups=group_tensors[1:] or None,
        )
        if self.state is not None:
            meta.state_slots = torch.tensor(
                [view.state_slots[s.request.request_id] for s in out.scheduled],
                dtype=torch.int64,
                device=dev,
            )
            meta.state_has_initial = [s.request.num_computed_tokens > 0 for s in out.scheduled]
        return _to_device(np.array(ids, dtype=np.int64), dev), _to_device(pos, dev), meta

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copies recurrent states slot to slot: snapshot restores and snapshot saves."""
        if not pairs or self.state is None:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        for tensor in state_tensors(self.state):
            tensor[dst] = tensor[src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self.copy_state_slots(list(out.kv_view.state_restores))
        input_ids, positions, meta = self.prepare(out)
        if self.fail_forward_for and any(
            self.fail_forward_for in s.request.request_id for s in out.scheduled
        ):
            raise RuntimeError(f"injected forward failure ({FAIL_FORWARD_ENV})")
        rows, reqs = _sampling_rows(out)
        # The guided rows' token masks fill while the model runs.
        pending = self.guided_masks.start([r.grammar for r in reqs]) if reqs else None
        if self.lora is not None:
            self.lora.prepare(
                [s.request.lora for s in out.scheduled], [s.num_new_tokens for s in out.scheduled]
            )
        try:
            hidden = self.model(input_ids, positions, self.kv_cache, meta, self.state)
        finally:
            if self.lora is not None:
                self.lora.finish_step()
        prompt_logprobs = self._prompt_logprobs(out, hidden)
        if not rows:
            return StepResult({}, int(input_ids.shape[0]), prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[rows])
        if pending is not None:
            logits = logits.float()
            pending.apply(logits)
        suppress = [
            list(r.eos_token_ids) + r.sampling_params.stop_token_ids
            if len(r.output_token_ids) < r.sampling_params.min_tokens
            else None
            for r in reqs
        ]
        if pending is not None:
            _grammar_may_end(logits, reqs, suppress)
        histories = [
            (r.prompt_token_ids, r.output_token_ids)
            if r.sampling_params.penalized or r.sampling_params.bad_words_token_ids
            else None
            for r in reqs
        ]
        res = self.sampler.sample(
            logits,
            [r.request_id for r in reqs],
            [r.sampling_params for r in reqs],
            suppress,
            histories if any(histories) else None,
        )
        kept = (
            {r.request_id: logits[i].float().cpu() for i, r in enumerate(reqs)}
            if self.keep_logits
            else None
        )
        return StepResult(
            {r.request_id: t for r, t in zip(reqs, res.tokens, strict=True) if t is not None},
            int(input_ids.shape[0]),
            kept,
            {r.request_id: lp for r, lp in zip(reqs, res.logprobs, strict=True) if lp is not None},
            {reqs[b].request_id: exc for b, exc in res.errors.items()},
            prompt_logprobs,
        )

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprob]]:
        """For the requests that ask for their prompt's logprobs: those of the prompt
        tokens this step's rows score (a row scores the next token; the last prompt row
        scores the first output token, which is sampled, not scored here)."""
        found: dict[str, list[TokenLogprob]] = {}
        end = 0
        for item in out.scheduled:
            req, n = item.request, item.num_new_tokens
            first_row, end = end, end + n
            if not req.computes_prompt_rows:
                continue
            start = req.num_computed_tokens
            # Positions scored already (a preempted request recomputes them) are skipped.
            first = max(start, len(req.prompt_logprobs))
            last = min(start + n, req.num_prompt_tokens - 1)
            if first >= last or first > len(req.prompt_logprobs):
                continue
            k = req.sampling_params.prompt_logprobs
            assert k is not None
            found[req.request_id] = score_prompt_rows(
                self.model.compute_logits,
                hidden[first_row + first - start : first_row + last - start],
                req.prompt_token_ids[first + 1 : last + 1],
                k,
            )
        return found


def _sampling_rows(out: SchedulerOutput) -> tuple[list[int], list[Any]]:
    """Only requests whose scheduled tokens reach the end of what they know need a token
    (a chunk in the middle of a prompt produces none): their last rows, and themselves."""
    rows, reqs = [], []
    end = 0
    for item in out.scheduled:
        end += item.num_new_tokens
        req = item.request
        if req.num_computed_tokens + item.num_new_tokens == req.num_tokens:
            rows.append(end - 1)
            reqs.append(req)
    return rows, reqs


def _pad_tables(tables: list[list[int]]) -> np.ndarray:
    """The block tables as one int32 array, rows padded with block 0 to the longest."""
    width = max((len(t) for t in tables), default=0) or 1
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return np.array(flat, dtype=np.int32).reshape(len(tables), width)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a model's state pool (slots along dim 0), whatever its container."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        items = list(state.values())
    elif isinstance(state, (list, tuple)):
        items = list(state)
    else:
        items = list(vars(state).values())
    return [
        t
        for item in items
        if isinstance(item, (torch.Tensor, dict, list, tuple))
        or (hasattr(item, "__dict__") and not callable(item))
        for t in state_tensors(item)
    ]


def _grammar_may_end(logits: torch.Tensor, reqs: list[Any], suppress: list[Any]) -> None:
    """A guided row whose grammar allows nothing but the end keeps its end tokens despite
    min_tokens: the grammar is complete, and banning the end would leave no token at all."""
    for i, (r, ids) in enumerate(zip(reqs, suppress, strict=True)):
        if ids is None or r.grammar is None:
            continue
        allowed = torch.isfinite(logits[i])
        allowed[[t for t in ids if 0 <= t < allowed.shape[0]]] = False
        if not bool(allowed.any()):
            suppress[i] = None
