"""The pure leg builders: each rule of the P/D protocol on its own."""

import pytest

from pdpool.sidecar.net.client_body import BadRequest, strip_client_kv_params, validate_client_body
from pdpool.sidecar.proxy import legs


def test_decode_first_leg_uses_pool_threshold_unless_request_has_one():
    body = {"prompt": "hi", "max_tokens": 5}
    assert legs.decode_first_leg(body, 0.7)["cache_hit_threshold"] == 0.7
    own = {**body, "cache_hit_threshold": 0.2}
    assert legs.decode_first_leg(own, 0.7)["cache_hit_threshold"] == 0.2
    assert legs.decode_first_leg({**own, "cache_hit_threshold": 0}, 0.7)["cache_hit_threshold"] == 0
    assert "cache_hit_threshold" not in body  # input untouched


def test_client_kv_params_are_stripped():
    body = {
        "prompt": "x",
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9"},
    }
    clean, dropped = strip_client_kv_params(body)
    assert dropped and "kv_transfer_params" not in clean
    assert "kv_transfer_params" in body
    assert strip_client_kv_params({"prompt": "x"}) == ({"prompt": "x"}, False)


def test_prefill_leg_caps_limits_and_disables_streaming():
    body = {
        "prompt": "p",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "max_completion_tokens": 60,
        "min_tokens": 10,
        "n": 3,
        "cache_hit_threshold": 0.9,
        "echo": True,
    }
    leg = legs.prefill_leg(body)
    assert leg["stream"] is False and "stream_options" not in leg and "echo" not in leg
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert leg["min_tokens"] == 1 and "n" not in leg
    assert leg["cache_hit_threshold"] == 0.0
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert body["max_tokens"] == 50 and body["stream"] is True and body["echo"] is True


def test_prefill_leg_without_min_tokens_adds_none():
    assert "min_tokens" not in legs.prefill_leg({"prompt": "p"})


def test_prefill_leg_carries_decode_prefix_for_pull():
    rejection = {
        "do_remote_decode": True,
        "remote_engine_id": "dec-0",
        "remote_host": "10.1.1.1",
        "remote_port": 5600,
        "remote_block_ids": [[3, 4], [7]],
        "remote_num_tokens": 32,
        "remote_request_id": "lease-1",
        "unrelated": 1,
    }
    pull = legs.pull_params_from_rejection(rejection)
    assert pull == {
        "remote_engine_id": "dec-0",
        "remote_host": "10.1.1.1",
        "remote_port": 5600,
        "remote_block_ids": [[3, 4], [7]],
        "remote_num_tokens": 32,
        "remote_request_id": "lease-1",
    }
    leg = legs.prefill_leg({"prompt": "p"}, pull)
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["remote_num_tokens"] == 32
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False


def test_pull_threshold_skips_short_prefixes():
    rejection = {"remote_engine_id": "d", "remote_block_ids": [1, 2], "remote_num_tokens": 32}
    assert legs.pull_params_from_rejection(rejection, 33) is None
    assert legs.pull_params_from_rejection(rejection, 32)["remote_num_tokens"] == 32


@pytest.mark.parametrize(
    "rejection",
    [
        None,
        {},
        {"do_remote_decode": True},
        {"remote_engine_id": "d", "remote_block_ids": [], "remote_num_tokens": 0},
        {"remote_block_ids": [1], "remote_num_tokens": 4},
    ],
)
def test_nothing_to_pull(rejection):
    assert legs.pull_params_from_rejection(rejection) is None


def test_decode_leg_restores_client_settings_and_forwards_params_verbatim():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 40,
        "cache_hit_threshold": 0.9,
    }
    kv = {
        "do_remote_prefill": True,
        "remote_engine_id": "p1",
        "remote_block_ids": [1, 2],
        "remote_host": "h",
        "remote_port": 1,
        "remote_request_id": "r",
        "extra": "kept",
    }
    leg = legs.decode_leg(body, kv)
    assert leg["kv_transfer_params"] is kv
    assert leg["cache_hit_threshold"] == 0.0
    assert leg["stream"] is True and leg["stream_options"] == {"include_usage": True}
    assert leg["max_completion_tokens"] == 40
    fallback = legs.decode_leg(body, None)
    assert "kv_transfer_params" not in fallback and fallback["cache_hit_threshold"] == 0.0


@pytest.mark.parametrize(
    "body,param",
    [
        ([1, 2], None),
        ("text", None),
        (None, None),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "cache_hit_threshold": 1.5}, "cache_hit_threshold"),
        ({"prompt": "x", "cache_hit_threshold": "0.5"}, "cache_hit_threshold"),
        ({"prompt": "x", "stream_options": []}, "stream_options"),
    ],
)
def test_validation_rejects(body, param):
    with pytest.raises(BadRequest) as err:
        validate_client_body(body)
    assert err.value.param == param


def test_rejection_and_deciding_chunks():
    rejected = {"choices": [{"index": 0, "text": "", "finish_reason": "cache_threshold"}]}
    assert legs.is_rejection(rejected) and legs.chunk_decides(rejected)
    role_only = {
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ]
    }
    assert not legs.chunk_decides(role_only)
    assert legs.chunk_decides({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]})
    assert legs.chunk_decides({"choices": [{"text": "a", "finish_reason": None}]})
    assert not legs.chunk_decides({"choices": [], "usage": {}})
    assert not legs.is_rejection({"choices": [{"finish_reason": "length"}]})


def test_prefill_answer_usable_only_with_remote_prefill_params():
    assert legs.prefill_answer_is_usable({"do_remote_prefill": True, "remote_engine_id": "p"})
    assert not legs.prefill_answer_is_usable(None)
    assert not legs.prefill_answer_is_usable({"do_remote_prefill": False, "remote_engine_id": "p"})


def test_merged_usage_counts_cache_hits_across_both_legs():
    # prefill computed 100 of 400 (300 pulled from decode), decode pulled all but 1.
    prefill = {"prompt_tokens": 400, "prompt_tokens_details": {"cached_tokens": 300}}
    decode = {
        "prompt_tokens": 400,
        "completion_tokens": 9,
        "total_tokens": 409,
        "prompt_tokens_details": {"cached_tokens": 399},
    }
    merged = legs.merged_usage(decode, prefill)
    assert merged["prompt_tokens_details"]["cached_tokens"] == 299
    assert merged["completion_tokens"] == 9 and merged["prompt_tokens"] == 400
    assert decode["prompt_tokens_details"]["cached_tokens"] == 399  # input untouched
    assert legs.merged_usage({"prompt_tokens": 5}, None)["prompt_tokens_details"] == {
        "cached_tokens": 0
    }


def test_merged_usage_keeps_each_legs_source_split():
    prefill = {
        "prompt_tokens": 400,
        "prompt_tokens_details": {
            "cached_tokens": 300,
            "pdpool": {"local": 0, "pulled": 300, "computed": 100},
        },
    }
    decode = {
        "prompt_tokens": 400,
        "completion_tokens": 9,
        "total_tokens": 409,
        "prompt_tokens_details": {
            "cached_tokens": 399,
            "pdpool": {"local": 0, "pulled": 399, "computed": 1},
        },
    }
    details = legs.merged_usage(decode, prefill)["prompt_tokens_details"]
    assert details["pdpool"] == {
        "local": 0,
        "pulled": 399,
        "computed": 1,
        "prefill": {"local": 0, "pulled": 300, "computed": 100},
    }
    assert "prefill" not in decode["prompt_tokens_details"]["pdpool"]  # input untouched
    alone = legs.merged_usage(decode, None)["prompt_tokens_details"]["pdpool"]
    assert alone == {"local": 0, "pulled": 399, "computed": 1}


def test_pull_params_carry_the_lease():
    kv = {
        "do_remote_decode": True,
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_block_ids": [1, 2],
        "remote_num_tokens": 32,
        "remote_host": "h",
        "remote_port": 1,
        "pdpool_lease": {"id": "L", "sig": "s"},
    }
    assert legs.pull_params_from_rejection(kv, 0)["pdpool_lease"] == {"id": "L", "sig": "s"}
