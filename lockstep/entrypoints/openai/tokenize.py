"""SGLang's /tokenize and /detokenize (also under /v1/), with SGLang 0.5's request and reply
shapes: a prompt's token ids by the server's own tokenizer, or chat messages' ids exactly as a
chat completion would hand them to the model; and token ids back to text."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from lockstep.entrypoints.generate_request import IdsInput, StrictModel, TextInput
from lockstep.entrypoints.openai.protocol import ChatCompletionRequest
from lockstep.entrypoints.openai.serving import OpenAIServing

# SGLang's chat fields of a tokenize request: validated as a chat completion's, so that a value
# the chat route refuses gets the same 400 here rather than being dropped.
_CHAT_FIELDS = frozenset({"messages", "tools", "tool_choice", "reasoning_effort",
                          "continue_final_message", "chat_template_kwargs"})


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: TextInput | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning_effort: Any = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    # With messages: handed to the chat template (a chat completion's prompt ends with it).
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        chat_only = self.model_fields_set & (_CHAT_FIELDS | {"add_generation_prompt"})
        if self.prompt is not None and chat_only:
            raise ValueError(f"{min(chat_only)}: applies only with messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: IdsInput
    skip_special_tokens: bool = True


async def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    tm = serving.tm
    if req.messages is not None:
        chat = ChatCompletionRequest.model_validate(
            req.model_dump(include=_CHAT_FIELDS, exclude_defaults=True))
        ids, _ = await serving.render_chat_prompt(
            chat, serving.tool_plan(chat),
            add_generation_prompt=req.add_generation_prompt is not False,
            # the template writes the special tokens itself: added again only when asked for
            add_special_tokens="add_special_tokens" in req.model_fields_set
            and req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": tm.context_len}
    one = isinstance(req.prompt, str)
    lists = [await tm.tokenize_text(p, req.add_special_tokens)
             for p in ([req.prompt] if one else req.prompt or [])]
    tokens, count = (lists[0], len(lists[0])) if one else (lists, [len(t) for t in lists])
    return {"tokens": tokens, "count": count, "max_model_len": tm.context_len}


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    tm = serving.tm
    many = bool(req.tokens) and isinstance(req.tokens[0], list)
    lists: list[list[int]] = req.tokens if many else [req.tokens]  # type: ignore[assignment,list-item]
    texts = [tm.tokenizer.decode(tm.check_ids(ids, f"tokens[{i}]" if many else "tokens"),
                                 skip_special_tokens=req.skip_special_tokens)
             for i, ids in enumerate(lists)]
    return {"text": texts if many else texts[0]}
