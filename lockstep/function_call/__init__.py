"""Tool-call parsing: model text in, OpenAI tool calls out, complete or streamed.

One module per call format, a registry of them by SGLang's --tool-call-parser names. Nothing here
knows about HTTP, requests or the scheduler. Names are imported from the module defining them
(core: the shapes and the base class; registry: the parsers by name)."""
