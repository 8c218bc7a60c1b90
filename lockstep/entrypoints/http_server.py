"""The HTTP app: SGLang's native API and OpenAI's, on FastAPI in the front process. The routes
are declared in their own modules (native_routes.py, openai_routes.py), each an APIRouter whose
handlers are found by grepping their path; this module builds the server's state and includes
them. Bodies are pydantic models declared as route parameters, so FastAPI validates them and
/openapi.json describes them; every error is OpenAI's JSON shape (entrypoints/errors.py);
/health is 503 while the server starts, drains, or after a child process died."""

from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from lockstep import __version__
from lockstep.entrypoints import (
    admin_routes,
    chat_page,
    embedding_routes,
    lora_routes,
    native_routes,
    openai_routes,
    responses_routes,
    session_routes,
)
from lockstep.entrypoints.app_state import AppState
from lockstep.entrypoints.elastic import ElasticReplicas
from lockstep.entrypoints.engine import Launched
from lockstep.entrypoints.errors import install_error_handlers
from lockstep.entrypoints.metrics import Metrics
from lockstep.entrypoints.middleware import GuardMiddleware, JSONRoute, ServerStatus
from lockstep.entrypoints.openai.responses.serving import ResponsesServing
from lockstep.entrypoints.openai.serving import OpenAIServing
from lockstep.utils.http import ErrorResponse

# Every route module's APIRouter, in the order their routes are matched. A new module of routes
# (a page, a new API) is one entry here.
ROUTERS: tuple[APIRouter, ...] = (
    native_routes.router,
    openai_routes.router,
    responses_routes.router,  # /v1/responses
    session_routes.router,  # /open_session, /close_session
    admin_routes.router,  # /admin/replicas: replicas added and removed while serving
    embedding_routes.router,  # /v1/embeddings, /encode, /v1/rerank, /rerank, /v2/rerank, /v1/score
    lora_routes.router,  # /load_lora_adapter, /v1/unload_lora_adapter ...
    chat_page.router,  # GET /: the chat page
)


def _operation_id(route: APIRoute) -> str:
    path = route.path_format.strip("/").replace("/", "_").replace("{", "").replace("}", "")
    return f"{next(iter(route.methods)).lower()}_{path or 'root'}"


def create_app(launched: Launched, status: ServerStatus | None = None) -> FastAPI:
    args = launched.args
    tm = launched.tokenizer_manager
    if tm is None:
        raise ValueError("the HTTP server runs on node 0 only (this node has no tokenizer)")
    if status is None:
        status = ServerStatus(launched)
        status.phase = "ready"
    status.launched = launched
    openai = OpenAIServing(tm, args, launched.info)

    app = FastAPI(title="lockstep", version=__version__,
                  description="SGLang's native API and OpenAI's, served by lockstep.",
                  openapi_url="/openapi.json", docs_url=None, redoc_url=None,
                  generate_unique_id_function=_operation_id,
                  responses={"4XX": {"model": ErrorResponse, "description": "What is wrong"},
                             "5XX": {"model": ErrorResponse, "description": "Server error"}})
    app.router.route_class = JSONRoute
    app.add_middleware(GuardMiddleware, api_key=args.api_key,
                       max_body=args.max_request_body_bytes, status=status)
    app.state.server = AppState(launched=launched, tm=tm, openai=openai,
                                responses=ResponsesServing(openai, args),
                                metrics=Metrics(tm, openai.model_name), status=status,
                                started=time.time(), elastic=ElasticReplicas(launched))
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
