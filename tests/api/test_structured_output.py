"""Structured output on Gemma 3 270M (named; a base model: the constraint, not
the model, must produce the shape): regex, json_schema and ebnf sampling params, stop_regex,
bad constraints, and constrained requests next to unconstrained ones.

The live-server tests share the session's real-model server (tests/conftest.py); the
scheduler tests drive the scheduler in process for overlap, retraction and chunked prefill."""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests

from lockstep.constrained.constraint import Constraint
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import GEMMA, LiveServer, sse_events

pytestmark = pytest.mark.real_model

DATE = r"\d{4}-\d{2}-\d{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "color", "age"],
    "additionalProperties": False,
}
EBNF = 'root ::= "Answer: " digit+ ("+" digit+)* "."\ndigit ::= [0-9]'
EBNF_SHAPE = r"Answer: \d+(\+\d+)*\."


def generate(server: LiveServer, text: str, **params: Any) -> dict[str, Any]:
    r = requests.post(server.url + "/generate", json={"text": text, "sampling_params": params},
                      timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def check_person(text: str) -> dict[str, Any]:
    obj = json.loads(text)
    assert set(obj) == {"name", "color", "age"}
    assert isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 12
    assert obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    return obj


# ---------------------------------------------------------------------------------------------
# Shapes, greedy and sampled


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_date_regex(real_server, temperature):
    for seed in range(3 if temperature else 1):
        out = generate(real_server, "The treaty was signed on", regex=DATE, max_new_tokens=20,
                       temperature=temperature, seed=seed)
        assert re.fullmatch(DATE, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_yes_no_regex(real_server):
    for temperature in (0.0, 1.2):
        out = generate(real_server, "Is water wet? Answer yes or no:", regex="(yes|no)",
                       max_new_tokens=5, temperature=temperature, seed=7)
        assert out["text"] in ("yes", "no")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema(real_server, temperature):
    out = generate(real_server, "Here is a person as JSON:", json_schema=json.dumps(SCHEMA),
                   max_new_tokens=64, temperature=temperature, seed=3)
    check_person(out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_ebnf(real_server):
    for temperature in (0.0, 1.0):
        out = generate(real_server, "Sum:", ebnf=EBNF, max_new_tokens=30, temperature=temperature,
                       seed=11)
        assert re.fullmatch(EBNF_SHAPE, out["text"]) or out["meta_info"]["finish_reason"] == {
            "type": "length", "length": 30}, out


def test_constraint_with_penalties_and_filters(real_server):
    out = generate(real_server, "A date:", regex=DATE, max_new_tokens=20, temperature=0.8, top_k=20,
                   top_p=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5, seed=5)
    assert re.fullmatch(DATE, out["text"]), out["text"]


def test_n_samples(real_server):
    r = requests.post(real_server.url + "/generate", json={
        "text": "Someone's birthday:",
        "sampling_params": {"regex": DATE, "max_new_tokens": 20, "temperature": 1.0, "n": 3,
                            "seed": 1}}, timeout=600)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 3
    for o in outs:
        assert re.fullmatch(DATE, o["text"]), o["text"]


def test_streaming(real_server):
    body = {"text": "Here is a person as JSON:", "stream": True,
            "sampling_params": {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 64,
                                "temperature": 0}}
    with requests.post(real_server.url + "/generate", json=body, stream=True, timeout=600) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert len(events) > 2
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"
    check_person(final["text"])
    plain = generate(real_server, "Here is a person as JSON:", json_schema=json.dumps(SCHEMA),
                     max_new_tokens=64, temperature=0)
    assert final["text"] == plain["text"]


def test_grammar_that_cannot_finish_ends_with_length(real_server):
    out = generate(real_server, "Count:", regex="[0-9]{50}", max_new_tokens=8, temperature=0)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert re.fullmatch("[0-9]+", out["text"]), out["text"]


# ---------------------------------------------------------------------------------------------
# Constrained next to unconstrained


def test_mixed_batch_leaves_unconstrained_bitwise_equal(real_server):
    free_prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    alone = [generate(real_server, p, max_new_tokens=16, temperature=0)["output_ids"]
             for p in free_prompts]
    constrained = [
        ("A date:", {"regex": DATE}), ("Is it raining? ", {"regex": "(yes|no)"}),
        ("Person:", {"json_schema": json.dumps(SCHEMA)}), ("Sum:", {"ebnf": EBNF}),
        ("Another date:", {"regex": DATE, "temperature": 1.0, "seed": 2}),
        ("JSON:", {"json_schema": json.dumps(SCHEMA), "temperature": 0.7, "seed": 4}),
        ("Yes or no?", {"regex": "(yes|no)", "temperature": 1.0, "seed": 9}),
        ("When?", {"regex": DATE, "temperature": 0}),
    ]
    jobs = [(p, {"max_new_tokens": 16, "temperature": 0}) for p in free_prompts]
    jobs += [(p, {"max_new_tokens": 64, "temperature": 0, **c}) for p, c in constrained]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: generate(real_server, j[0], **j[1]), jobs))
    assert [o["output_ids"] for o in outs[:3]] == alone
    for (_, c), o in zip(constrained, outs[3:]):
        if "regex" in c and c["regex"] == DATE:
            assert re.fullmatch(DATE, o["text"]), o["text"]
        elif "regex" in c:
            assert o["text"] in ("yes", "no")
        elif "json_schema" in c:
            check_person(o["text"])
        else:
            assert re.fullmatch(EBNF_SHAPE, o["text"]) or o["meta_info"]["finish_reason"][
                "type"] == "length"


# ---------------------------------------------------------------------------------------------
# stop_regex


def test_stop_regex_trims_or_keeps(real_server):
    prompt = "List of years: 1999, 2000, 2001,"
    full = generate(real_server, prompt, max_new_tokens=24, temperature=0)["text"]
    m = re.search(r"20\d\d", full)
    assert m, f"the model's own continuation has no year to stop at: {full!r}"
    cut = generate(real_server, prompt, max_new_tokens=24, temperature=0, stop_regex=r"20\d\d")
    assert cut["text"] == full[:m.start()]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"20\d\d"}
    kept = generate(real_server, prompt, max_new_tokens=24, temperature=0, stop_regex=[r"20\d\d", "zzz"],
                    no_stop_trim=True)
    assert kept["text"] == full[:m.end()]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"20\d\d"}


# ---------------------------------------------------------------------------------------------
# Bad input


BIG_SCHEMA = {"type": "object", "required": ["n"], "properties": {
    **{f"field_{i}": {"type": "string", "pattern": r"^[a-z]{3,20}@[a-z]+\.(com|org)$",
                      "maxLength": 40} for i in range(30)},
    "n": {"type": "integer", "minimum": 3, "maximum": 99999},
    "e": {"enum": [f"v{i}" for i in range(300)]}, "d": {"type": "string", "format": "date-time"}}}


def test_grammar_limits_admit_real_constraints_and_refuse_unbounded_ones():
    """The front's check (compile, limits, the first bytes of output) in process: what a real
    client sends passes; what would stall a rank or yield no output is a ConstraintError."""
    from lockstep.constrained.constraint import (
        ConstraintError,
        json_schema_constraint,
        validate_constraint,
    )

    for c in (json_schema_constraint(BIG_SCHEMA), json_schema_constraint(SCHEMA),
              Constraint("regex", r"[a-z0-9._%+-]{1,64}@[a-z0-9.-]{1,255}\.[a-z]{2,10}"),
              Constraint("regex", DATE), Constraint("regex", "a{5000}"), Constraint("ebnf", EBNF),
              Constraint("regex", "[0-9]{50}"), Constraint("regex", "a*"),
              # Recursion that may stop (the key is optional): {} is an output.
              json_schema_constraint({"type": "object", "properties": {"a": {"$ref": "#"}}})):
        validate_constraint(c)
    for c, why in ((Constraint("regex", "a{1000000}"), "limits"),
                   (Constraint("json_schema", '{"$ref": "#"}'), "no output"),
                   # Recursion under a required key: every output is infinite too.
                   (json_schema_constraint({"type": "object", "properties": {"a": {"$ref": "#"}},
                                            "required": ["a"]}), "limits"),
                   (Constraint("json_schema", '{"items": ' * 70 + "{}" + "}" * 70), "deep"),
                   (Constraint("ebnf", 'root ::= x\nx ::= "a" x'), "limits"),
                   (Constraint("regex", "a" * 300_000), "characters")):
        with pytest.raises(ConstraintError, match=why):
            validate_constraint(c)


@pytest.mark.parametrize("params,words", [
    ({"regex": "([0-9]"}, ["regex"]),
    ({"json_schema": "{not json"}, ["json_schema", "JSON"]),
    ({"json_schema": json.dumps({"type": "objekt"})}, ["json_schema", "objekt"]),
    ({"ebnf": "root ::= missing_rule"}, ["ebnf", "missing_rule"]),
    ({"regex": "a", "json_schema": "{}"}, ["Only one of regex, json_schema, or ebnf can be set."]),
    ({"stop_regex": "(unclosed"}, ["stop_regex"]),
    ({"custom_params": {"k": 1}}, ["custom_params", "not supported"]),
    ({"structural_tag": "{}"}, ["structural_tag", "not supported"]),
])
def test_bad_constraints_are_400(real_server, params, words):
    for stream in (False, True):
        r = requests.post(real_server.url + "/generate", json={
            "text": "Hi", "stream": stream, "sampling_params": {"max_new_tokens": 4, **params}},
            timeout=120)
        assert r.status_code == 400, r.text
        for w in words:
            assert w in r.text, r.text
    assert generate(real_server, "Hi", max_new_tokens=2, regex="(ok)")["text"] == "ok"


def test_sampling_seed_is_seed(real_server):
    a = generate(real_server, "Hello", max_new_tokens=8, temperature=1.0, sampling_seed=42)
    b = generate(real_server, "Hello", max_new_tokens=8, temperature=1.0, seed=42)
    assert a["output_ids"] == b["output_ids"]


# ---------------------------------------------------------------------------------------------
# The scheduler in process: overlap, retraction, chunked prefill, radix cache


def _constrained_reqs(tok) -> list:
    schema = json.dumps(SCHEMA)
    mk = lambda rid, text, c, **kw: greedy_req(rid, tok.encode(text), 48, constraint=c,  # noqa: E731
                                               ignore_eos=False, **kw)
    return [
        mk("date", "The treaty was signed on", Constraint("regex", DATE)),
        mk("json", "A person as JSON: " * 6, Constraint("json_schema", schema)),
        mk("ebnf", "Sum:", Constraint("ebnf", EBNF)),
        mk("json-sampled", "A person as JSON:", Constraint("json_schema", schema),
           temperature=0.8, seed=5),
        greedy_req("free", tok.encode("Once upon a time"), 24),
    ]


def test_scheduler_modes_agree(tmp_path):
    from lockstep.testing.inproc import packaged_tokenizer

    tok = packaged_tokenizer(GEMMA)
    runs = {}
    for name, kw in {
        "plain": {"disable_radix_cache": True},
        "overlap": {"enable_overlap_schedule": True},
        # A KV pool this small forces retractions.
        "retract": {"max_total_tokens": 100, "new_token_ratio": 0.05},
        "chunked": {"chunked_prefill_size": 8},  # splits every prompt
    }.items():
        # 4096 tokens hold these requests many times over; the size follows from free memory
        # otherwise, and zeroing gigabytes of KV pool took seconds per scheduler.
        sched = make_scheduler(GEMMA, **{"max_total_tokens": 4096, **kw})
        runs[name] = run_to_completion(sched, _constrained_reqs(tok))
        if name == "retract":
            assert sched.stats.retractions > 0
        if name == "overlap":
            # The same requests again: now the prompts come from the radix cache.
            again = run_to_completion(sched, [
                greedy_req(f"{r.rid}-2", r.input_ids, r.sampling_params.max_new_tokens,
                           constraint=r.sampling_params.constraint,
                           temperature=r.sampling_params.temperature, seed=r.sampling_params.seed,
                           ignore_eos=r.sampling_params.ignore_eos)
                for r in _constrained_reqs(tok)])
            assert all(again[f"{rid}-2"].output_ids == res.output_ids
                       for rid, res in runs[name].items())
            assert sched.stats.cached_tokens > 0
    texts = {rid: tok.decode(r.output_ids) for rid, r in runs["plain"].items()}
    assert re.fullmatch(DATE, texts["date"]), texts
    check_person(texts["json"])
    check_person(texts["json-sampled"])
    for name, res in runs.items():
        assert {rid: r.output_ids for rid, r in res.items()} == {
            rid: r.output_ids for rid, r in runs["plain"].items()}, name


# ---------------------------------------------------------------------------------------------
# OpenAI routes


@pytest.fixture(scope="module")
def client(real_server: LiveServer):
    import openai

    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_chat_response_format_json_schema(client):
    out = client.chat.completions.create(
        model="default", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    check_person(out.choices[0].message.content)


def test_chat_parse_with_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=50)

    reply = client.chat.completions.parse(
        model="default", temperature=0, max_tokens=80, response_format=City,
        messages=[{"role": "user", "content": "Name a big city in France."}])
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country


def test_completions_response_format_and_extensions(client):
    # The openai client's completions.create has no response_format argument: it goes in the body.
    obj = client.completions.create(model="default", prompt="A JSON object:", max_tokens=40,
                                    temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:  # any JSON object may go on: what was generated is still a JSON object's start
        assert obj.choices[0].text.startswith("{")
    date = client.completions.create(model="default", prompt="The date:", max_tokens=20,
                                     temperature=0, extra_body={"regex": DATE})
    assert re.fullmatch(DATE, date.choices[0].text)
    chat = client.chat.completions.create(
        model="default", max_tokens=30, temperature=0.8, seed=1, extra_body={"ebnf": EBNF},
        messages=[{"role": "user", "content": "Add some numbers."}])
    text = chat.choices[0].message.content
    assert re.fullmatch(EBNF_SHAPE, text) or chat.choices[0].finish_reason == "length", text
    stopped = client.completions.create(model="default", prompt="List of years: 1999, 2000,",
                                        max_tokens=24, temperature=0,
                                        extra_body={"stop_regex": r"20\d\d"})
    assert not re.search(r"20\d\d", stopped.choices[0].text)


def test_openai_bad_constraints(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="Only one of regex, response_format, or ebnf"):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_object"}, extra_body={"regex": "a+"})
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model="default", prompt="x", max_tokens=4,
                                  extra_body={"regex": "(a"})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "structural_tag"})


def test_model_names(client, real_server):
    import openai

    served = client.models.list().data[0].id
    for name in ("default", served):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert out.model == served
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1)


# ---------------------------------------------------------------------------------------------
# Every example in the README runs (the server-launch command lines aside)

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:30000"


def readme_examples() -> list[tuple[str, str]]:
    blocks = re.findall(r"```(bash|python)\n(.*?)```", README.read_text(), flags=re.S)
    runnable = [(lang, code) for lang, code in blocks
                if lang == "python" or code.lstrip().startswith("curl ")]
    assert len(runnable) >= 4, runnable
    return runnable


def json_documents(text: str) -> list[dict]:
    """The JSON documents one after another in `text` (a block of several curls prints several)."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        doc, end = decoder.raw_decode(text, at)
        docs.append(doc)
        at = end + len(text[end:]) - len(text[end:].lstrip())
    return docs


def check_readme_answer(out: dict, code: str) -> None:
    """What each route the README calls must answer."""
    if "tokens" in out:                                # /tokenize
        assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] > 0, out
    elif "choices" in out:                             # /v1/chat/completions
        assert out["choices"][0]["finish_reason"] in {"stop", "length"}, out
    elif "meta_info" in out:                           # /generate
        assert out["text"] and out["meta_info"]["finish_reason"], out
        if '"regex"' in code:
            assert re.fullmatch(DATE, out["text"]), out["text"]
    else:                                              # /detokenize
        assert out == {"text": "Hello world"}, out


@pytest.mark.parametrize("index", range(len(readme_examples())))
def test_readme_example_runs(default_server, index, tmp_path):
    import subprocess
    import sys

    lang, code = readme_examples()[index]
    code = code.replace(README_URL, default_server.url)
    if lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code.replace("curl ", "curl -sS --fail-with-body ")]
    else:
        script = tmp_path / "example.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, f"{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    if lang == "bash":
        docs = json_documents(done.stdout)
        assert len(docs) == code.count("curl "), done.stdout
        for out in docs:
            check_readme_answer(out, code)
    elif "print(" in code:
        assert done.stdout.strip(), code


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: every rank advances its own matcher; the lockstep check stays green


def test_tp2_equals_tp1_for_constrained_requests(real_server, tmp_path):
    jobs = [("The treaty was signed on", {"regex": DATE}),
            ("Here is a person as JSON:", {"json_schema": json.dumps(SCHEMA)}),
            ("Sum:", {"ebnf": EBNF}),
            ("A person:", {"json_schema": json.dumps(SCHEMA), "temperature": 0.8, "seed": 3}),
            ("Once upon a time", {})]
    jobs = [(p, {"max_new_tokens": 48, "temperature": 0, **c}) for p, c in jobs]
    tp1 = [generate(real_server, p, **c) for p, c in jobs]
    tp2 = LiveServer("--model-path", GEMMA, "--tp-size", "2", "--max-total-tokens", "8192", "--enable-lockstep-check", "1",
                     log_dir=tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(lambda j: generate(tp2, j[0], **j[1]), jobs))
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in tp1]
        assert [o["meta_info"]["finish_reason"] for o in outs] == [
            o["meta_info"]["finish_reason"] for o in tp1]
        # The ranks compared their schedule fingerprints every step (--enable-lockstep-check 1).
        assert tp2.alive() and "lockstep check failed" not in tp2.log_text()
    finally:
        tp2.stop()
