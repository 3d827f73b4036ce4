"""The routes that orchestrators and routers use besides generation: liveness, readiness, the
model list, Prometheus metrics, and the release of a KV lease this engine granted."""

from __future__ import annotations

import time
from typing import Any, Union

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdpool.engine.core_client import EngineClient
from pdpool.engine.server.errors import error_response
from pdpool.engine.server.lora_routes import adapter_cards
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.translator import RequestTranslator
from pdpool.protocol import parse_json_body


class OpsRoutes:
    """One engine's operational routes (the paths are bound in api.build_app, with
    response_model=None: FastAPI takes no response model from their return annotations)."""

    def __init__(
        self,
        aengine: EngineClient,
        metrics: EngineMetrics,
        translator: RequestTranslator,
    ):
        self.aengine, self.engine = aengine, aengine.view
        self.metrics, self.translator = metrics, translator

    async def health(self) -> Union[Response, dict[str, str]]:
        """Liveness: the process and its engine loop (thread or process) are alive."""
        if not self.aengine.alive:  # readiness with no stall limit: only why it stopped
            why = self.aengine.readiness(float("inf")) or "the engine loop has stopped"
            return error_response(why, 503, "ServiceUnavailable")
        if self.engine.fault is not None:  # every request failed in the model: not hidden
            return error_response(f"engine failure: {self.engine.fault}", 503, "ServiceUnavailable")
        return {"status": "ok"}

    async def ready(self) -> Union[Response, dict[str, str]]:
        """Readiness: as /health, and the engine loop has ticked within
        --ready-max-stall-s while it has work (a wedged step is not ready)."""
        problem = self.aengine.readiness(self.engine.config.ready_max_stall_s)
        if problem is None and self.engine.fault is not None:
            problem = f"engine failure: {self.engine.fault}"
        if problem is not None:
            return error_response(problem, 503, "ServiceUnavailable")
        return {"status": "ready"}

    async def release_kv(self, request: Request) -> Union[Response, dict[str, bool]]:
        """Ends a KV lease this engine granted, named by the kv_transfer_params it issued
        (a router whose prefill leg did not pull decode's prefix gives it back at once)."""
        body = await self.translator.decode_body(request, parse_json_body)
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict):
            return error_response(
                "kv_transfer_params (an object) is required", 400, param="kv_transfer_params"
            )
        return {"released": await self.aengine.release_lease(params)}

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.engine.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pdpool",
                    "max_model_len": self.engine.max_model_len,
                    "root": self.engine.config.model,
                    "parent": None,
                    # Not vLLM's: what a P/D router compares so that a prefill engine of
                    # another model revision never computes KV for this one (rollouts).
                    "kv_fingerprint": self.engine.kv_fingerprint,
                },
                *(adapter_cards(self.translator.loras) if self.translator.loras else []),
            ],
        }

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
