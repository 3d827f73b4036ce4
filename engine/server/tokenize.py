"""/tokenize and /detokenize as vLLM serves them, so that a router without the model's
tokenizer or chat template (a gateway pod) can learn a request's token ids from the engine.

    POST /tokenize    {"prompt": str, "add_special_tokens"?: bool}
                      {"messages": [...], "add_generation_prompt"?: bool,
                       "continue_final_message"?: bool, "add_special_tokens"?: bool,
                       "tools"?: [...]}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

Both take an optional "model" (404 unless it is this engine's). The defaults are those of this
engine's own generation endpoints, which are vLLM's (a string prompt with the tokenizer's
special tokens, a chat with the generation prompt and none), so the ids equal those a
completion of the same body is computed from."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from pdpool.engine.server.protocol import ChatCompletionRequest
from pdpool.engine.server.translator import RequestTranslator
from pdpool.protocol import RequestError, parse_json_body, validate_request


# The fields of a chat body that change its token ids (their defaults are the chat route's).
CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "tools",
    "chat_template_kwargs",
)
# Fields that would change them too, which this server does not serve: refused, as the chat
# route refuses them, rather than answered with the ids of the default template.
REFUSED_CHAT_FIELDS = ("chat_template", "documents")


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return value


class TokenizeRoutes:
    """The engine's tokenizer over HTTP (the paths are bound in api.build_app, with
    response_model=None: FastAPI takes no response model from their return annotations)."""

    def __init__(self, translator: RequestTranslator):
        self.translator = translator
        self.engine = translator.engine

    async def tokenize(self, request: Request) -> dict[str, Any]:
        return await self.translator.decode_body(request, self._tokenize)

    async def detokenize(self, request: Request) -> dict[str, Any]:
        return await self.translator.decode_body(request, self._detokenize)

    def _body(self, raw: bytes) -> dict[str, Any]:
        body = parse_json_body(raw)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        self.translator.check_model(body.get("model"))
        return body

    def _tokenize(self, raw: bytes) -> dict[str, Any]:
        body = self._body(raw)
        if ("prompt" in body) == ("messages" in body):
            raise RequestError("give exactly one of 'prompt' (a string) or 'messages'", "prompt")
        if "messages" in body:
            names = CHAT_FIELDS + REFUSED_CHAT_FIELDS
            fields = {name: body[name] for name in names if name in body}
            chat = validate_request({"messages": body["messages"], **fields}, ChatCompletionRequest)
            ids = self.translator.chat_tokens(chat)
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise RequestError("'prompt' must be a string", "prompt")
            ids = self.translator.prompt_tokens(prompt, _flag(body, "add_special_tokens", True))
        strs = None
        if _flag(body, "return_token_strs", False):
            strs = self.engine.tokenizer.convert_ids_to_tokens(ids)
        return {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _detokenize(self, raw: bytes) -> dict[str, Any]:
        body = self._body(raw)
        tokens = body.get("tokens")
        vocab = self.engine.info.config["vocab_size"]
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < vocab for t in tokens
        ):
            raise RequestError(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": self.engine.tokenizer.decode(tokens)}
