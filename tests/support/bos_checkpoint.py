"""A tiny checkpoint whose tokenizer adds a BOS token (as Llama's do), so that
`add_special_tokens` changes a prompt's token ids: the tiny Qwen3 tokenizer adds none, and a
test of that flag on it could not fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BOS = "<|endoftext|>"  # id 0 in the tiny tokenizers


def with_bos_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` at `dst` whose tokenizer.json prepends BOS to every
    sequence it encodes with special tokens (the same weights, template and vocabulary)."""
    if not (dst / "tokenizer.json").is_file():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        path = dst / "tokenizer.json"
        tokenizer = json.loads(path.read_text())
        bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
        tokenizer["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
        }
        path.write_text(json.dumps(tokenizer))
    return dst
