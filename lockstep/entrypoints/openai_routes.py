"""OpenAI's HTTP API: models, completions and chat completions, each route declared by its path;
the work is OpenAIServing's (openai/serving.py), reached through the `State` parameter."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from lockstep.entrypoints.app_state import State, returns
from lockstep.entrypoints.middleware import JSONRoute
from lockstep.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from lockstep.utils.http import json_response

router = APIRouter(route_class=JSONRoute)


@router.get("/v1/models", responses=returns(ModelList))
async def list_models(state: State) -> Response:
    return json_response(state.openai.models())


@router.get("/v1/models/{model:path}", responses=returns(ModelCard))
async def get_model(model: str, state: State) -> Response:
    state.openai.check_model(model)
    cards = state.openai.models()["data"]
    return json_response(next((c for c in cards if c["id"] == model), cards[0]))


@router.post("/v1/completions", responses=returns(CompletionResponse, stream=True))
async def completions(req: CompletionRequest, request: Request, state: State) -> Response:
    state.tm.check_kind("generate", "/v1/completions")
    return await state.openai.completions(req, request)


@router.post("/v1/chat/completions", responses=returns(ChatCompletionResponse, stream=True))
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State) -> Response:
    state.tm.check_kind("generate", "/v1/chat/completions")
    return await state.openai.chat(req, request)
