"""What the tests share (tests/conftest.py is thin over it; no test module imports another).

- tiny_models.py  the one tiny-model factory: `tiny_hf_model` (in memory), `make_tiny_model` (an HF
                  directory, cached), the tiny tokenizer, `tiny_prompts`
- gguf_writer.py  `write_gguf`: a tiny HF model as a GGUF, as llama.cpp's converter writes it
- corpus.py       the built-in text the tiny tokenizer is trained on; `random_prompt`
- inproc.py       drive a Scheduler in the test process (`make_scheduler`, `run_to_completion`)
- live_server.py  `LiveServer` (a `lockstep.launch_server` process), the session's real-model
                  server, `running_engine` (an offline Engine), `alive_pids`, `sse_events`
- kernels.py      compiled kernel variants as pytest params, `random_blocks`, batch invariance
- oracle.py, hf_weights.py  HF transformers as the correctness oracle on the same weights
- faults.py       faults injected into a live server's processes
- browser.py      a real headless Chromium (Debian's package, installed on first use) driven
                  over the DevTools protocol: the chat page's test
- tiers.py        the markers (`server`, `real_model`, `soak`), `marks` for fixtures, and the
                  guard that fails an unmarked test which starts processes

Fixtures (tests/conftest.py): `model_dir` (tiny llama), `tiny_model_dirs` (every tiny arch),
`llama_server` (the tiny llama behind --api-key, one per session), `real_server` (Gemma 3 270M,
named, one per session), `default_server` (no --model-path: the default model), `engine` (an offline
Engine on the tiny llama), `gemma_gguf`, `passive_openmp_threads`.
"""
