"""The engine server's torch-free tokenizer gives what transformers gives, on the tiny
checkpoints: prompt ids, chat-template ids, decoded text, token strings, the vocabulary."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdpool.engine.server.text_tokenizer import ChatTemplateError, TextTokenizer

TEXTS = [
    "hello world",
    "  leading spaces and\ttabs\nnew lines",
    "unicode: héllo wörld, 你好, emoji 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "numbers 12345 and punctuation !?.,;:",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3? 你好"},
    ],
]


@pytest.fixture(params=["tiny_qwen3", "tiny_qwen3_5"])
def pair(request):
    model_dir = request.getfixturevalue(request.param)
    return TextTokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


def test_prompt_ids_and_decoding_match_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for special in (False, True):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], text
            assert ours.decode(ids) == theirs.decode(ids)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.get_vocab() == theirs.get_vocab()


def test_chat_template_matches_transformers(pair):
    ours, theirs = pair
    for messages in CONVERSATIONS:
        for gen in (False, True):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert text == theirs.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False
            )
        # vLLM's continue_final_message: the last message left open for the model to go on
        kept = ours.apply_chat_template(messages, continue_final_message=True)
        assert kept == theirs.apply_chat_template(
            messages, continue_final_message=True, tokenize=False
        )
        assert kept.endswith(messages[-1]["content"])


def test_a_model_without_a_chat_template_is_a_clear_error(tiny_qwen3, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_qwen3, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        TextTokenizer(bare).apply_chat_template([{"role": "user", "content": "hi"}])
