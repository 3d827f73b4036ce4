"""The client routes every front-end (the gateway, the endpoint picker, the sidecar) knows,
in one place: which generate tokens (each is read, checked, admitted, charged and cleaned of
client `kv_transfer_params` alike, whatever door it came through) and which the gateway
passes on at all (any other path is answered 404: an engine's internal routes, such as its
KV lease release, are not the clients')."""

from __future__ import annotations

# Every route that makes an engine generate. A route added here is flow-controlled and
# cleaned by every front-end at once.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
# The generation routes whose OpenAI bodies the sidecar's P/D flows rewrite leg by leg; the
# others run whole on the decode engine.
PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# What the gateway forwards, by method (its own /health, /ready, /metrics are answered there).
FORWARDED = {
    **{path: frozenset({"POST"}) for path in GENERATION_PATHS},
    "/v1/models": frozenset({"GET"}),
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
    "/v1/completions/render": frozenset({"POST"}),
    "/v1/chat/completions/render": frozenset({"POST"}),
}


def is_generation(method: str, path: str) -> bool:
    return method == "POST" and path in GENERATION_PATHS


def forwarded(method: str, path: str) -> bool:
    """Whether the gateway passes this request on to a sidecar."""
    return method in FORWARDED.get(path, ())
