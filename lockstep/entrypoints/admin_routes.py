"""Admin routes: the data-parallel replicas of a running `--dp-size` server, listed, added and
removed (lockstep.entrypoints.elastic). They change the server itself, so they answer only on a
server started with --api-key (whose Bearer key every route but /health requires): elsewhere a
403."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.responses import Response

from lockstep.entrypoints.app_state import AppState, State, returns
from lockstep.entrypoints.middleware import JSONRoute
from lockstep.entrypoints.tokenizer_manager import RequestError
from lockstep.utils.http import json_response

router = APIRouter(route_class=JSONRoute)


class Replicas(BaseModel):
    """Each replica's state by dp_rank: active, warming, draining or retired."""

    replicas: list[str]
    dp_rank: int | None = None  # the replica the call added or removed


def _guarded(state: AppState) -> None:
    if state.args.api_key is None:
        raise RequestError("admin routes need a server started with --api-key", status=403)


def _reply(state: AppState, dp_rank: int | None = None) -> Response:
    return json_response(Replicas(replicas=list(state.tm.replicas), dp_rank=dp_rank).model_dump())


@router.get("/admin/replicas", responses=returns(Replicas))
async def list_replicas(state: State) -> Response:
    _guarded(state)
    return _reply(state)


@router.post("/admin/replicas", responses=returns(Replicas))
async def add_replica(state: State) -> Response:
    """Start a replica, warm it, then dispatch to it; answers once it takes traffic."""
    _guarded(state)
    return _reply(state, await state.elastic.add())


@router.delete("/admin/replicas/{dp_rank}", responses=returns(Replicas))
async def remove_replica(dp_rank: int, state: State) -> Response:
    """Stop dispatching to the replica, let its requests finish, stop it; answers when done."""
    _guarded(state)
    await state.elastic.remove(dp_rank)
    return _reply(state, dp_rank)
