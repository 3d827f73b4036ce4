"""What the gateway asks an engine's /tokenize for a request, and what it takes back."""

from __future__ import annotations

import pytest

from pdpool.sidecar.kv.engine_tokenize import token_ids_of, tokenize_body

CHAT = [{"role": "user", "content": "hi"}]


def test_a_chat_is_sent_with_the_fields_that_change_its_rendering():
    body = {
        "model": "m",
        "messages": CHAT,
        "max_tokens": 5,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
    }
    assert tokenize_body(body) == {
        "model": "m",
        "messages": CHAT,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
    }


@pytest.mark.parametrize(
    "body, ask",
    [
        ({"prompt": "abc"}, {"prompt": "abc"}),
        ({"prompt": ["abc"], "model": "m"}, {"model": "m", "prompt": "abc"}),
        ({"prompt": "a", "add_special_tokens": True}, {"prompt": "a", "add_special_tokens": True}),
        ({"prompt": [1, 2, 3]}, None),  # ids already
        ({"prompt": ["a", "b"]}, None),  # several prompts: several routes
        ({"prompt": None}, None),
        ({}, None),
        ([1, 2], None),
    ],
)
def test_a_completion_is_sent_as_its_one_string_prompt(body, ask):
    assert tokenize_body(body) == ask


@pytest.mark.parametrize(
    "answer, ids",
    [
        ({"count": 3, "max_model_len": 64, "tokens": [5, 0, 9], "token_strs": None}, [5, 0, 9]),
        ({"tokens": []}, []),
        ({"tokens": [1, -2]}, None),
        ({"tokens": [1, 2.0]}, None),
        ({"tokens": [True]}, None),
        ({"tokens": "1 2"}, None),
        ({"error": {"message": "no"}}, None),
        ([1, 2], None),
    ],
)
def test_only_a_list_of_token_ids_is_taken_back(answer, ids):
    assert token_ids_of(answer, {"messages": []}) == ids


@pytest.mark.parametrize(
    "truncation, kept",
    [
        ({"truncate_prompt_tokens": 4}, [6, 7, 8, 9]),
        ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, [0, 1, 2, 3]),
        # -1 is the context less one token: /tokenize's answer gives the context.
        ({"truncate_prompt_tokens": -1}, [2, 3, 4, 5, 6, 7, 8, 9]),
        ({"truncate_prompt_tokens": 40}, list(range(10))),
        # What the engine refuses routes as the whole prompt; it never reaches a cache.
        ({"truncate_prompt_tokens": 0}, list(range(10))),
        ({"truncate_prompt_tokens": "4"}, list(range(10))),
        ({"truncate_prompt_tokens": True}, list(range(10))),
        ({"truncate_prompt_tokens": 4, "truncation_side": "middle"}, list(range(10))),
    ],
)
def test_a_chat_is_routed_on_the_tokens_its_truncation_keeps(truncation, kept):
    """/tokenize renders a chat whole; the engine then keeps what `truncate_prompt_tokens`
    keeps, and the router must hash that, or it ranks engines on blocks nobody computes."""
    answer = {"count": 10, "max_model_len": 9, "tokens": list(range(10))}
    assert token_ids_of(answer, {"messages": [], **truncation}) == kept
    # Without the context in the answer, -1 cannot be told: the whole prompt.
    if truncation.get("truncate_prompt_tokens") == -1:
        assert token_ids_of({"tokens": list(range(10))}, truncation) == list(range(10))
