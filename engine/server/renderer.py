"""vLLM's Renderer API on our engine: a completion or chat body rendered into what the engine
would run, without running it, so that a router (llm-d's EPP, `pdpool epp`) tokenizes exactly
as the engine does.

    POST /v1/completions/render       completion body -> [GenerateRequest, ...] (one per prompt)
    POST /v1/chat/completions/render  chat body       -> GenerateRequest

The body is validated and tokenized by the very code of /v1/completions and
/v1/chat/completions (RequestTranslator: same fields, same chat template flags, same
add_special_tokens), so `token_ids` are the ids those routes feed the model; the shapes are
render_shapes.py's. /inference/v1/generate (token_generate.py) runs such a request."""

from __future__ import annotations

import uuid
from typing import Any, Optional

from fastapi import Request

from pdpool.engine.server.errors import ApiError
from pdpool.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from pdpool.engine.server.render_shapes import (
    generate_request,
    render_request_id,
    rendered_ids,
    unrendered_field,
    vllm_sampling_params,
)
from pdpool.engine.server.translator import RequestTranslator
from pdpool.protocol import KVTransferParams


class RenderRoutes:
    """The two render routes (bound in api.build_app, with response_model=None)."""

    def __init__(self, translator: RequestTranslator):
        self.translator = translator

    async def completion(self, http_req: Request) -> list[dict[str, Any]]:
        req = await self.translator.parse(http_req, CompletionRequest)
        prompts = await self.translator.completion_prompt_ids(req)
        return self.rendered(req, prompts, http_req.headers.get("x-request-id"))

    async def chat(self, http_req: Request) -> dict[str, Any]:
        req = await self.translator.parse(http_req, ChatCompletionRequest)
        prompts = await self.translator.chat_prompt_ids(req)
        return self.rendered(req, prompts, http_req.headers.get("x-request-id"))[0]

    def rendered(
        self, req: GenerationRequest, prompts: list[list[int]], header_id: Optional[str]
    ) -> list[dict[str, Any]]:
        """One GenerateRequest per prompt, refused (400) as the generation route would
        refuse it: a prompt that cannot fit, bad sampling parameters."""
        unrendered = unrendered_field(req.model_extra or {})
        if unrendered is not None:
            raise ApiError(
                f"'{unrendered}' is not supported by the render routes", param=unrendered
            )
        params = self.translator.servable_params(req, prompts)
        kv = req.kv_transfer_params
        sampling = vllm_sampling_params(
            req,
            params.max_tokens,
            params.logprobs,
            # as the client sent them (vLLM echoes the raw object)
            kv.model_dump(exclude_unset=True) if isinstance(kv, KVTransferParams) else None,
            params.prompt_logprobs,
        )
        base = render_request_id(req, header_id, req.request_id, uuid.uuid4().hex[:16])
        return [
            generate_request(request_id, ids, sampling, req)
            for request_id, ids in zip(rendered_ids(base, len(prompts)), prompts, strict=True)
        ]
