"""SGLang's session routes: /open_session answers the session's id (a JSON string), and
/close_session closes it (lockstep.entrypoints.session_controller; a request joins a session with
its `session_params` on /generate)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field
from starlette.responses import Response

from lockstep.entrypoints.app_state import State, returns
from lockstep.entrypoints.generate_request import StrictModel
from lockstep.entrypoints.middleware import JSONRoute
from lockstep.entrypoints.session_controller import SessionError
from lockstep.entrypoints.sglang_fields import Off
from lockstep.entrypoints.tokenizer_manager import RequestError
from lockstep.sampling_params import NonEmptyStr
from lockstep.utils.http import json_response

router = APIRouter(route_class=JSONRoute)


class OpenSessionReqInput(StrictModel):
    """SGLang's OpenSessionReqInput."""

    _sglang_fields = {"streaming": Off("no streaming sessions", (False,))}

    capacity_of_str_len: int = Field(ge=1)  # the longest prompt a turn may grow to, in tokens
    session_id: NonEmptyStr | None = None  # default: a new id
    timeout: float | None = Field(None, gt=0)  # seconds idle before it is closed


class CloseSessionReqInput(StrictModel):
    session_id: NonEmptyStr


def _session_error(e: SessionError) -> RequestError:
    return RequestError(str(e), e.status)


@router.post("/open_session", responses=returns(str))
async def open_session(body: OpenSessionReqInput, state: State) -> Response:
    try:
        sid = state.tm.sessions.open(body.capacity_of_str_len, body.session_id, body.timeout)
    except SessionError as e:
        raise _session_error(e) from None
    return json_response(sid)


# SGLang answers an empty 200; the schema says so (no JSON body to parse).
@router.post("/close_session", response_class=Response,
             responses={200: {"description": "closed; no body", "content": None}})
async def close_session(body: CloseSessionReqInput, state: State) -> Response:
    try:
        state.tm.sessions.close(body.session_id)
    except SessionError as e:
        raise _session_error(e) from None
    return Response(status_code=200)

