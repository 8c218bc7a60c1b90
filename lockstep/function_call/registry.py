"""Tool-call parsers by the names SGLang's --tool-call-parser uses, and a model family's default."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lockstep.function_call.core import ToolCallParser
from lockstep.function_call.llama3 import Llama3Parser
from lockstep.function_call.pythonic import PythonicParser
from lockstep.function_call.qwen25 import Qwen25Parser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (Qwen25Parser, Llama3Parser, PythonicParser)
}

# Model families by model_type and by architecture (a config may name only one of them); the
# chat templates (entrypoints/openai/chat_templates.py) key on the same names.
QWEN_NAMES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
              "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
LLAMA_NAMES = ("llama", "LlamaForCausalLM")
# Only families whose instruct models were trained on one call format; Gemma 3 has none.
_DEFAULT_PARSER = {**dict.fromkeys(QWEN_NAMES, "qwen25"), **dict.fromkeys(LLAMA_NAMES, "llama3")}


def make_parser(name: str, tool_names: Iterable[str]) -> ToolCallParser:
    """A fresh parser for one generation; ValueError naming the known parsers otherwise."""
    if (cls := TOOL_CALL_PARSERS.get(name)) is None:
        known = ", ".join(sorted(TOOL_CALL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known: {known}")
    return cls(tool_names)


def default_parser_name(model_type: str, architectures: Sequence[str]) -> str | None:
    """The parser a model family's chat format implies, or None where it is not unambiguous."""
    return next((_DEFAULT_PARSER[k] for k in (model_type, *architectures) if k in _DEFAULT_PARSER),
                None)
