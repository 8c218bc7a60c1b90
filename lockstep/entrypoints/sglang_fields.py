"""Every request field SGLang 0.5 defines, and what lockstep does with it: the one table to edit
for the next SGLang version.

Read from the PyPI wheel sglang==0.5.23: `srt/managers/io_struct.py` (GenerateReqInput, the
/generate body), `srt/sampling/sampling_params.py` (SamplingParams, its API fields) and
`srt/entrypoints/openai/protocol.py` (CompletionRequest, ChatCompletionRequest, with
PDRoutingFields). Clients built on SGLang's types send all of them: sglang-router rebuilds every
request from its own struct, with each field at its default.

SERVED: a field of lockstep's own request model (tests check that each one is). `Off`: a feature
lockstep does not have; the field is accepted at the values that ask for nothing (SGLang's
default; a JSON null always) and dropped before validation, and any other value is a 400 naming
the field and the value. A field in no table is unknown: the models refuse it (extra="forbid").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SGLANG_VERSION = "0.5.23"
SERVED = "served"


@dataclass(frozen=True)
class Off:
    why: str  # what lockstep does not do, for the error message
    values: tuple[Any, ...] = ()  # accepted besides null: the values that mean "off"


Table = Mapping[str, "str | Off"]

_MM = Off("text-only: no multimodal inputs")
_PD = Off("no prefill/decode disaggregation")
_LORA = Off("no LoRA adapters")
_SESSION = Off("no sessions")
_ROUTING = Off("no per-request routing or cache keys")
_PROCESSOR = Off("no custom logit processors")
_WATERMARK = Off("no watermarking")
_LABELS = Off("no custom metric labels")
_NO_HIDDEN = Off("no hidden states", (False,))
_NO_EXPERTS = Off("no mixture-of-experts routing output", (False,))
_NO_DETAILS = Off("no cache/speculation breakdowns beyond usage.prompt_tokens_details", (False,))
_NO_IDS_OUT = Off("no token ids in OpenAI replies (use /generate)", (False,))

# SGLang's SamplingParams (the API fields; stop_strs and the others after them are internal).
SAMPLING_PARAMS: Table = {
    **dict.fromkeys((
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
        "n", "json_schema", "regex", "ebnf", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "logit_bias", "sampling_seed",
        "seed",  # lockstep's own name for sampling_seed
    ), SERVED),
    "structural_tag": Off("no structural tags"),
    "custom_params": _PROCESSOR,
    "stream_interval": Off("every token is streamed", (1,)),
}

GENERATE: Table = {
    **dict.fromkeys((
        "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
        "top_logprobs_num", "return_text_in_logprobs", "stream",
    ), SERVED),
    "model": Off("/generate serves the one model; name none"),  # sglang-router sends null
    **dict.fromkeys((
        "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
        "mm_content_hashes", "video_config", "modalities", "positional_embed_overrides",
        "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
        "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices",
        "token_indices_to_pool"), _MM),
    "use_audio_in_video": Off(_MM.why, (False,)),
    "session_id": _SESSION, "session_params": _SESSION,
    "watermark": _WATERMARK,
    "token_ids_logprob": Off("no logprobs of chosen token ids; use top_logprobs_num"),
    "return_sampling_mask": Off("no sampling masks", (False,)),
    "sampling_logprobs_mode": Off("logprobs are of the model's own distribution"),
    "return_flat_raw_top_logprobs": Off("no flat raw logprobs", (False,)),
    "return_flat_raw_output_top_logprobs": Off("no flat raw logprobs", (False,)),
    "log_metrics": Off("every request is counted in /metrics", (True,)),
    "return_hidden_states": _NO_HIDDEN,
    "return_routed_experts": _NO_EXPERTS,
    "routed_experts_start_len": Off(_NO_EXPERTS.why, (0,)),
    "return_indexer_topk": Off("no sparse-attention indexer", (False,)),
    "lora_path": _LORA, "lora_id": _LORA,
    "custom_logit_processor": _PROCESSOR,
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                     "decode_tp_size", "disagg_prefill_dp_rank"), _PD),
    **dict.fromkeys(("routed_dp_rank", "data_parallel_rank", "routing_key", "conversation_id",
                     "extra_key", "cache_salt", "kv_hints", "http_worker_ipc"), _ROUTING),
    "background": Off("no background requests", (False,)),
    "require_reasoning": Off("no forced reasoning", (False,)),
    "max_thinking_tokens": Off("no thinking budget"),
    "priority": Off("no request priorities"),
    "no_logs": Off("requests are logged as the server's --log-level says", (False,)),
    "custom_labels": _LABELS,
    "return_bytes": Off("no token bytes", (False,)),
    "return_entropy": Off("no entropy", (False,)),
    "return_prompt_token_ids": Off("no prompt ids in replies", (False,)),
    "external_trace_header": Off("no tracing"),
    "received_time": Off("the server times requests itself"),
}

# Fields CompletionRequest and ChatCompletionRequest both define.
_OPENAI: Table = {
    **dict.fromkeys((
        "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
        "user", "top_k", "min_p", "min_tokens", "regex", "ebnf", "repetition_penalty",
        "stop_token_ids", "stop_regex", "no_stop_trim", "ignore_eos", "skip_special_tokens",
        "response_format",
    ), SERVED),
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room",
                     "disagg_prefill_dp_rank"), _PD),
    **dict.fromkeys(("routed_dp_rank", "data_parallel_rank", "rid", "extra_key", "cache_salt"),
                    _ROUTING),
    "return_hidden_states": _NO_HIDDEN,
    "return_routed_experts": _NO_EXPERTS,
    "routed_experts_start_len": Off(_NO_EXPERTS.why, (0,)),
    "return_cached_tokens_details": _NO_DETAILS,
    "return_spec_tokens_details": _NO_DETAILS,
    "return_token_ids": _NO_IDS_OUT,
    "lora_path": _LORA,
    "session_id": _SESSION, "session_params": _SESSION,
    "custom_params": _PROCESSOR, "custom_logit_processor": _PROCESSOR,
    "watermark": _WATERMARK,
    "images_config": _MM, "mm_processor_kwargs": _MM,
    "priority": Off("no request priorities"),
    "custom_labels": _LABELS,
}

COMPLETIONS: Table = {
    **_OPENAI,
    **dict.fromkeys(("prompt", "best_of", "echo", "json_schema"), SERVED),
    "suffix": Off("no fill-in-the-middle", ("",)),  # OpenAI's clients send it empty
}

CHAT: Table = {
    **_OPENAI,
    **dict.fromkeys((
        "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
        "parallel_tool_calls", "separate_reasoning", "stream_reasoning", "chat_template_kwargs",
    ), SERVED),
    **dict.fromkeys(("return_prompt_token_ids", "return_meta_info", "return_input_ids_in_sglext",
                     "return_output_ids_in_sglext"), _NO_IDS_OUT),
    "return_sampling_mask": Off("no sampling masks", (False,)),
    "sampling_logprobs_mode": Off("logprobs are of the model's own distribution"),
    "return_flat_raw_output_top_logprobs": Off("no flat raw logprobs", (False,)),
    "return_flat_raw_top_logprobs_b64": Off("no flat raw logprobs", (True,)),
    "reasoning_effort": Off("no reasoning effort levels"),
    "thinking": Off("no thinking config; use chat_template_kwargs"),
    "task": Off("no DeepSeek-V4 quick instructions"),
    "continue_final_message": Off("the reply always starts a new assistant turn", (False,)),
    **dict.fromkeys(("max_dynamic_patch", "min_dynamic_patch", "video_config"), _MM),
    "use_audio_in_video": Off(_MM.why, (False,)),
    "input_ids": Off("chat prompts come from messages; send token ids to /v1/completions"),
}


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # False is not 0


def _show(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:60] + "..."


def drop_off_fields(table: Table, data: Any) -> Any:
    """Before validation: each field the table marks Off is checked and removed; the rest is
    left for the model (served fields, and unknown ones, which it refuses)."""
    if not isinstance(data, Mapping):
        return data
    out = {}
    for key, value in data.items():
        rule = table.get(key)
        if not isinstance(rule, Off):
            out[key] = value
        elif value is not None and not any(_same(value, ok) for ok in rule.values):
            allowed = " or ".join(["omit it", *(f"send {_show(ok)}" for ok in rule.values)])
            raise ValueError(f"{key}: {_show(value)} is not supported by this server "
                             f"({rule.why}); {allowed}")
    return out
