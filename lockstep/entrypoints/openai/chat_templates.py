"""Chat templates: which one a model uses (Gemma 3 270M's GGUF has none: built-ins reproduce
each family's official format), rendered by the tokenizer's own `apply_chat_template`."""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox

from lockstep.function_call.registry import LLAMA_NAMES, QWEN_NAMES
from lockstep.model_loader.pooling import RERANKER_TEMPLATE

# One Jinja file per family beside this module, tools included, each saying where its format
# comes from.
BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    path.stem: path.read_text(encoding="utf-8")
    for path in sorted((Path(__file__).parent / "chat_templates_builtin").glob("*.jinja"))
}


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, compiled or rendered for the given messages."""


# By model_type and by architecture (a config may name only one of them).
ARCH_TO_TEMPLATE: dict[str, str] = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text", "GemmaForCausalLM",
                     "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                    "gemma"),
    **dict.fromkeys(LLAMA_NAMES, "llama3"),
    **dict.fromkeys(QWEN_NAMES, "chatml"),
}

# SGLang's names for the same formats, so that its --chat-template values keep working.
_ALIASES = {"gemma-it": "gemma", "llama-3-instruct": "llama3", "qwen": "chatml", "qwen2-vl": "chatml",
            "qwen3_reranker": RERANKER_TEMPLATE}


def resolve_chat_template(requested: str | None, tokenizer_template: str | None, model_type: str,
                          architectures: Sequence[str]) -> str | None:
    """The template to use: --chat-template, else the tokenizer's, else the family's built-in."""
    if requested:
        return _load_requested(requested)
    if tokenizer_template:
        return tokenizer_template
    for key in (model_type, *architectures):
        if name := ARCH_TO_TEMPLATE.get(key) or ARCH_TO_TEMPLATE.get(key.lower()):
            return BUILTIN_CHAT_TEMPLATES[name]
    return None


def _load_requested(requested: str) -> str:
    name = requested.strip().lower()
    name = _ALIASES.get(name) or ARCH_TO_TEMPLATE.get(name) or name
    if name in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[name]
    if os.path.isfile(requested):
        return _read_template_file(requested)
    if "{{" in requested or "{%" in requested:
        return requested  # an inline Jinja template
    builtins = ", ".join(sorted(BUILTIN_CHAT_TEMPLATES))
    if os.path.exists(requested):
        raise ChatTemplateError(f"chat template {requested!r} is not a regular file")
    raise ChatTemplateError(f"chat template {requested!r} not found: it is neither a built-in "
                            f"template ({builtins}) nor an existing file")


def _read_template_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read chat template file {path!r}: {e}") from e
    if path.endswith(".json"):
        # tokenizer_config.json / chat_template.json carry the template under "chat_template".
        try:
            content = json.loads(content).get("chat_template", "")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ChatTemplateError(f"{path!r} is not a JSON object with a chat_template") from e
        if isinstance(content, list):
            named = {t.get("name"): t.get("template") for t in content if isinstance(t, dict)}
            content = named.get("default", "")
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError(f"chat template file {path!r} holds no template")
    return content


def renderer_arguments(tokenizer: Any) -> frozenset[str]:
    """apply_chat_template's own arguments: a template variable of such a name would set the
    argument (tokenize=True returns ids, not a prompt) or fail as given twice."""
    return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}


def render_chat(tokenizer: Any, template: str, messages: list[dict], *,
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                extra_context: Mapping[str, Any] | None = None) -> str:
    """Renders messages (validated at the HTTP edge: text content) to a prompt string;
    ChatTemplateError (a ValueError) when the template refuses them. `extra_context` reaches the
    template as variables (bos_token etc. override the tokenizer's)."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **(extra_context or {}))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"invalid chat template (line {e.lineno}): {e.message}") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e) or type(e).__name__) from e


def wants_content_parts(tokenizer: Any, template: str) -> bool:
    """Whether `template` reads a message's content only as a list of typed parts (SmolVLM's:
    `for line in message['content']`, `line['type'] == 'text'`), dropping text given as a string:
    found by rendering a probe message both ways, once per template."""
    probe = "lockstep-content-probe"
    for content in (probe, [{"type": "text", "text": probe}]):
        try:
            rendered = render_chat(tokenizer, template, [{"role": "user", "content": content}],
                                   add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a probe: a template that fails on a form does not take it
            continue
        if probe in rendered:
            return not isinstance(content, str)
    return False


@functools.cache
def _reranker_prompt() -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
    return env.from_string(BUILTIN_CHAT_TEMPLATES[RERANKER_TEMPLATE])


def reranker_prompt(query: str, document: str, instruct: str | None) -> str:
    """The text a yes/no reranker (Qwen3-Reranker) scores one (query, document) pair in: the
    built-in RERANKER_TEMPLATE, the one place its prompt is written."""
    return _reranker_prompt().render(query=query, document=document, instruct=instruct)
