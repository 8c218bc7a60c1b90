"""Loading and unloading LoRA adapters at run time: SGLang's routes (/load_lora_adapter,
/unload_lora_adapter: a JSON reply with success, error_message and loaded_adapters) and vLLM's
(/v1/load_lora_adapter, /v1/unload_lora_adapter: a line of text, errors in OpenAI's JSON shape).
Both reach every scheduler rank as an input of its step (docs/lora.md)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field
from starlette.responses import PlainTextResponse, Response

from lockstep.entrypoints.app_state import State, returns_text
from lockstep.entrypoints.generate_request import StrictModel
from lockstep.entrypoints.middleware import JSONRoute
from lockstep.entrypoints.tokenizer_manager import RequestError
from lockstep.messages import LoadLoraAdapterReq, LoraUpdateOut, UnloadLoraAdapterReq
from lockstep.utils.http import json_response

router = APIRouter(route_class=JSONRoute)


class LoadLoraAdapterInput(StrictModel):
    lora_name: str = Field(min_length=1, pattern=r"^[^:]+$")  # ':' separates base and adapter in `model`
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterInput(StrictModel):
    lora_name: str = Field(min_length=1)


async def _update(state: State, msg: LoadLoraAdapterReq | UnloadLoraAdapterReq) -> LoraUpdateOut:
    if not state.args.lora_enabled:
        raise RequestError("LoRA adapters are off: start the server with --enable-lora")
    return await state.tm.update_lora(msg)


def _sglang_reply(out: LoraUpdateOut) -> Response:
    return json_response({"success": out.success, "error_message": out.message,
                          "loaded_adapters": out.adapters}, status=out.status)


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterInput, state: State) -> Response:
    return _sglang_reply(await _update(state, LoadLoraAdapterReq(body.lora_name, body.lora_path)))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterInput, state: State) -> Response:
    return _sglang_reply(await _update(state, UnloadLoraAdapterReq(body.lora_name)))


def _vllm_reply(out: LoraUpdateOut, done: str) -> Response:
    if not out.success:
        raise RequestError(out.message, out.status)
    return PlainTextResponse(done)


@router.post("/v1/load_lora_adapter", responses=returns_text("text/plain"))
async def v1_load_lora_adapter(body: LoadLoraAdapterInput, state: State) -> Response:
    out = await _update(state, LoadLoraAdapterReq(body.lora_name, body.lora_path))
    return _vllm_reply(out, f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=returns_text("text/plain"))
async def v1_unload_lora_adapter(body: UnloadLoraAdapterInput, state: State) -> Response:
    out = await _update(state, UnloadLoraAdapterReq(body.lora_name))
    return _vllm_reply(out, f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
