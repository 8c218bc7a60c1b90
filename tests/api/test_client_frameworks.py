"""What client frameworks send, served as SGLang serves it: pydantic-made JSON schemas (no
`additionalProperties`) close their objects, as SGLang's default grammar backend (xgrammar,
strict mode) reads them, so instructor and LangChain get exactly the declared keys and a reply
that finishes with "stop" instead of keys invented until max_tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from lockstep.constrained.backend import GrammarBackend
from lockstep.constrained.constraint import json_schema_constraint
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiny_models import EOS_ID, TOKENIZER_VOCAB_SIZE, tiny_tokenizer_dir

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


# ---------------------------------------------------------------------------------------------
# The grammar: which texts a schema admits


@pytest.fixture(scope="module")
def admits():
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    backend = GrammarBackend(tokenizer, TOKENIZER_VOCAB_SIZE, [EOS_ID])

    def check(schema: dict[str, Any], text: str) -> bool:
        m = backend.matcher(json_schema_constraint(schema))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(m.accept(i) for i in ids) and m.accept(EOS_ID)

    return check


def test_object_without_additional_properties_is_closed(admits):
    assert admits(WEATHER, '{"city": "Paris"}')
    assert not admits(WEATHER, '{"city": "Paris", "unit": "c"}')
    nested = {"type": "object", "properties": {"where": WEATHER}, "$defs": {"P": WEATHER}}
    assert not admits(nested, '{"where": {"city": "Paris", "unit": "c"}}')
    pydantic_made = Person.model_json_schema()
    assert "additionalProperties" not in pydantic_made
    assert admits(pydantic_made, '{"name": "Ann", "age": 31}')
    assert not admits(pydantic_made, '{"name": "Ann", "age": 31, "city": "Rome"}')


def test_schema_that_allows_extras_keeps_them(admits):
    assert admits({**WEATHER, "additionalProperties": True}, '{"city": "Paris", "unit": "c"}')
    assert admits({**WEATHER, "additionalProperties": {"type": "string"}},
                  '{"city": "Paris", "unit": "c"}')
    assert not admits({**WEATHER, "additionalProperties": {"type": "string"}},
                      '{"city": "Paris", "unit": 1}')
    # unevaluatedProperties (which llguidance does not implement) reads as additionalProperties
    assert admits({**WEATHER, "unevaluatedProperties": True}, '{"city": "Paris", "unit": "c"}')
    # the bare {"type": "object"} (response_format json_object) is any object
    assert admits({"type": "object", "description": "anything"}, '{"a": [1, {"b": null}]}')


def test_tuple_without_items_is_closed(admits):
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert admits(pair, '[1, "a"]')
    assert not admits(pair, '[1, "a", 2]')


# ---------------------------------------------------------------------------------------------
# A live server on Gemma 3 270M (named, not the default)


@pytest.fixture(scope="module")
def client(real_server: LiveServer):
    import openai

    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


COPY_PROMPT = ('A person as JSON: {"name": "Ann", "age": 31, "city": "Rome", "job": "cook"}\n'
               'Another person as JSON, in the same form:')


@pytest.mark.real_model
def test_pydantic_schema_gets_exactly_its_keys(client):
    """The prompt shows extra keys to copy; the schema without additionalProperties keeps them
    out, and the object ends where its keys do."""
    out = client.completions.create(
        model="default", prompt=COPY_PROMPT, temperature=0, max_tokens=60,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": Person.model_json_schema()}}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert set(json.loads(choice.text)) == {"name", "age"}, choice.text


@pytest.mark.real_model
def test_additional_properties_true_still_allows_extras(client):
    schema = {**Person.model_json_schema(), "additionalProperties": True}
    out = client.completions.create(
        model="default", prompt=COPY_PROMPT, temperature=0, max_tokens=60,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": schema}}})
    text = out.choices[0].text
    assert text.startswith('{"name": '), text
    assert '"city"' in text, text  # the copied key the closed schema refuses


@pytest.mark.real_model
def test_json_schema_format_without_schema_is_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "schema is required" in str(err.value)


# ---------------------------------------------------------------------------------------------
# instructor and LangChain, unchanged, from a venv of their own

FRAMEWORKS = ["instructor==1.17.0", "langchain-openai==1.7.4"]

FRAMEWORK_PROGRAM = r'''
import json, sys
import instructor, openai
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)

@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"

base = sys.argv[1] + "/v1"
ask = [{"role": "user", "content": "Name a city in Italy."}]
out = {}
for mode in ("JSON_SCHEMA", "TOOLS"):
    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key="none"),
                                    mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(model="default", response_model=City, messages=ask,
                                          max_tokens=64, temperature=0, max_retries=1)
    out[mode] = city.model_dump()
llm = ChatOpenAI(base_url=base, api_key="none", model="default", temperature=0, max_tokens=64)
msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
out["bind_tools"] = [c["args"] for c in msg.tool_calls]
out["structured"] = llm.with_structured_output(City).invoke("Name a city in Italy.").model_dump()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def frameworks_python(tmp_path_factory: pytest.TempPathFactory):
    from lockstep.testing.client_venv import PackageIndexUnreachable, client_venv

    try:
        return client_venv(tmp_path_factory.getbasetemp().parent, FRAMEWORKS)
    except PackageIndexUnreachable as e:
        pytest.skip(str(e))


@pytest.mark.real_model
def test_instructor_and_langchain_get_validated_objects(real_server, frameworks_python, tmp_path):
    from lockstep.testing.client_venv import run_client

    # instructor raises IncompleteOutputException on a reply cut off by max_tokens
    out = run_client(frameworks_python, FRAMEWORK_PROGRAM, real_server.url, tmp_path)
    for key in ("JSON_SCHEMA", "TOOLS", "structured"):
        assert set(out[key]) == {"name", "country"} and out[key]["name"], out
    [args] = out["bind_tools"]
    assert set(args) == {"city"}, out  # exactly the declared argument
