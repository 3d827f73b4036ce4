"""vLLM 0.32's metric names that our engines also expose (vllm/v1/metrics/loggers.py):
name -> (type, label names besides model_name and engine). Checked against our engine in
tests/engine/test_vllm_metrics.py and against a live vLLM in tests/vllm/."""

from __future__ import annotations

VLLM_032 = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:cache_config_info": ("gauge", ("block_size", "enable_prefix_caching", "num_gpu_blocks")),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
}


def check_vllm_names(text: str) -> dict:
    """Asserts vLLM's names, types and label names in a /metrics text; returns the parsed
    families by name."""
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, extra) in VLLM_032.items():
        assert name in fams, f"{name} missing"
        assert fams[name].type == kind, (name, fams[name].type)
        samples = [s for s in fams[name].samples if not s.name.endswith("_created")]
        assert samples, f"{name} has no samples"
        # vLLM's cache_config_info has engine but no model_name
        base = {"engine"} if name == "vllm:cache_config_info" else {"model_name", "engine"}
        for s in samples:
            assert base | set(extra) <= set(s.labels), (name, s.labels)
    return fams
