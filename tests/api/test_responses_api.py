"""/v1/responses on a live server of the default model, through the official openai client
(pinned by the shared venv: openai 3.63.0), and the agent frameworks that speak it (the OpenAI
Agents SDK, LangChain's use_responses_api) from a client venv. Tool calls and JSON schemas are
forced by the grammar, so the checks hold on any model; free text is checked against the chat
route's reply to the same conversation (one path: the same tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks

STORE_MAX = 8
TOOLS: list[Any] = [{
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}]
NAMED = {"type": "function", "name": "get_weather"}
ASK = "Say hello."


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def store_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-store") / "store.json"


@pytest.fixture(scope="module")
@marks("server", "real_model")
def server(store_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The default model with a small, persisted store; the restart test (last) stops it."""
    srv = LiveServer("--max-total-tokens", "8192", "--responses-store-file", str(store_file),
                     "--responses-store-max-items", str(STORE_MAX),
                     log_dir=tmp_path_factory.mktemp("responses-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)


def chat_reply(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="default", messages=messages, temperature=0,
                                          **kw).choices[0]


def test_create_is_the_chat_reply_as_a_response(client):
    r = client.responses.create(model="default", input=ASK, instructions="Be friendly.",
                                temperature=0, max_output_tokens=200, metadata={"k": "v"})
    assert (r.object, r.status, r.incomplete_details, r.metadata) == (
        "response", "completed", None, {"k": "v"})
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text == message.content[0].text and r.output_text
    chat = chat_reply(client, [{"role": "system", "content": "Be friendly."},
                               {"role": "user", "content": ASK}], max_tokens=200)
    assert r.output_text == chat.message.content
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="default", input=ASK, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    with client.responses.stream(model="default", input=ASK, temperature=0,
                                 max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text


def test_stream_assembles_the_same_response(client):
    whole = client.responses.create(model="default", input=ASK, temperature=0,
                                    max_output_tokens=200)
    with client.responses.stream(model="default", input=ASK, temperature=0,
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model="default", input="Name a city in Italy.", text_format=City,
                               temperature=0, max_output_tokens=80)
    assert r.status == "completed", r
    city = r.output_parsed
    assert isinstance(city, City) and city.name and city.country
    assert json.loads(r.output_text) == city.model_dump()


def test_function_tool_round_trip(client):
    first = client.responses.create(model="default", input="What is the weather in Paris?",
                                    tools=TOOLS, tool_choice=NAMED, temperature=0,
                                    max_output_tokens=60)
    [call] = first.output
    assert (call.type, call.name, first.status) == ("function_call", "get_weather", "completed")
    assert set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "It is sunny, 24 C."}
    kw = {"model": "default", "tools": TOOLS, "tool_choice": "none", "temperature": 0,
          "max_output_tokens": 40}
    stored = client.responses.create(previous_response_id=first.id, input=[result], **kw)
    sent = client.responses.create(input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True), result], **kw)
    assert stored.output[0].type == "message" and stored.output_text
    # the stored conversation is the one the client would have sent
    assert stored.output_text == sent.output_text
    assert stored.usage.input_tokens == sent.usage.input_tokens


def test_required_tool_choice_streams_the_call(client):
    with client.responses.stream(model="default", input="Weather in Rome and Oslo?", tools=TOOLS,
                                 tool_choice="required", temperature=0,
                                 max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c.arguments for c in calls)
    assert all(set(json.loads(c.arguments)) == {"city"} for c in calls)


def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = client.responses.create(model="default", input="Name three colors.", temperature=0,
                                    max_output_tokens=30)
    second = client.responses.create(model="default", input="And two more.", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=10)
    assert second.previous_response_id == first.id
    # the earlier turn's prompt and reply come from the cache
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[0].content[0].text == "Name three colors."
    assert items[1].id == first.output[0].id and items[2].content[0].text == "And two more."


def test_get_delete_and_input_items(client):
    r = client.responses.create(model="default", input=ASK, temperature=0, max_output_tokens=5)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    [item] = client.responses.input_items.list(r.id).data
    assert item.role == "user" and item.content[0].text == ASK
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="No response with id"):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="default", input=ASK, max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_evicted_response_is_a_clear_404(client):
    ids = [client.responses.create(model="default", input=f"Count to {i}.",
                                   max_output_tokens=1).id for i in range(STORE_MAX + 1)]
    with pytest.raises(openai.NotFoundError, match="was evicted"):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError, match="was evicted"):
        client.responses.create(model="default", input="More.", previous_response_id=ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize(("extra", "named"), [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": TOOLS, "tool_choice": NAMED,
      "text": {"format": {"type": "json_object"}}}, "combined with text.format"),
])
def test_unserved_request_is_a_400_naming_it(client, extra, named):
    with pytest.raises(openai.BadRequestError, match=named):
        client.responses.create(model="default", input=ASK, max_output_tokens=2,
                                extra_body=extra)


# ---------------------------------------------------------------------------------------------
# Agent frameworks, unchanged, from a venv of their own

FRAMEWORKS = ["openai-agents==0.24.0", "langchain-openai==1.7.4"]

FRAMEWORK_PROGRAM = r'''
import asyncio, json, sys
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

base = sys.argv[1] + "/v1"
out = {"calls": []}
set_tracing_disabled(True)

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    out["calls"].append(city)
    return f"It is sunny in {city}."

# tool_choice forces the first turn's call; the SDK resets it to auto after the call
agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
              model=OpenAIResponsesModel(model="default", openai_client=AsyncOpenAI(
                  base_url=base, api_key="none", max_retries=0)),
              model_settings=ModelSettings(tool_choice="get_weather", temperature=0,
                                           max_tokens=60))

async def both():  # one event loop: the client's connections belong to it
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    run = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
    kinds = [e.type async for e in run.stream_events()]  # the same run, streamed
    return result, run, kinds

result, run, kinds = asyncio.run(both())
out["agent_items"] = [type(i).__name__ for i in result.new_items]
out["agent_final"] = result.final_output
out["streamed_items"] = [type(i).__name__ for i in run.new_items]
out["streamed_final"] = run.final_output
out["streamed_deltas"] = kinds.count("raw_response_event")

class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)

@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"

llm = ChatOpenAI(base_url=base, api_key="none", model="default", temperature=0, max_tokens=64,
                 use_responses_api=True)
out["lc_text"] = llm.invoke("Say hello.").text
out["lc_streamed"] = "".join(c.text for c in llm.stream("Say hello."))
msg = llm.bind_tools([weather], tool_choice="weather").invoke("Weather in Paris?")
out["lc_tool_args"] = [c["args"] for c in msg.tool_calls]
out["lc_structured"] = llm.with_structured_output(City, method="json_schema").invoke(
    "Name a city in Italy.").model_dump()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def frameworks_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lockstep.testing.client_venv import PackageIndexUnreachable, client_venv

    try:
        return client_venv(tmp_path_factory.getbasetemp().parent, FRAMEWORKS)
    except PackageIndexUnreachable as e:
        pytest.skip(str(e))


def test_agents_sdk_and_langchain_run_unchanged(server, client, frameworks_python, tmp_path):
    from lockstep.testing.client_venv import run_client

    out = run_client(frameworks_python, FRAMEWORK_PROGRAM, server.url, tmp_path)
    # the Agents SDK: the forced call ran the tool, its output went back, the agent answered
    assert out["calls"] and out["calls"][0], out
    assert out["agent_items"][:2] == ["ToolCallItem", "ToolCallOutputItem"], out
    assert out["agent_items"][-1] == "MessageOutputItem" and out["agent_final"], out
    assert out["calls"] == [out["calls"][0]] * 2, out  # the streamed run called it the same
    assert out["streamed_items"] == out["agent_items"], out
    assert out["streamed_final"] == out["agent_final"] and out["streamed_deltas"] > 0, out
    # LangChain on the Responses API: text (whole and streamed), a tool call, an object
    chat = chat_reply(client, [{"role": "user", "content": "Say hello."}], max_tokens=64)
    assert out["lc_text"] == out["lc_streamed"] == chat.message.content, out
    assert out["lc_tool_args"] and set(out["lc_tool_args"][0]) == {"city"}, out
    assert set(out["lc_structured"]) == {"name", "country"} and out["lc_structured"]["name"], out


# ---------------------------------------------------------------------------------------------
# Last: a restart keeps the store (and the new server splits reasoning off)


def test_store_survives_a_restart(server, client, store_file, tmp_path_factory):
    first = client.responses.create(model="default", input="Name a fruit.", temperature=0,
                                    max_output_tokens=20)
    items = client.responses.input_items.list(first.id).model_dump()
    server.stop_cleanly()
    assert json.loads(store_file.read_text())["records"]
    again = LiveServer("--max-total-tokens", "8192", "--responses-store-file", str(store_file),
                       "--reasoning-parser", "deepseek-r1",
                       log_dir=tmp_path_factory.mktemp("responses-restart"))
    try:
        c = openai.OpenAI(base_url=again.url + "/v1", api_key="unused", max_retries=0,
                          timeout=600)
        assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
        assert c.responses.input_items.list(first.id).model_dump() == items
        # deepseek-r1 reasons from the first token: this model's whole reply is the block
        kw: dict[str, Any] = {"model": "default", "temperature": 0, "max_output_tokens": 12}
        nxt = c.responses.create(previous_response_id=first.id, input="Another.", **kw)
        reasoning, message = nxt.output
        assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
        chat = chat_reply(c, [{"role": "user", "content": "Name a fruit."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "Another."}], max_tokens=12)
        assert reasoning.content[0].text == chat.message.reasoning_content
        assert message.type == "message" and nxt.output_text == ""
        assert nxt.status == "incomplete" and message.status == "incomplete"
        assert 0 < nxt.usage.output_tokens_details.reasoning_tokens <= 14
        with c.responses.stream(previous_response_id=first.id, input="Another.", **kw) as stream:
            events = list(stream)
        assert [i.model_dump(exclude={"id"}) for i in events[-1].response.output] == \
            [i.model_dump(exclude={"id"}) for i in nxt.output]
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == reasoning.content[0].text
    finally:
        again.stop_cleanly()
