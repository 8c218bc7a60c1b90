"""What the HTTP routes share: the server's state (one per app, in `app.state.server`), which a
route takes as a parameter typed `State`, and the helpers that describe a route's 200 reply in
/openapi.json. Route modules (native_routes.py, openai_routes.py, ...) import this module, never
http_server.py, which imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import Request

from lockstep.entrypoints.elastic import ElasticReplicas
from lockstep.entrypoints.engine import Launched
from lockstep.entrypoints.metrics import Metrics
from lockstep.entrypoints.middleware import ServerStatus
from lockstep.entrypoints.openai.responses.serving import ResponsesServing
from lockstep.entrypoints.openai.serving import OpenAIServing
from lockstep.entrypoints.tokenizer_manager import TokenizerManager
from lockstep.server_args import ServerArgs


@dataclass(frozen=True)
class AppState:
    """One server's parts, built once by create_app."""

    launched: Launched
    tm: TokenizerManager
    openai: OpenAIServing
    responses: ResponsesServing  # /v1/responses and its store
    metrics: Metrics
    status: ServerStatus
    started: float  # time.time() when the app was made: /server_info's uptime
    elastic: ElasticReplicas  # replicas added and removed while serving (admin_routes.py)

    @property
    def args(self) -> ServerArgs:
        return self.launched.args


def app_state(request: Request) -> AppState:
    return request.app.state.server


# A route's parameter `state: State` receives the app's AppState (a FastAPI dependency; it adds
# nothing to /openapi.json).
State = Annotated[AppState, Depends(app_state)]


def returns(model: Any, stream: bool = False) -> dict[Any, Any]:
    """The 200 response of a route in /openapi.json: `model` as JSON, and SSE when it streams."""
    return {200: {"model": model, **({"content": {"text/event-stream": {}}} if stream else {})}}


def returns_text(media_type: str) -> dict[Any, Any]:
    return {200: {"content": {media_type: {"schema": {"type": "string"}}}}}
