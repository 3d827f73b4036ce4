"""vLLM's runtime LoRA routes, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(bound only with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING set), and the adapter
cards of `/v1/models`."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Union

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from pdpool.engine.lora.adapter_dir import AdapterError
from pdpool.engine.lora.registry import LoRARegistry
from pdpool.engine.server.errors import error_response
from pdpool.engine.server.translator import RequestTranslator
from pdpool.protocol import RequestError, parse_json_body

MAX_BODY_BYTES = 64 << 10


def adapter_cards(registry: LoRARegistry) -> list[dict[str, Any]]:
    """vLLM's model cards for adapters: `parent` is the base model, `root` the path."""
    now = int(time.time())
    cards = []
    for name in registry.names():
        ref = registry.get(name)
        if ref is not None:
            cards.append(
                {
                    "id": ref.name,
                    "object": "model",
                    "created": now,
                    "owned_by": "pdpool",
                    "root": ref.path,
                    "parent": registry.base_model,
                }
            )
    return cards


class LoRARoutes:
    def __init__(self, registry: LoRARegistry, translator: RequestTranslator) -> None:
        self.registry, self.translator = registry, translator

    async def _body(self, request: Request) -> dict[str, Any]:
        body = parse_json_body(await self.translator.read_body(request, limit=MAX_BODY_BYTES))
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    async def load(self, request: Request) -> Union[Response, PlainTextResponse]:
        try:
            body = await self._body(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            # Reading the adapter's files (and hashing them) stays off the event loop.
            files = await asyncio.get_running_loop().run_in_executor(
                self.translator.prep_pool, self.registry.check_new, name, path, True
            )
            self.registry.add(str(name), files)
        except RequestError as exc:
            return error_response(str(exc), exc.status)
        except AdapterError as exc:
            return error_response(str(exc), 400)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Union[Response, PlainTextResponse]:
        try:
            body = await self._body(request)
            name = body.get("lora_name")
            self.registry.remove(name)
        except RequestError as exc:
            return error_response(str(exc), exc.status)
        except AdapterError as exc:
            return error_response(str(exc), 404, "NotFoundError")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
