"""Tool-call parsing: model text in, OpenAI tool calls out, complete or streamed.

One module per call format, a registry of them by SGLang's --tool-call-parser names. Nothing here
knows about HTTP, requests or the scheduler.
"""

from lockstep.function_call.core import (
    ParseResult,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
)
from lockstep.function_call.registry import (
    TOOL_CALL_PARSERS,
    default_parser_name,
    make_parser,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParseResult",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "default_parser_name",
    "make_parser",
]
