from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from lockstep.entrypoints.openai.chat_templates import (
    ARCH_TO_TEMPLATE,
    BUILTIN_CHAT_TEMPLATES,
    ChatTemplateError,
    render_chat,
    resolve_chat_template,
    wants_content_parts,
)
from lockstep.testing.tiny_idefics3 import SMOLVLM_CHAT_TEMPLATE
from lockstep.testing.tiny_models import make_tiny_model


@functools.cache
def _tok() -> Any:
    """A real tokenizer to render with (its own bos/eos are overridden where a test needs)."""
    return AutoTokenizer.from_pretrained(make_tiny_model("qwen2"))


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def _builtin(name: str, messages: list[dict] = CONVERSATION, bos: str | None = None,
             **kw: Any) -> str:
    """A built-in template rendered with the tiny tokenizer, its bos_token replaced by `bos`."""
    extra = {"bos_token": bos} if bos else None
    return render_chat(_tok(), BUILTIN_CHAT_TEMPLATES[name], messages, extra_context=extra, **kw)


def test_gemma_matches_official_gemma3_format():
    out = _builtin("gemma", bos="<bos>")
    assert out == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma_without_system_and_without_generation_prompt():
    out = _builtin("gemma", [{"role": "user", "content": "Hi"}], "<bos>",
                   add_generation_prompt=False)
    assert out == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_gemma_rejects_non_alternating_roles():
    with pytest.raises(ChatTemplateError, match="alternate"):
        _builtin("gemma", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_llama3_matches_official_format():
    out = _builtin("llama3", bos="<|begin_of_text|>")
    assert out == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chatml_matches_qwen_format():
    out = _builtin("chatml")
    assert out == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there <|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_transformers_style_environment():
    template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}"
        "{{ eos_token }}{% if not add_generation_prompt %}{{ raise_exception('needs prompt') }}{% endif %}"
    )
    out = render_chat(_tok(), template, [{"role": "user", "content": "é<b>"}] * 2,
                      extra_context={"eos_token": "</s>"})
    # tojson keeps non-ASCII and HTML characters; trim_blocks eats the newline after a block tag.
    assert out == '{"role": "user", "content": "é<b>"}</s>'
    with pytest.raises(ChatTemplateError, match="needs prompt"):
        render_chat(_tok(), template, [{"role": "user", "content": "x"}],
                    add_generation_prompt=False)


def test_bad_template_and_sandbox_escape_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat(_tok(), "{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat(_tok(),
            "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
            [{"role": "user", "content": "x"}],
        )


def test_resolve_order(tmp_path):
    own = "{{ messages[0].content }}"
    # 1. --chat-template wins: a built-in name, an alias, or a file.
    assert resolve_chat_template("chatml", own, "gemma3", []) == BUILTIN_CHAT_TEMPLATES["chatml"]
    assert resolve_chat_template("Llama3", None, "", []) == BUILTIN_CHAT_TEMPLATES["llama3"]
    assert resolve_chat_template("gemma-it", None, "", []) == BUILTIN_CHAT_TEMPLATES["gemma"]
    path = tmp_path / "custom.jinja"
    path.write_text("custom {{ messages | length }}")
    assert resolve_chat_template(str(path), own, "gemma3", []) == "custom {{ messages | length }}"
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": "from json"}))
    assert resolve_chat_template(str(cfg), None, "", []) == "from json"
    # 2. The tokenizer's own template.
    assert resolve_chat_template(None, own, "gemma3", ["Gemma3ForCausalLM"]) == own
    # 3. The family's built-in, by model_type or by architecture.
    assert resolve_chat_template(None, None, "gemma3_text", []) == BUILTIN_CHAT_TEMPLATES["gemma"]
    assert (
        resolve_chat_template(None, "", "", ["Gemma3ForCausalLM"])
        == BUILTIN_CHAT_TEMPLATES["gemma"]
    )
    assert resolve_chat_template(None, None, "llama", []) == BUILTIN_CHAT_TEMPLATES["llama3"]
    assert resolve_chat_template(None, None, "qwen3", []) == BUILTIN_CHAT_TEMPLATES["chatml"]
    assert (
        resolve_chat_template(None, None, "x", ["Qwen2ForCausalLM"])
        == BUILTIN_CHAT_TEMPLATES["chatml"]
    )
    # 4. Nothing known.
    assert resolve_chat_template(None, None, "mamba", ["MambaForCausalLM"]) is None


def test_arch_table_points_at_builtins():
    assert set(ARCH_TO_TEMPLATE.values()) <= set(BUILTIN_CHAT_TEMPLATES)
    for key in ("gemma3", "gemma3_text", "Gemma3ForCausalLM", "llama", "qwen2", "qwen3"):
        assert key in ARCH_TO_TEMPLATE


def test_missing_template_file_gives_clear_error(tmp_path):
    missing = str(tmp_path / "nope.jinja")
    with pytest.raises(
        ChatTemplateError, match=r"nope\.jinja.*not found.*built-in.*chatml, gemma, llama3"
    ):
        resolve_chat_template(missing, None, "gemma3", [])
    with pytest.raises(ChatTemplateError, match="not a regular file"):
        resolve_chat_template(str(tmp_path), None, "gemma3", [])
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ChatTemplateError, match="holds no template"):
        resolve_chat_template(str(empty), None, "gemma3", [])


def test_content_parts_only_for_templates_that_drop_string_content():
    """SmolVLM's template reads only typed parts (given a string it renders the message empty);
    templates that take strings, or both (Gemma's), keep getting strings."""
    assert wants_content_parts(_tok(), SMOLVLM_CHAT_TEMPLATE)
    both = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}")
    for template in (both, *BUILTIN_CHAT_TEMPLATES.values()):
        assert not wants_content_parts(_tok(), template)
