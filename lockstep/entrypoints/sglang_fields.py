"""Every request field SGLang 0.5 defines (read from sglang==0.5.23's io_struct.py,
sampling_params.py and openai/protocol.py), and what lockstep does with it: the one table to edit
for the next SGLang version. Clients built on SGLang's types send all of them (sglang-router
rebuilds every request from its own struct, each field at its default).

SERVED: a field of lockstep's own request model (tests check each one is). `Off`: a feature
lockstep lacks; the values that ask for nothing (SGLang's default; null always) are dropped
before validation, any other is a 400 naming it. A field in no table is refused (extra="forbid")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVED = "served"


@dataclass(frozen=True)
class Off:
    why: str  # what lockstep does not do, for the error message
    values: tuple[Any, ...] = ()  # accepted besides null: the values that mean "off"


Table = Mapping[str, "str | Off"]


def _served(names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), SERVED)


def _off(why: str, names: str, *values: Any) -> dict[str, Off]:
    return dict.fromkeys(names.split(), Off(why, values))


_MM = "no video, audio or embedding inputs (images: image_data)"
_PD = "no prefill/decode disaggregation"
_ROUTING = "no routing or cache keys beyond routed_dp_rank"
_FLAT = "no flat raw logprobs"
_EXPERTS = "no mixture-of-experts routing output"
_IDS = "no token ids in OpenAI replies (use /generate)"

# SGLang's SamplingParams (the API fields; stop_strs and the others after them are internal).
SAMPLING_PARAMS: Table = {
    **_served("max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p "
              "frequency_penalty presence_penalty repetition_penalty min_new_tokens n json_schema "
              "regex ebnf ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim "
              "logit_bias sampling_seed seed"),  # seed: lockstep's own name for sampling_seed
    **_off("no structural tags", "structural_tag"),
    **_off("no custom logit processors", "custom_params"),
    **_off("every token is streamed", "stream_interval", 1),
}

GENERATE: Table = {
    **_served("rid text input_ids sampling_params return_logprob logprob_start_len "
              "top_logprobs_num return_text_in_logprobs stream priority routed_dp_rank "
              "data_parallel_rank session_params lora_path image_data"),
    **_off("/generate serves the one model; name none", "model"),  # sglang-router sends null
    **_off(_MM, "input_embeds video_data audio_data mm_hashes mm_content_hashes "
           "video_config modalities positional_embed_overrides need_wait_for_mm_inputs "
           "num_items_assigned encoder_urls max_dynamic_patch min_dynamic_patch "
           "image_max_dynamic_patch video_max_dynamic_patch images_config mm_processor_kwargs "
           "multi_item_delimiter_indices token_indices_to_pool"),
    **_off(_MM, "use_audio_in_video", False),
    **_off("a session is named in session_params.id", "session_id"),
    **_off("no watermarking", "watermark"),
    **_off("no logprobs of chosen token ids; use top_logprobs_num", "token_ids_logprob"),
    **_off("no sampling masks", "return_sampling_mask", False),
    **_off("logprobs are of the model's own distribution", "sampling_logprobs_mode"),
    **_off(_FLAT, "return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs "
           "return_flat_raw_top_logprobs_b64", False),  # b64: an encoding of the flat arrays
    **_off("every request is counted in /metrics", "log_metrics", True),
    **_off("no hidden states", "return_hidden_states", False),
    **_off(_EXPERTS, "return_routed_experts", False),
    **_off(_EXPERTS, "routed_experts_start_len", 0),
    **_off("no sparse-attention indexer", "return_indexer_topk", False),
    **_off("adapters are named by lora_path", "lora_id"),
    **_off("no custom logit processors", "custom_logit_processor"),
    **_off(_PD, "bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size "
           "disagg_prefill_dp_rank"),
    **_off(_ROUTING, "routing_key conversation_id extra_key cache_salt kv_hints http_worker_ipc"),
    **_off("no background requests", "background", False),
    **_off("no forced reasoning", "require_reasoning", False),
    **_off("no thinking budget", "max_thinking_tokens"),
    **_off("requests are logged as --log-level says", "no_logs", False),
    **_off("no custom metric labels", "custom_labels"),
    **_off("no token bytes", "return_bytes", False),
    **_off("no entropy", "return_entropy", False),
    **_off("no prompt ids in replies", "return_prompt_token_ids", False),
    **_off("no tracing", "external_trace_header"),
    **_off("the server times requests itself", "received_time"),
}

# Fields CompletionRequest and ChatCompletionRequest both define.
_OPENAI: Table = {
    **_served("model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed "
              "stop stream stream_options temperature top_p user top_k min_p min_tokens regex "
              "ebnf repetition_penalty stop_token_ids stop_regex no_stop_trim ignore_eos "
              "skip_special_tokens response_format priority routed_dp_rank data_parallel_rank "
              "lora_path"),
    **_off(_PD, "bootstrap_host bootstrap_port bootstrap_room disagg_prefill_dp_rank"),
    **_off(_ROUTING, "rid extra_key cache_salt"),
    **_off("no hidden states", "return_hidden_states", False),
    **_off(_EXPERTS, "return_routed_experts", False),
    **_off(_EXPERTS, "routed_experts_start_len", 0),
    **_off("no cache or speculation breakdowns beyond usage.prompt_tokens_details",
           "return_cached_tokens_details return_spec_tokens_details", False),
    **_off(_IDS, "return_token_ids", False),
    **_off("sessions are served on /generate", "session_id session_params"),
    **_off("no custom logit processors", "custom_params custom_logit_processor"),
    **_off("no watermarking", "watermark"),
    **_off(_MM, "images_config mm_processor_kwargs"),
    **_off("no custom metric labels", "custom_labels"),
}

COMPLETIONS: Table = {
    **_OPENAI,
    **_served("prompt best_of echo json_schema"),
    **_off("no fill-in-the-middle", "suffix", ""),  # OpenAI's clients send it empty
}

CHAT: Table = {
    **_OPENAI,
    **_served("messages top_logprobs max_completion_tokens tools tool_choice parallel_tool_calls "
              "separate_reasoning stream_reasoning chat_template_kwargs"),
    **_off(_IDS, "return_prompt_token_ids return_meta_info return_input_ids_in_sglext "
           "return_output_ids_in_sglext", False),
    **_off("no sampling masks", "return_sampling_mask", False),
    **_off("logprobs are of the model's own distribution", "sampling_logprobs_mode"),
    **_off(_FLAT, "return_flat_raw_output_top_logprobs", False),
    **_off(_FLAT, "return_flat_raw_top_logprobs_b64", True),
    **_off("no reasoning effort levels", "reasoning_effort"),
    **_off("no thinking config; use chat_template_kwargs", "thinking"),
    **_off("no DeepSeek-V4 quick instructions", "task"),
    **_off("the reply always starts a new assistant turn", "continue_final_message", False),
    **_off(_MM, "max_dynamic_patch min_dynamic_patch video_config"),
    **_off(_MM, "use_audio_in_video", False),
    **_off("chat prompts come from messages; send token ids to /v1/completions", "input_ids"),
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
