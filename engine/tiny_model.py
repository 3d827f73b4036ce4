"""Small random-weight checkpoints in Hugging Face format, for tests and demos.

Nothing is downloaded: the weights come from a seeded transformers model and the tokenizer
is a byte-level BPE trained here on text generated from a fixed word list.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen3's ChatML template, tools included (rendered Hermes-style, as the real Qwen3
# checkpoints ship it); messages without tools render as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\n' }}{%- endif %}"
    "{%- set call = tool_call.function if tool_call.function else tool_call %}"
    '{{- \'<tool_call>\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are "
    "but had they his her she he we you all were which when one there their what so up out "
    "if about who get would make like time just him know take people into year your good "
    "some could them see other than then now look only come its over think also back after "
    "use two how our work first well way even new want because any these give day most us "
    "cache block prefill decode token engine request batch kernel model layer state window "
    "router sidecar gateway cluster pool node pod transfer memory attention linear sliding "
    "hello world question answer story river mountain city music light water stone green "
    "blue red quick brown fox jumps lazy dog small large early late north south east west"
).split()


def training_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Deterministic English-like text with digits and punctuation, for the BPE trainer."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        corpus.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ","]))
    return corpus


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE (any text encodes) wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class TinyModelSpec:
    arch: str = "qwen3"
    seed: int = 0
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # >= 32: vLLM's CPU attention has no kernel for 16
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # qwen3: a window makes every other layer sliding
    linear_head_dim: int = 64  # qwen3_5: Gated DeltaNet key = value head dim (vLLM's CPU: 64)
    dtype: str = "float32"

    def validate(self) -> None:
        if self.arch not in ("qwen3", "qwen3_5"):
            raise ValueError(f"unknown --arch {self.arch!r} (choose qwen3 or qwen3_5)")
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "linear_head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("--num-heads must be a multiple of --num-kv-heads")
        if self.vocab_size < 300:
            raise ValueError("--vocab-size must be >= 300 (256 byte symbols + specials + merges)")
        if self.arch == "qwen3_5":
            from pdpool.engine.tiny_model_qwen3_5 import validate_qwen3_5_spec

            validate_qwen3_5_spec(self)


def _qwen3_config(spec: TinyModelSpec, tokenizer):
    from transformers import Qwen3Config

    layer_types = None
    if spec.sliding_window:
        layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
        ]
    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=bool(spec.sliding_window),
        sliding_window=spec.sliding_window,
        max_window_layers=0,
        layer_types=layer_types,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=spec.dtype,
    )


def write_tiny_model(out_dir: str | Path, spec: TinyModelSpec) -> Path:
    """Writes config.json, model.safetensors, generation_config.json and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    if spec.arch == "qwen3":
        config = _qwen3_config(spec, tokenizer)
    else:
        from pdpool.engine.tiny_model_qwen3_5 import qwen3_5_config

        config = qwen3_5_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    # Random init with std 0.02 makes every logit ~equal; larger weights give the tiny
    # model decisive (and therefore comparable) greedy choices.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 * 4)
    if spec.arch == "qwen3_5":
        from pdpool.engine.tiny_model_qwen3_5 import randomize_qwen3_5_vectors

        randomize_qwen3_5_vectors(model, spec.seed)
    model.save_pretrained(out, safe_serialization=True)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pdpool_tiny_model.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out
