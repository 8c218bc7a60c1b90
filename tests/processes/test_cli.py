"""`lockstep serve`'s command line, built from the ServerArgs table."""

from __future__ import annotations

import dataclasses

import pytest

from lockstep.cli import serve_parser
from lockstep.lora.adapter import parse_lora_paths
from lockstep.server_args import ServerArgs
from lockstep.utils.flags import from_flags


def _parse(*argv: str) -> ServerArgs:
    parser = serve_parser()
    return from_flags(parser, ServerArgs, parser.parse_args(list(argv)))


def test_no_flags_give_the_defaults():
    assert _parse() == ServerArgs()


def test_every_field_has_its_flag_with_help_and_a_group():
    help_text = serve_parser().format_help()
    flat = "".join(help_text.split())  # argparse wraps the lines, also at hyphens
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in help_text, f.name
        assert f.metadata["help"] and f.metadata["group"], f.name
        assert "".join(f.metadata["help"].replace("%%", "%").split()) in flat, f.name
    assert "model options" in help_text and "parallelism options" in help_text


def test_values_are_typed_from_the_annotations():
    args = _parse("--port", "8000", "--mem-fraction-static", "0.5", "--max-total-tokens", "4096",
                  "--model-path", "m.gguf", "--pp-micro-batches", "2")
    assert (args.port, args.mem_fraction_static, args.max_total_tokens) == (8000, 0.5, 4096)
    assert args.model_path == "m.gguf" and args.pp_micro_batches == 2


def test_sglangs_flag_names_and_both_senses_of_booleans():
    assert _parse("--disable-radix-cache").disable_radix_cache
    assert not _parse("--disable-radix-cache", "--no-disable-radix-cache").disable_radix_cache
    assert _parse("--enable-overlap-schedule").overlap_schedule
    assert not _parse("--device", "cuda", "--disable-overlap-schedule").overlap_schedule
    assert not _parse("--device", "cuda", "--no-enable-overlap-schedule").overlap_schedule
    assert _parse("--device", "cuda").overlap_schedule  # the device's default
    assert _parse("--enable-mixed-chunk").enable_mixed_chunk


def test_vllms_lora_flag_names_and_json_adapters(capsys):
    """vLLM's --lora-modules, --max-loras, --max-cpu-loras set SGLang's fields; an adapter is
    name=path or JSON in either server's keys; a key lockstep does not honour is refused."""
    vllm = _parse("--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--max-loras", "2",
                  "--max-cpu-loras", "4", "--lora-dtype", "bfloat16")
    sglang = _parse("--lora-paths", '{"lora_name": "a", "lora_path": "/x"}', "b=/y",
                    "--max-loras-per-batch", "2", "--max-loaded-loras", "4", "--lora-dtype", "bfloat16")
    assert dataclasses.replace(vllm, lora_paths=[]) == dataclasses.replace(sglang, lora_paths=[])
    assert (vllm.max_loras_per_batch, vllm.max_loaded_loras) == (2, 4) and vllm.lora_enabled
    assert parse_lora_paths(vllm.lora_paths) == parse_lora_paths(sglang.lora_paths) == {"a": "/x", "b": "/y"}
    for item, needle in (('{"name": "a", "path": "/x", "pinned": true}', "['pinned'] are not served"),
                         ('{"name": "a"}', "give lora_name and lora_path"), ("{oops", "not JSON")):
        with pytest.raises(SystemExit):
            _parse("--lora-modules", item)
        assert needle in capsys.readouterr().err, item


def test_bad_values_exit_with_a_message_naming_the_problem(capsys):
    for argv, needle in ((["--quantization", "int3"], "invalid choice: 'int3'"),
                         (["--port", "http"], "invalid int value"),
                         (["--tp-size", "0"], "--tp-size must be >= 1"),
                         (["--pp-micro-batches", "0"], "--pp-micro-batches must be >= 1"),
                         (["--graceful-shutdown-timeout", "-1"],
                          "--graceful-shutdown-timeout must be >= 0")):
        with pytest.raises(SystemExit) as e:
            _parse(*argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err, argv


def test_server_info_lists_every_field_and_hides_the_api_key():
    info = _parse("--api-key", "sk-secret", "--port", "8000").info()
    assert set(info) == {f.name for f in dataclasses.fields(ServerArgs)}
    assert info["api_key"] == "<redacted>" and info["port"] == 8000
    assert ServerArgs().info()["api_key"] is None  # nothing to hide: shown as unset


def test_server_info_shows_what_runs_for_the_fields_decided_at_launch():
    cpu = ServerArgs().info()
    assert cpu["speculative_algorithm"] == "NGRAM" and cpu["enable_overlap_schedule"] is False
    cuda = ServerArgs(device="cuda").info()
    assert cuda["speculative_algorithm"] is None and cuda["enable_overlap_schedule"] is True
    off = _parse("--speculative-algorithm", "NONE").info()
    assert off["speculative_algorithm"] is None and off["enable_overlap_schedule"] is False
