"""Reading a client's generation request the way the engines will: strict JSON, then the
engines' own field definitions (pdpool.protocol). Every front-end (sidecar, gateway,
endpoint picker) refuses what no engine would accept before it takes anyone's time."""

from __future__ import annotations

from typing import Any, Optional

from pdpool.protocol import ROUTE_MODELS, RequestError, parse_json_body, validate_request


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


def parse_client_body(raw: bytes, route: Optional[str] = None) -> dict[str, Any]:
    """The body of a generation request: strict JSON (pdpool.protocol.parse_json_body),
    then validate_client_body. Raises BadRequest."""
    try:
        body = parse_json_body(raw)
    except RequestError as exc:
        raise BadRequest(str(exc), exc.param) from None
    return validate_client_body(body, route)
