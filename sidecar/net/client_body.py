"""Reading a client's generation request the way the engines will: strict JSON, then the
engines' own field definitions (pdpool.protocol). Every front-end (sidecar, gateway,
endpoint picker) refuses what no engine would accept before it takes anyone's time."""

from __future__ import annotations

from typing import Any, Optional

from pdpool.protocol import ROUTE_MODELS, RequestError, parse_json_body, validate_request

from .routes import GENERATION_PATHS

__all__ = ["GENERATION_PATHS", "BadRequest", "parse_client_body", "strip_client_kv_params"]

KV_PARAMS = "kv_transfer_params"
# vLLM's token-in/token-out route: token ids, and vLLM's sampling parameters (checked by the
# engine; a front-end only needs the prompt, the token limit and where KV params may hide).
TOKENS_ROUTE = "/inference/v1/generate"


class BadRequest(ValueError):
    """A client request the sidecar refuses (answered with 400 and this message)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def validate_client_body(body: Any, route: Optional[str] = None) -> dict[str, Any]:
    """Checks the types and ranges of every field the engines' OpenAI API defines, with the
    same definition the engine uses (pdpool.protocol): what a router reads (stream, token
    limits, threshold, prompt) is what the engine will see. Fields the engine does not
    implement are left to the engine (the sidecar may front vLLM, which has them).
    `route` picks the body's model (None: chat when `messages` is there)."""
    if route not in ROUTE_MODELS:
        route = (
            "/v1/chat/completions"
            if isinstance(body, dict) and "messages" in body
            else "/v1/completions"
        )
    try:
        # ROUTE_MODELS is unannotated in pdpool.protocol: mypy infers its values as
        # ModelMetaclass, not the type[_GenerationFields] they are.
        validate_request(
            body,
            ROUTE_MODELS[route],  # type: ignore[arg-type]
            refuse_unsupported=False,
        )
    except RequestError as exc:
        raise BadRequest(str(exc), exc.param) from None
    assert isinstance(body, dict)  # validate_request refuses anything but an object
    return body


def _validate_tokens_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise BadRequest("'token_ids' (a non-empty list of token ids) is required", "token_ids")
    if not isinstance(body.get("sampling_params"), dict):
        raise BadRequest("'sampling_params' (an object) is required", "sampling_params")
    return body


def parse_client_body(raw: bytes, route: Optional[str] = None) -> dict[str, Any]:
    """The body of a generation request: strict JSON (pdpool.protocol.parse_json_body),
    then validate_client_body (the token route: its ids and sampling parameters). Raises
    BadRequest."""
    try:
        body = parse_json_body(raw)
    except RequestError as exc:
        raise BadRequest(str(exc), exc.param) from None
    if route == TOKENS_ROUTE:
        return _validate_tokens_body(body)
    return validate_client_body(body, route)


def with_priority(body: dict[str, Any], priority: int) -> tuple[dict[str, Any], bool]:
    """The body with the engines' `priority` set (flow control's band, whatever the client
    sent): (body, changed); `body` is a new dict when it changed. The sidecar copies it into
    both legs of a P/D request."""
    if body.get("priority") == priority:
        return body, False
    return {**body, "priority": priority}, True


def strip_client_kv_params(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Removes client-supplied `kv_transfer_params` (at the top, or in the token route's
    `sampling_params.extra_args`, where vLLM also reads them): a client must never steer KV
    transfers (which engine to read from, which blocks, where to connect). Returns (body,
    dropped); `body` is a new dict when something was dropped."""
    params = body.get("sampling_params")
    extra = params.get("extra_args") if isinstance(params, dict) else None
    nested = isinstance(extra, dict) and KV_PARAMS in extra
    if KV_PARAMS not in body and not nested:
        return body, False
    clean = {k: v for k, v in body.items() if k != KV_PARAMS}
    if nested:
        assert isinstance(params, dict) and isinstance(extra, dict)
        kept = {k: v for k, v in extra.items() if k != KV_PARAMS}
        clean["sampling_params"] = {**params, "extra_args": kept}
    return clean, True
