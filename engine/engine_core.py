"""The synchronous engine: add requests, step, collect outputs.

One step = the scheduler decides, the runner computes, and this file applies the result:
the scheduler advances each request (its full blocks published to the prefix cache) and
appends its sampled token (the token-level stops, stop_check.py), the output processor
makes its text (stop strings, output_processor.py), and the finished are freed. The step
loop that drives it is core_loop.py; its process, core_process.py.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from pdpool.engine.config import EngineConfig
from pdpool.engine.cpu_threads import StepThreads
from pdpool.engine.engine_setup import (
    KVMemory,
    build_connector,
    build_offload,
    eos_token_ids,
    pick_device,
    start_kv_events,
)
from pdpool.engine.model_loader import load_model, read_model_info, resolve_dtype
from pdpool.engine.output_processor import OutputProcessor
from pdpool.engine.outputs import (
    KVTransferRefused,
    RequestError,
    RequestOutput,
    RequestRejected,
    TokenLogprob,
    prompt_fit_problem,
)
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.runner import ModelRunner, StepResult
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.structured.compile_jobs import CompileBounds, GrammarJobs
from pdpool.engine.structured.grammar import GrammarCompiler, stop_ids_of
from pdpool.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

if TYPE_CHECKING:
    from pdpool.engine.connector.base import LoadResult
    from pdpool.engine.kv.manager import KVCacheManager

log = logging.getLogger("pdpool.engine")


class LLMEngine:
    def __init__(
        self, config: EngineConfig, tokenizer: Any = None, keep_logits: bool = False
    ) -> None:
        config.validate()
        self.config = config
        self.info = read_model_info(config.model)
        self.model_name = config.served_model_name or self.info.name
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(self.info.config, config.dtype)
        self.step_threads: Optional[StepThreads] = None
        if self.device.type == "cpu":
            if config.cpu_threads:
                torch.set_num_threads(config.cpu_threads)
            self.step_threads = StepThreads(config.cpu_threads, config.cpu_prefill_threads)
        torch.manual_seed(config.seed)
        self.model = load_model(self.info, self.dtype, self.device)
        self.lora = None
        if config.enable_lora:
            from pdpool.engine.lora.slots import LoRAManager

            self.lora = LoRAManager(
                self.model,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras or config.max_loras,
                self.dtype,
                self.device,
            )
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.info.path))
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(self.info, tokenizer)

        self.memory = memory = KVMemory(config, self.info, self.model, self.dtype, self.device)
        self.groups, self.num_layers = memory.groups, memory.num_layers
        self.num_kv_heads, self.head_dim = memory.num_kv_heads, memory.head_dim
        self.kv_cache, self.state = memory.cache, memory.state
        self.connector = build_connector(config, memory)
        self.offload = build_offload(config, memory)
        # The scheduler owns the KV cache manager: every block's lifetime is decided there.
        self.scheduler = Scheduler.for_cache(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                enable_chunked_prefill=config.enable_chunked_prefill,
                prefix_aware_admission=config.prefix_aware_admission,
                global_cache_hit_threshold=config.global_cache_hit_threshold,
                policy=config.scheduling_policy,
                max_loras=config.max_loras if config.enable_lora else 0,
            ),
            memory.spec,
            self.connector,
            self.offload,
        )
        self.kv_events = start_kv_events(config)
        if self.kv_events is not None:
            self.scheduler.publish_kv_events(self.kv_events)
            if self.offload is not None:
                self.offload.events = self.kv_events
        self.kv_capacity_tokens = self.scheduler.kv_capacity_tokens
        max_len = min(
            self.info.config.get("max_position_embeddings", 4096), self.kv_capacity_tokens
        )
        if config.max_model_len:
            max_len = min(max_len, config.max_model_len)
        self.max_model_len = max_len
        self.scheduler.config.max_model_len = max_len
        self.runner = ModelRunner(
            self.model,
            memory.spec.layout,
            self.kv_cache,
            self.device,
            keep_logits,
            self.state,
            self.lora,
        )
        self.grammars = GrammarCompiler(
            tokenizer, self.info.config["vocab_size"], config.structured_cache_bytes
        )
        # Guided requests' grammars compile here, off the admission path, within a deadline.
        self.grammar_jobs = GrammarJobs(self.grammars.compile, CompileBounds.of(config))
        self.requests: dict[str, Request] = {}
        # Detokenizing and stop strings: the token-level stops are the scheduler's.
        self.output_processor = OutputProcessor(tokenizer)
        self.last_step_idle = True
        self.stats = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "computed_tokens": 0,
            "steps": 0,
            "aborted": 0,
            "failed": 0,
            "forward_failures": 0,
            # Where prompt tokens' KV came from: this engine's prefix cache, a
            # peer (loaded and verified), or the model here.
            "prompt_tokens_local": 0,
            "prompt_tokens_pulled": 0,
            "prompt_tokens_computed": 0,
        }
        # An engine-wide failure nobody could be blamed for (the model forward failed for
        # every request tried); /health reports it until a forward succeeds again.
        self.fault: Optional[str] = None
        self._failed_forward_streak = 0  # requests failed in the forward since a success
        log.info(
            "engine ready: %s on %s (%s%s), %d KV blocks of %d tokens, max_model_len %d",
            self.model_name,
            self.device,
            self.dtype,
            f", {self.step_threads.describe()}" if self.step_threads is not None else "",
            memory.num_blocks,
            config.block_size,
            max_len,
        )

    # --- setup --------------------------------------------------------------------------
    @property
    def kv(self) -> KVCacheManager:
        """The scheduler's KV cache manager, for tests and benchmarks that inspect the
        cache. The engine never calls through it: the scheduler owns every block."""
        return self.scheduler.kv

    def close(self) -> None:
        self.grammar_jobs.close()
        self.scheduler.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def wait_for_transfers(self, timeout: float) -> None:
        """A step with nothing to compute (only loads in flight): returns as soon as a
        tier read is done, else after `timeout` (remote loads are polled)."""
        if self.offload is not None and self.scheduler.tier_loading:
            self.offload.worker.wait(timeout)
        else:
            time.sleep(timeout)

    def idle_tick(self) -> None:
        """Connector housekeeping while no request runs (notifications, held blocks)."""
        for result in self.scheduler.collect_transfers():
            self._apply_load_result(result)
        self.scheduler.flush_offload()

    # --- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: Optional[str] = None,
        cache_hit_threshold: Optional[float] = None,
        kv_transfer_params: Optional[dict[str, Any]] = None,
        compiled_grammar: Any = None,
        priority: int = 0,
        lora: Any = None,
    ) -> Request:
        """`compiled_grammar`: the guided spec's grammar, compiled off the step loop
        (structured/compile_jobs.py); without it a guided spec compiles here."""
        params.validate(self.info.config["vocab_size"])
        if request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        n = len(prompt_token_ids)
        vocab = self.info.config["vocab_size"]
        if any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
            for t in prompt_token_ids
        ):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be in [0, {vocab})")
        if params.prompt_logprobs is not None and (kv_transfer_params or {}).get(
            "do_remote_prefill"
        ):
            raise RequestRejected(
                "prompt_logprobs: the prompt's logprobs need its rows computed here, not its "
                "KV loaded from another engine"
            )
        if params.n != 1:
            raise RequestRejected(
                "n: the engine runs one sequence per request (the server fans n out)"
            )
        problem = prompt_fit_problem(
            n, params.max_tokens, self.max_model_len, self.kv_capacity_tokens
        )
        if problem is not None:
            raise RequestRejected(problem)
        if lora is not None:
            if self.lora is None:
                raise RequestRejected("LoRA adapters need --enable-lora")
            self.lora.ensure_loaded(lora)  # a broken adapter is refused here (400)
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            self.eos_token_ids,
            cache_salt=cache_salt,
            cache_hit_threshold=cache_hit_threshold,
            kv_transfer_params=kv_transfer_params,
            block_size=self.config.block_size,
            priority=priority,
            lora=lora,
        )
        req.grammar = self._grammar_of(prompt_token_ids, params, compiled_grammar)
        refusal = self.connector.check_request(req)
        if refusal is not None and self.config.kv_load_failure_policy == "fail":
            raise KVTransferRefused(f"KV transfer refused: {refusal}")
        self.requests[request_id] = req
        self.output_processor.add(req)
        self.scheduler.add_request(req)
        return req

    def _grammar_of(
        self, prompt_token_ids: list[int], params: SamplingParams, compiled: Any = None
    ) -> Any:
        """The request's grammar matcher (None when unguided), advanced over the tokens a
        continuation says were generated already (the tail of its prompt)."""
        spec = params.guided
        if spec is None:
            return None
        done = list(spec.prefix_token_ids)
        if done and prompt_token_ids[len(prompt_token_ids) - len(done) :] != done:
            raise RequestRejected("guided prefix token ids must be the last tokens of the prompt")
        return self.grammars.grammar_for(
            spec, stop_ids_of(self.eos_token_ids, params.stop_token_ids), compiled
        )

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.stats["aborted"] += 1
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            self._forget(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.output_processor.forget(req.request_id)
        self.runner.sampler.forget(req.request_id)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for loaded in self.scheduler.collect_transfers():
            failed = self._apply_load_result(loaded)
            if failed is not None:
                outputs.append(failed)
        self.scheduler.flush_offload()  # blocks loaded just now, before anything reuses them
        out = self.scheduler.schedule()
        self.connector.start_loads()
        outputs += [self.output_processor.final_output(r) for r in out.rejected]
        for r in out.rejected:
            self._forget(r)
        self.last_step_idle = not out.scheduled
        if not out.scheduled:
            return outputs
        result, failed_outputs = self._forward(out)
        outputs += failed_outputs
        self.stats["steps"] += 1
        self.stats["computed_tokens"] += result.num_computed_tokens
        self.last_logits = result.logits
        self.runner.copy_state_slots(self.scheduler.update_after_forward(out))
        self.scheduler.flush_offload()  # this step's blocks and snapshots, copied now
        for item in out.scheduled:
            item.request.prompt_logprobs += result.prompt_logprobs.get(item.request.request_id, ())
            output = self._apply_sampled(item.request, result)
            if output is not None:
                outputs.append(with_prompt_logprobs(output, item.request))
        return outputs

    def _forward(self, out: SchedulerOutput) -> tuple[StepResult, list[RequestOutput]]:
        """The model's forward for a scheduled step, and the outputs of requests it failed."""
        if self.step_threads is not None:
            self.step_threads.before_step(out.num_scheduled_tokens)
        started = time.perf_counter()
        try:
            result = self.runner.execute(out)
        except Exception as exc:
            return self._execute_isolating(out, exc)
        if self.step_threads is not None:
            self.step_threads.after_step(out.num_scheduled_tokens, time.perf_counter() - started)
        self._forward_succeeded()
        return result, []

    def _apply_sampled(self, req: Request, result: StepResult) -> Optional[RequestOutput]:
        """A scheduled request's share of the step: its sampled token applied, or its error;
        None when it has nothing to say (finished already, or mid-prefill)."""
        if req.is_finished:
            return None
        error = result.errors.get(req.request_id)
        if error is not None:
            return self._fail_request(req, "sampling", error)
        token = result.sampled.get(req.request_id)
        if token is None:
            return None
        # A failure applying one request's token (detokenization, stop checks) ends that
        # request only.
        try:
            if not req.output_token_ids:
                self._count_prompt_sources(req)
            self.stats["generation_tokens"] += 1
            token_status = self.scheduler.append_sampled(req, token)
            return self._advance(req, token, token_status, result.logprobs.get(req.request_id))
        except Exception as exc:
            return self._fail_request(req, "output processing", exc)

    # --- isolating failures -------------------------------------------------------------
    def _fail_request(self, req: Request, where: str, exc: Exception) -> RequestOutput:
        """Ends one request with an error (400 for its own bad parameters, else 500) and
        frees its blocks; the rest of the batch carries on."""
        if isinstance(exc, RequestError):
            req.error, req.error_status = str(exc), 400
        else:
            req.error, req.error_status = f"internal error in {where}: {exc}", 500
        log.error(
            "request %s failed in %s: %s",
            req.request_id,
            where,
            exc,
            exc_info=None if isinstance(exc, RequestError) else exc,
        )
        self.stats["failed"] += 1
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
        output = self.output_processor.final_output(req)
        self._forget(req)
        return output

    def _forward_succeeded(self) -> None:
        self._failed_forward_streak = 0
        if self.fault is not None:
            log.warning("engine recovered: a model forward succeeded again")
            self.fault = None

    def _execute_isolating(
        self, out: SchedulerOutput, exc: Exception
    ) -> tuple[StepResult, list[RequestOutput]]:
        """The batch's forward failed: runs each request alone to find the offenders, which
        end with an error while the others go on. Models with recurrent state are not
        re-run (a failed forward may have advanced their state in place), and neither is a
        batch of one: their requests fail. Failures that hit two or more requests with no
        success in between are an engine-wide fault (see `fault`)."""
        self.stats["forward_failures"] += 1
        log.error(
            "model forward failed for a batch of %d requests: %s",
            len(out.scheduled),
            exc,
            exc_info=True,
        )
        merged = StepResult({}, 0)
        failed: list[tuple[Request, Exception]] = []
        if self.state is not None or len(out.scheduled) == 1:
            failed = [(item.request, exc) for item in out.scheduled]
        else:
            for item in out.scheduled:
                try:
                    part = self.runner.execute(out.only(item))
                except Exception as solo_exc:
                    failed.append((item.request, solo_exc))
                    continue
                self._forward_succeeded()
                merged.sampled.update(part.sampled)
                merged.logprobs.update(part.logprobs)
                merged.errors.update(part.errors)
                merged.prompt_logprobs.update(part.prompt_logprobs)
                merged.num_computed_tokens += part.num_computed_tokens
                if part.logits is not None:
                    merged.logits = {**(merged.logits or {}), **part.logits}
        self._failed_forward_streak += len(failed)
        if failed and len(failed) == len(out.scheduled) and self._failed_forward_streak >= 2:
            self.fault = f"the model forward fails for every request: {exc}"
            log.error("engine-wide failure: %s", self.fault)
        outputs = [self._fail_request(req, "the model forward", e) for req, e in failed]
        return merged, outputs

    def _apply_load_result(self, result: LoadResult) -> Optional[RequestOutput]:
        """Applies a finished remote load; under the `fail` policy a failed load ends the
        request with an error (returned as its final output)."""
        req = self.requests.get(result.request_id)
        if req is None:
            return None
        if result.error and self.config.kv_load_failure_policy == "fail":
            req.error = f"KV transfer failed: {result.error}"
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
            output = self.output_processor.final_output(req)
            self._forget(req)
            return output
        self.scheduler.finish_loading(req, result.num_loaded_tokens, result.restart)
        return None

    def _advance(
        self,
        req: Request,
        token: int,
        token_status: Optional[RequestStatus],
        lp: Optional[TokenLogprob] = None,
    ) -> RequestOutput:
        """The request's output for its new token, finished when the token (the scheduler's
        verdict) or the text (the output processor's) ends it."""
        text, status = self.output_processor.process(req, token_status)
        if status is None:
            return self.output_processor.running_output(req, text, token, lp)
        self.scheduler.finish_request(req, status)
        output = self.output_processor.final_output(req, text, [token], lp)
        self._forget(req)
        return output

    def _count_prompt_sources(self, req: Request) -> None:
        cached = req.num_cached_tokens or 0
        self.stats["prompt_tokens"] += req.num_prompt_tokens
        self.stats["prompt_tokens_local"] += cached - req.num_pulled_tokens
        self.stats["prompt_tokens_pulled"] += req.num_pulled_tokens
        self.stats["prompt_tokens_computed"] += req.num_prompt_tokens - cached

    # --- convenience for tests and benchmarks ------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Runs prompts to completion; returns the output token ids of each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}-{self.stats['steps']}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for o in self.step():
                results[o.request_id].extend(o.new_token_ids)
        return [results[i] for i in ids]


def with_prompt_logprobs(output: RequestOutput, req: Request) -> RequestOutput:
    """A request's first output carries its prompt's logprobs, when it asked for them."""
    if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        req.prompt_logprobs_sent = True
        output.prompt_logprobs = req.prompt_logprobs
    return output
