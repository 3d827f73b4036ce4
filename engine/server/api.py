"""The OpenAI-compatible HTTP app of one engine: build_app wires the serving classes.

    request -> RequestTranslator (body, validation, tokens, one ChoiceRequest per choice)
            -> ChoiceRunner (engine requests, first outputs, collect or pump, close)
            -> ResponseWriter (whole answer or SSE stream; a ChoiceFormat's JSON)

CompletionResponder and ChatResponder drive those steps for their endpoint; OpsRoutes serves
health, readiness, models, metrics and the KV lease release; TokenizeRoutes serves /tokenize
and /detokenize; RenderRoutes and TokenGenerateRoute serve vLLM's Renderer API (render routes,
/inference/v1/generate); errors.py writes every error."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI

from pdpool.engine.core_client import EngineClient
from pdpool.engine.lora.registry import LoRARegistry, registry_from_config, runtime_updates_enabled
from pdpool.engine.server.choices import ChoiceRunner
from pdpool.engine.server.lora_routes import LoRARoutes
from pdpool.engine.server.errors import install_error_handlers
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.ops import OpsRoutes
from pdpool.engine.server.renderer import RenderRoutes
from pdpool.engine.server.responders import ChatResponder, CompletionResponder
from pdpool.engine.server.response_writer import ResponseWriter
from pdpool.engine.server.token_generate import TokenGenerateRoute
from pdpool.engine.server.tokenize import TokenizeRoutes
from pdpool.engine.server.translator import RequestTranslator


def build_app(aengine: EngineClient, loras: Optional[LoRARegistry] = None) -> FastAPI:
    """The app over an engine on a thread of this process or in a process of its own.
    `loras`: the adapters it serves (with --enable-lora; read from its config if None)."""
    engine = aengine.view
    if loras is None and engine.config.enable_lora:
        loras = registry_from_config(engine.config, engine.model_name)
    metrics = EngineMetrics(engine, engine.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await aengine.attach(asyncio.get_running_loop())
        yield
        # After the streams drained: uvicorn may end the process by re-raising SIGTERM.
        aengine.shutdown()

    app = FastAPI(title="pdpool engine", lifespan=lifespan)
    app.state.aengine = aengine
    app.state.metrics = metrics
    install_error_handlers(app)
    # CPU-heavy request preparation (JSON, validation, chat template, tokenization) runs
    # here, never on the event loop: /health and streams stay responsive meanwhile.
    prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
    app.state.prep_pool = prep_pool

    translator = RequestTranslator(engine, metrics, prep_pool, loras)
    runner = ChoiceRunner(aengine, metrics)
    writer = ResponseWriter(runner, metrics, engine.model_name)
    ops = OpsRoutes(aengine, metrics, translator)
    completions = CompletionResponder(translator, runner, writer, metrics)
    chat = ChatResponder(translator, runner, writer, metrics)
    tokens = TokenizeRoutes(translator)
    render = RenderRoutes(translator)
    token_generate = TokenGenerateRoute(translator, runner, metrics, engine.model_name)
    # Route names as they were when these were functions: OpenAPI's operation ids keep them.
    routes: list[tuple[str, str, Callable[..., Any], str]] = [
        ("GET", "/health", ops.health, "health"),
        ("GET", "/ready", ops.ready, "ready"),
        ("POST", "/pdpool/v1/kv/release", ops.release_kv, "release_kv"),
        ("GET", "/v1/models", ops.models, "models"),
        ("GET", "/metrics", ops.prometheus, "prom"),
        ("POST", "/v1/completions", completions.create, "completions"),
        ("POST", "/v1/chat/completions", chat.create, "chat"),
        ("POST", "/tokenize", tokens.tokenize, "tokenize"),
        ("POST", "/detokenize", tokens.detokenize, "detokenize"),
        ("POST", "/v1/completions/render", render.completion, "render_completion"),
        ("POST", "/v1/chat/completions/render", render.chat, "render_chat"),
        ("POST", "/inference/v1/generate", token_generate.generate, "generate_tokens"),
    ]
    if loras is not None and runtime_updates_enabled():
        lora_routes = LoRARoutes(loras, translator)
        routes.append(("POST", "/v1/load_lora_adapter", lora_routes.load, "load_lora_adapter"))
        routes.append(
            ("POST", "/v1/unload_lora_adapter", lora_routes.unload, "unload_lora_adapter")
        )
    for method, path, endpoint, name in routes:
        # response_model=None: FastAPI takes no response model from the endpoints' return
        # annotations (they return dicts or responses, written as they are).
        app.add_api_route(path, endpoint, methods=[method], name=name, response_model=None)
    return app
