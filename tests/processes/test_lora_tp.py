"""LoRA under tensor parallelism: each rank keeps its shard of every adapter's B (the rows its base
weight keeps) and A whole, so TP 2 gives TP 1's tokens and logprobs bit for bit, for requests of
two adapters and of the base mixed in one batch."""

from __future__ import annotations

import asyncio

import pytest

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.lora_adapters import make_peft_adapter
from lockstep.testing.tiny_models import tiny_prompts

NEW = 8


@pytest.mark.server
def test_tp2_matches_tp1_with_adapters_mixed(tiny_model_dirs, tmp_path) -> None:
    model_dir = tiny_model_dirs["qwen2"]  # q/k/v biases too; 2 KV heads split over 2 ranks
    paths = [f"a={make_peft_adapter(model_dir, tmp_path / 'a', seed=41)}",
             f"b={make_peft_adapter(model_dir, tmp_path / 'b', seed=42, rank=4, targets=('k_proj', 'o_proj', 'up_proj'))}"]
    prompts = tiny_prompts(model_dir, 6, seed=43)
    loras = ["a", "b", None, "a", "b", None]
    ref = run_to_completion(make_scheduler(model_dir, max_total_tokens=4096, lora_paths=paths), [
        greedy_req(f"r{i}", p, NEW, return_logprob=True, lora_path=lora)
        for i, (p, lora) in enumerate(zip(prompts, loras))])
    launched = launch_subprocesses(ServerArgs(model_path=str(model_dir), dtype="float32",
                                              max_total_tokens=4096, tp_size=2, lora_paths=paths,
                                              enable_lockstep_check=4))
    try:
        tm = launched.tokenizer_manager

        async def one(prompt: list[int], lora: str | None):
            req = GenerateReqInput(input_ids=prompt, return_logprob=True, lora_path=lora, sampling_params={
                "max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}).normalize()[0]
            async for out in tm.generate(req):
                last = out
            return last.output_ids, [e.logprob for e in last.output_token_logprobs]

        async def main():
            return await asyncio.gather(*(one(p, lora) for p, lora in zip(prompts, loras)))

        got = asyncio.run(main())
    finally:
        launched.shutdown()
    for i, (ids, logprobs) in enumerate(got):
        assert ids == ref[f"r{i}"].output_ids, i
        assert logprobs == ref[f"r{i}"].logprobs, i
