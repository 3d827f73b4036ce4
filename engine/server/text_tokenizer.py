"""The engine server's tokenizer without transformers (which imports torch): the
checkpoint's tokenizer.json through `tokenizers` (Rust) and its chat template through
jinja2, rendered the way transformers renders it, so the server process stays small and
starts fast. It gives the token ids transformers gives (tests/engine/test_text_tokenizer.py
compares them on the tiny checkpoints)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

# Special tokens a chat template may name (transformers passes its special-tokens map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or the template refused the messages."""


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(model_dir: Path, config: dict[str, Any]) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = model_dir / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def _compile(source: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _variables(source: str) -> frozenset[str]:
    """The names a template reads from its context."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(meta.find_undeclared_variables(env.parse(source)))


class TextTokenizer:
    """What the server asks of a tokenizer, in the names of transformers' tokenizers."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        source = _chat_template_source(model_dir, config)
        self._template = _compile(source) if source is not None else None
        self.template_variables = _variables(source) if source is not None else frozenset()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[Optional[str]]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> Any:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        import jinja2

        if continue_final_message:
            messages = _with_continue_tag(messages)
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # The template met a value of the request it cannot use (a message or a template
            # variable of another type than it expects): the request's fault, not the server's.
            raise ChatTemplateError(f"the chat template cannot render this request: {exc}") from exc
        if continue_final_message:
            text = _cut_at_continue_tag(text)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# continue_final_message as transformers does it: the final message is rendered with this tag
# after its text, and the chat is cut where the tag is (so the template's end-of-turn is gone).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _with_continue_tag(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise ChatTemplateError(
            "continue_final_message is set but the final message has no text to continue"
        )
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"] + CONTINUE_TAG}]


def _cut_at_continue_tag(text: str) -> str:
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    # A template that keeps the tag's trailing space keeps spacing: cut exactly; else trim.
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
