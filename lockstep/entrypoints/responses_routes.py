"""OpenAI's Responses API: POST /v1/responses, and the stored responses behind GET / DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items; the work is ResponsesServing's
(openai/responses/serving.py), reached through the `State` parameter."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from lockstep.entrypoints.app_state import State, returns
from lockstep.entrypoints.middleware import JSONRoute
from lockstep.entrypoints.openai.responses.protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from lockstep.entrypoints.openai.responses.serving import owner_of
from lockstep.utils.http import json_response

router = APIRouter(route_class=JSONRoute)


@router.post("/v1/responses", responses=returns(ResponseObject, stream=True))
async def create_response(req: ResponsesRequest, request: Request, state: State) -> Response:
    state.openai.check_model(req.model)
    return await state.responses.create(req, request, owner_of(request, state.args))


@router.get("/v1/responses/{response_id}", responses=returns(ResponseObject))
async def get_response(response_id: str, request: Request, state: State) -> Response:
    return json_response(state.responses.get(response_id, owner_of(request, state.args)))


@router.delete("/v1/responses/{response_id}", responses=returns(DeletedResponse))
async def delete_response(response_id: str, request: Request, state: State) -> Response:
    await state.responses.delete(response_id, owner_of(request, state.args))
    return json_response(DeletedResponse(id=response_id).model_dump())


@router.get("/v1/responses/{response_id}/input_items", responses=returns(InputItemList))
async def list_input_items(response_id: str, request: Request, state: State,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Literal["asc", "desc"] = "desc",
                           after: str | None = None) -> Response:
    page = state.responses.input_items(response_id, owner_of(request, state.args), limit, order,
                                       after)
    return json_response(page.model_dump())
