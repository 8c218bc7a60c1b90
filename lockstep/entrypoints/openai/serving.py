"""OpenAI's API over the tokenizer manager: /v1/completions and /v1/chat/completions requests
become single generate requests (run by a Fanout), and their outputs OpenAI's response and
stream-chunk shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lockstep.core import TokenLogprob
from lockstep.entrypoints.fanout import Fanout, run_to_completion, start_stream
from lockstep.entrypoints.generate_request import fan_out, with_lora
from lockstep.entrypoints.openai.chat_templates import (
    ChatTemplateError,
    render_chat,
    renderer_arguments,
    resolve_chat_template,
    wants_content_parts,
)
from lockstep.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from lockstep.entrypoints.openai.reasoning_parser import ReasoningParser, reasoning_format
from lockstep.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    ToolRequestError,
    complete_reply,
    finish_reason,
    plan_tools,
    template_message,
)
from lockstep.entrypoints.tokenizer_manager import GenerateOutput, RequestError, TokenizerManager
from lockstep.function_call.registry import default_parser_name
from lockstep.messages import TokenizedGenerateReq
from lockstep.server_args import ServerArgs
from lockstep.utils.asgi import SSEResponse
from lockstep.utils.http import SSE_DONE, json_response, sse


def finish_of(item: GenerateOutput) -> tuple[str | None, int | str | None]:
    """OpenAI's finish_reason and SGLang's matched_stop."""
    reason = item.finish_reason
    return (reason.type, getattr(reason, "matched", None)) if reason is not None else (None, None)


Entries = list[TokenLogprob]
Tops = list[list[TokenLogprob] | None]


class _LogprobCursor:
    """What part of a request's cumulative logprobs a stream has already sent (and, for a
    completion's logprobs, the text offset they reached)."""

    def __init__(self) -> None:
        self.prompt_sent = False
        self.out_sent = 0
        self.text_offset = 0

    def take(self, item: GenerateOutput, with_prompt: bool) -> tuple[Entries, Tops]:
        entries: Entries = []
        tops: Tops = []
        if with_prompt and not self.prompt_sent:
            ins = item.input_token_logprobs or []
            entries += ins
            tops += item.input_top_logprobs or [None] * len(ins)
        self.prompt_sent = True
        outs = item.output_token_logprobs or []
        out_tops = item.output_top_logprobs or [None] * len(outs)
        entries += outs[self.out_sent:]
        tops += out_tops[self.out_sent:]
        self.out_sent = len(outs)
        return entries, tops


def completion_logprobs(entries: Entries, tops: Tops, top_n: int, offset: int = 0
                        ) -> CompletionLogprobs:
    pairs = list(zip(entries, tops))
    texts = [entry.text or "" for entry, _ in pairs]
    return CompletionLogprobs(
        tokens=texts, token_logprobs=[entry.logprob for entry, _ in pairs],
        top_logprobs=[{t.text or "": t.logprob for t in top} if top_n and top else None
                      for _, top in pairs],
        text_offset=list(accumulate(map(len, texts), initial=offset))[:-1])


def _chat_token(t: TokenLogprob) -> dict[str, Any]:
    text = t.text or ""
    return {"token": text, "logprob": t.logprob, "bytes": list(text.encode(errors="replace"))}


def chat_logprobs(entries: Entries, tops: Tops) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(content=[ChatTokenLogprob(
        **_chat_token(e), top_logprobs=[TopLogprob(**_chat_token(t)) for t in top or []])
        for e, top in zip(entries, tops)])


@dataclass(frozen=True)
class ChatRun:
    """A chat completion's generate requests, and how their outputs become choices: `whole`
    for a final output, `step` for a stream's (the delta choices it adds)."""

    singles: list[TokenizedGenerateReq]
    whole: Callable[[int, GenerateOutput], ChatCompletionChoice]
    step: Callable[[int, GenerateOutput], Iterator[ChatCompletionStreamChoice]]


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, args: ServerArgs, info: dict[str, Any]) -> None:
        self.tm = tm
        self.args = args
        self.info = info
        self.model_name: str = info["served_model_name"]
        # "default" as SGLang's docs and this README write it: SGLang checks no model name.
        paths = (args.model_path, Path(args.model_path).name) if args.model_path else ()
        self.accepted_names = {self.model_name, "default", *paths}
        model_type = str(info.get("model_type") or "")
        architectures = list(info.get("architectures") or [])
        own = info.get("chat_template") or getattr(tm.tokenizer, "chat_template", None)
        self.chat_template = resolve_chat_template(
            args.chat_template, own if isinstance(own, str) else None, model_type, architectures)
        # A template that reads content only as typed parts (SmolVLM's) gets them: as text, the
        # messages would render empty.
        self.content_parts = (self.chat_template is not None
                              and wants_content_parts(tm.tokenizer, self.chat_template))
        self.tool_call_parser = (args.tool_call_parser
                                 or default_parser_name(model_type, architectures))
        self.reasoning = reasoning_format(args.reasoning_parser) if args.reasoning_parser else None

    def check_model(self, name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request's `model` names (SGLang's "base:adapter", vLLM's adapter
        name) or its lora_path does; None: the base model. A 404 for any other name."""
        base, _, adapter = (name or "").partition(":")
        if name is None or name in self.accepted_names:
            return lora_path
        if adapter and base in self.accepted_names or name in self.tm.lora_adapters:
            if lora_path is not None and lora_path != (adapter or name):
                raise RequestError(f"model {name!r} and lora_path {lora_path!r} name different adapters")
            return adapter or name
        raise RequestError(
            f"The model `{name}` does not exist; this server serves `{self.model_name}`"
            + (f" and the LoRA adapters {', '.join(sorted(self.tm.lora_adapters))}"
               if self.tm.lora_adapters else ""), 404)

    def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.model_name, root=self.args.model_path or self.model_name,
                         max_model_len=self.tm.context_len)
        adapters = [ModelCard(id=name, root=path, parent=self.model_name, max_model_len=self.tm.context_len)
                    for name, path in sorted(self.tm.lora_adapters.items())]
        return ModelList(data=[card, *adapters]).model_dump()

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        try:
            return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                              self.tool_call_parser)
        except ToolRequestError as e:
            raise RequestError(str(e)) from None

    async def render_chat_prompt(self, req: ChatCompletionRequest, plan: ToolPlan | None = None,
                                 *, add_generation_prompt: bool = True,
                                 add_special_tokens: bool = False) -> tuple[list[int], str]:
        """The chat template's prompt, tokenized, and its text (/tokenize with messages may
        override the two flags a chat completion leaves at their defaults)."""
        if self.chat_template is None:
            raise RequestError(
                "this model has no chat template and none is built in for its architecture; "
                "start the server with --chat-template NAME|FILE or use /v1/completions")
        tok = self.tm.tokenizer
        kwargs = req.chat_template_kwargs or {}
        if clash := sorted(renderer_arguments(tok) & set(kwargs)):
            raise RequestError(f"chat_template_kwargs: {', '.join(clash)} cannot be set here "
                               "(an argument of the template renderer, not a template variable)")
        try:
            images = self.tm.image_inputs
            if req.image_urls() and images is None:
                raise RequestError(f"messages: image_url parts: the model {self.args.model_path!r} "
                                   "takes no images")
            placeholder = images.placeholder if images is not None else ""
            messages = [template_message(i, m) for i, m in
                        enumerate(req.messages_as_dicts(placeholder, self.content_parts))]
            prompt = render_chat(tok, self.chat_template, messages, extra_context=kwargs,
                                 add_generation_prompt=add_generation_prompt,
                                 tools=list(plan.tools) if plan is not None else None)
        except ToolRequestError as e:
            raise RequestError(str(e)) from None
        except ChatTemplateError as e:
            raise RequestError(f"messages: {e}") from e
        text = images.expand_text(prompt) if images is not None and req.image_urls() else prompt
        return await self.tm.tokenize_text(text, add_special_tokens=add_special_tokens), prompt

    def reasoning_parsers(self, req: ChatCompletionRequest, prompt: str, json_output: bool,
                          n: int) -> list[ReasoningParser | None]:
        """One per choice; None where the reply is not split. Under a JSON constraint (a forced
        call, response_format) no block can open the reply, which would be taken for reasoning."""
        fmt = self.reasoning
        if fmt is None or not req.separate_reasoning:
            return [None] * n
        inside = not json_output and fmt.starts_inside(req.chat_template_kwargs, prompt)
        return [ReasoningParser(fmt, inside, req.stream_reasoning) for _ in range(n)]

    async def completions(self, req: CompletionRequest, request: Request | None) -> Response:
        lora = self.check_model(req.model, req.lora_path)
        prompts = req.prompts()
        singles = fan_out(
            prompts, [req.to_sampling_params()] * len(prompts), limit=self.args.max_batch_size,
            stream=req.stream, return_logprob=req.logprobs is not None,
            logprob_start_len=0 if (req.logprobs is not None and req.echo) else -1,
            top_logprobs_num=req.logprobs or 0, return_text_in_logprobs=True,
            **req.scheduling())
        with_lora(singles, [lora] * len(prompts))
        echoed = ([t if t is not None else self.tm.tokenizer.decode(ids) for t, ids in prompts]
                  if req.echo else None)
        cursors = [_LogprobCursor() for _ in singles]

        def choice(index: int, item: GenerateOutput, text: str, cursor: _LogprobCursor
                   ) -> CompletionChoice:
            """A whole reply or a stream's delta: the prompt first with echo, and the logprobs
            `cursor` has not sent yet."""
            if echoed is not None and not cursor.prompt_sent:
                text = echoed[singles[index].prompt_index] + text
            lp = None
            if req.logprobs is not None:
                entries, tops = cursor.take(item, with_prompt=req.echo)
                lp = completion_logprobs(entries, tops, req.logprobs, cursor.text_offset)
                cursor.text_offset += sum(len(t) for t in lp.tokens)
            cursor.prompt_sent = True
            finish, matched = finish_of(item)
            return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish,
                                    matched_stop=matched)

        def step(index: int, item: GenerateOutput) -> Iterator[CompletionChoice]:
            c = choice(index, item, item.text_delta, cursors[index])
            if c.text or c.finish_reason is not None or (c.logprobs and c.logprobs.tokens):
                yield c

        return await self._respond(
            req, request, singles, "cmpl", CompletionResponse, CompletionStreamResponse,
            lambda index, item: choice(index, item, item.text, _LogprobCursor()), step)

    async def chat(self, req: ChatCompletionRequest, request: Request | None) -> Response:
        run = await self.prepare_chat(req)
        return await self._respond(req, request, run.singles, "chatcmpl", ChatCompletionResponse,
                                   ChatCompletionStreamResponse, run.whole, run.step)

    async def prepare_chat(self, req: ChatCompletionRequest) -> ChatRun:
        """A chat completion ready to run: the one path every chat-shaped API (this route,
        /v1/responses) takes from messages to choices."""
        lora = self.check_model(req.model, req.lora_path)
        plan = self.tool_plan(req)
        ids, prompt = await self.render_chat_prompt(req, plan)
        forced = plan.json_schema() if plan is not None else None  # "required" or named
        params = req.to_sampling_params(forced)
        singles = fan_out(
            [(None, ids)], [params], limit=self.args.max_batch_size,
            image_data=[req.image_urls() or None], stream=req.stream, return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0, return_text_in_logprobs=True,
            **req.scheduling())
        with_lora(singles, [lora])
        thinking = self.reasoning_parsers(req, prompt, params.json_schema is not None,
                                          len(singles))

        def whole(index: int, item: GenerateOutput) -> ChatCompletionChoice:
            lp = chat_logprobs(*_LogprobCursor().take(item, False)) if req.logprobs else None
            finish, matched = finish_of(item)
            think = thinking[index]
            reasoning, text = think.parse(item.text) if think is not None else (None, item.text)
            content, calls, finish = complete_reply(plan, text, finish)
            return ChatCompletionChoice(
                index=index, message=ChatResponseMessage(
                    content=content, reasoning_content=reasoning, tool_calls=calls),
                logprobs=lp, finish_reason=finish, matched_stop=matched)

        cursors = [_LogprobCursor() for _ in singles]
        tools = [ToolCallStream(plan) if plan is not None else None for _ in singles]
        started = [False] * len(singles)

        def step(index: int, item: GenerateOutput) -> Iterator[ChatCompletionStreamChoice]:
            piece = partial(ChatCompletionStreamChoice, index=index)
            if not started[index]:
                started[index] = True
                yield piece(delta=DeltaMessage(role="assistant", content=""))
            lp = chat_logprobs(*cursors[index].take(item, False)) if req.logprobs else None
            text, calls = item.text_delta, []
            finish, matched = finish_of(item)
            think = thinking[index]
            if think is not None:  # the parser holds back what may be a marker
                reasoning, text = _feed(think, text, finish is not None)
                if reasoning:
                    yield piece(delta=DeltaMessage(reasoning_content=reasoning))
            stream = tools[index]
            if stream is not None:  # the parser holds back what may be call markup
                text, calls = _feed(stream, text, finish is not None)
                if finish is not None:
                    finish = finish_reason(finish, stream.has_calls)
            if text or (lp and lp.content):
                yield piece(delta=DeltaMessage(content=text), logprobs=lp)
            if calls:
                yield piece(delta=DeltaMessage(tool_calls=calls))
            if finish is not None:
                yield piece(delta=DeltaMessage(), finish_reason=finish, matched_stop=matched)

        return ChatRun(singles, whole, step)

    async def _respond(self, req: CompletionRequest | ChatCompletionRequest,
                       request: Request | None, singles: list[TokenizedGenerateReq], kind: str,
                       response: type[Any], chunk: type[Any],
                       whole: Callable[[int, GenerateOutput], Any],
                       step: Callable[[int, GenerateOutput], Iterable[Any]]) -> Response:
        """Runs the singles: the `response` with `whole(index, final output)` as the choices,
        or a stream of `chunk`s, one per choice that `step(index, output)` gives."""
        rid = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        # a request that named an adapter as its model gets that name back (vLLM answers with the
        # adapter's name, SGLang with the request's model); the base model's requests, its own
        model = req.model if req.model and req.model not in self.accepted_names else self.model_name
        if req.stream:
            fan = await start_stream(self.tm, singles, request)
            return SSEResponse(self._stream(fan, req, singles, step, partial(
                chunk, id=rid, created=created, model=model)))
        finals = await run_to_completion(self.tm, singles, request)
        resp = response(id=rid, created=created, model=model,
                        choices=[whole(index, item) for index, item in enumerate(finals)],
                        usage=usage_of(singles, finals))
        return json_response(resp.model_dump())

    async def _stream(self, fan: Fanout, req: CompletionRequest | ChatCompletionRequest,
                      singles: list[TokenizedGenerateReq],
                      step: Callable[[int, GenerateOutput], Iterable[Any]],
                      chunk: Callable[..., Any]) -> AsyncIterator[bytes]:
        finals: list[GenerateOutput | None] = [None] * len(singles)
        try:
            async for index, item in fan.items():
                finals[index] = item
                for choice in step(index, item):
                    yield sse(_without_null_usage(chunk(choices=[choice])))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(chunk(choices=[], usage=usage_of(singles, finals)))
            yield SSE_DONE
        finally:
            fan.close()


def _feed(parser: ReasoningParser | ToolCallStream, text: str, final: bool) -> tuple[Any, Any]:
    """A stream parser's two outputs for `text`, with what it held back added on the last."""
    first, second = parser.feed(text)
    if final:
        more_first, more_second = parser.finish()
        first, second = first + more_first, second + more_second
    return first, second


def _without_null_usage(chunk: Any) -> dict[str, Any]:
    """A stream chunk as OpenAI sends it: no usage key until the usage chunk, and a chat delta
    holds only the fields it sets."""
    data = chunk.model_dump()
    if data.get("usage") is None:
        data.pop("usage", None)
    for choice in data["choices"]:
        if (delta := choice.get("delta")) is not None:
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
            for call in choice["delta"].get("tool_calls") or []:  # later deltas: no id or name
                for part, key in ((call, "id"), (call, "type"), (call["function"], "name")):
                    if part[key] is None:
                        del part[key]
    return data


def usage_of(singles: Iterable[TokenizedGenerateReq], finals: Iterable[GenerateOutput | None]
             ) -> UsageInfo:
    """Prompt (and cached prompt) tokens once per prompt (not per sample, as OpenAI counts),
    completion tokens of all."""
    prompt = completion = cached = 0
    for s, item in zip(singles, finals):
        if item is None:
            continue
        if s.sample_index == 0:
            prompt += item.prompt_tokens
            cached += item.cached_tokens
        completion += item.completion_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
