#!/usr/bin/env bash
# Issue 7's serving workloads against one server at a time, the same client and prompts for all.
#   benchmarks/serving_side_by_side.sh KIND ROUND [WORKLOAD ...]
# KIND: lockstep (default flags: int8 activations where they apply, NGRAM speculation on a CPU) |
#       lockstep-nospec (--speculative-algorithm NONE) | lockstep-avx2 (the AVX2 kernels
#       forced) | lockstep-f32 (--no-int8-activations: the exact float32 path) |
#       lockstep-bf16 | lockstep-noradix |
#       llama-server | llama-server-SPEC (--spec-type SPEC: ngram-simple, ngram-mod, ngram-map-k,
#       ngram-cache, as `llama-server --help` lists them) | llama-cpp-python
# MODEL: a packaged model's short name (default smollm2-135m-instruct, the default model; also
#        gemma-3-270m): both servers get its GGUF.
# WORKLOAD: wbatch wsingle wprefill wprefix scale (default: all five)
#   also: wchat (issue 36's W-chat: one user asks ordinary questions, greedy, answers end at the end of turn),
#         wedit (issue 22's W-edit: repeat or lightly edit a passage; where speculation pays),
#         wjson (W-edit's passages copied into JSON under a schema: speculation through a grammar)
# llama-server: -c 98304 -np 32 gives each of its 32 slots 3,072 tokens of context (W-prefill needs 2,056).
# Peers are not dependencies: point LLAMA_SERVER at a llama-server binary and LLAMA_CPP_PYTHON at
# a Python with llama-cpp-python[server] (see docs/benchmarks.md for how they were built).
# EXTRA_ARGS: more flags for a lockstep kind (e.g. EXTRA_ARGS="--no-int8-activations").
# Results: JSON lines appended to $OUT, tagged "KIND|WORKLOAD|ROUND"; server logs in $LOGDIR.
set -u
KIND=$1; ROUND=$2; shift 2
WORKLOADS=${*:-wbatch wsingle wprefill wprefix scale}
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-serving_side_by_side.jsonl}
LOGDIR=${LOGDIR:-$(mktemp -d)}
# Before each run, wait for the 1-min load average to fall below MAX_LOAD: about a minute's rest after a
# two-core run. This host ran a fifth to a half slower for a while after one (docs/benchmarks.md, "a cool-down
# between runs"): with a gate near the core count, a run started on a host still slowed by the one before.
MAX_LOAD=${MAX_LOAD:-0.6}
MODEL=${MODEL:-smollm2-135m-instruct}
GGUF=$("$PY" -c "import sys; from lockstep.model_loader.packaged import PACKAGED_MODELS as M; print(M[sys.argv[1]].path())" "$MODEL") || exit 2
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
case $KIND in
  lockstep) CMD=("$PY" -m lockstep.launch_server --model-path "$MODEL" --port "$PORT" ${EXTRA_ARGS:-}); BACKEND=lockstep ;;
  lockstep-avx2) CMD=(env LOCKSTEP_KERNEL_ISA=avx2 "$PY" -m lockstep.launch_server --model-path "$MODEL" --port "$PORT" ${EXTRA_ARGS:-}); BACKEND=lockstep ;;
  lockstep-f32) CMD=("$PY" -m lockstep.launch_server --model-path "$MODEL" --port "$PORT" --no-int8-activations ${EXTRA_ARGS:-}); BACKEND=lockstep ;;
  lockstep-bf16) CMD=("$PY" -m lockstep.launch_server --model-path "$MODEL" --port "$PORT" --dtype bfloat16 ${EXTRA_ARGS:-}); BACKEND=lockstep ;;
  lockstep-noradix) CMD=("$PY" -m lockstep.launch_server --model-path "$MODEL" --port "$PORT" --disable-radix-cache ${EXTRA_ARGS:-}); BACKEND=lockstep ;;
  lockstep-nospec) CMD=("$PY" -m lockstep.launch_server --model-path "$MODEL" --port "$PORT" --speculative-algorithm NONE ${EXTRA_ARGS:-}); BACKEND=lockstep ;;
  llama-server) CMD=("${LLAMA_SERVER:?set LLAMA_SERVER}" -m "$GGUF" -t 2 -c 98304 -np 32 -cb --port "$PORT"); BACKEND=openai ;;
  llama-server-*) CMD=("${LLAMA_SERVER:?set LLAMA_SERVER}" -m "$GGUF" -t 2 -c 98304 -np 32 -cb --port "$PORT"
                       --spec-type "${KIND#llama-server-}"); BACKEND=openai ;;
  llama-cpp-python) CMD=("${LLAMA_CPP_PYTHON:?set LLAMA_CPP_PYTHON}" -m llama_cpp.server --model "$GGUF"
                         --n_threads 2 --interrupt_requests False --logits_all False --n_ctx 4096 --port "$PORT")
                    BACKEND=openai ;;
  *) echo "unknown kind $KIND"; exit 2 ;;
esac
echo "[$(date +%T)] $KIND round $ROUND: ${CMD[*]}"
"${CMD[@]}" > "$LOGDIR/server-$KIND-$ROUND.log" 2>&1 &
SPID=$!
trap 'kill $SPID 2>/dev/null; wait $SPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
  kill -0 $SPID 2>/dev/null || { echo "server died; see $LOGDIR/server-$KIND-$ROUND.log"; exit 1; }
  sleep 1
done
gate() { for _ in $(seq 180); do awk -v m="$MAX_LOAD" '{exit !($1 < m)}' /proc/loadavg && return; sleep 5; done; }
run() {
  local tag=$1; shift; gate
  echo "== $KIND $MODEL $tag round $ROUND (load $(cut -d' ' -f1 /proc/loadavg))"
  "$PY" -m lockstep.bench.serving --backend $BACKEND --port "$PORT" ${IGNORE_EOS---ignore-eos} --disable-tqdm \
      --tokenizer "$MODEL" \
      --output-file "$OUT" --tag "$KIND|$tag|$ROUND|$MODEL" "$@" 2>&1 \
    | grep -E "Successful|Failed req|duration|Output token|Per-user|Median TTFT|Mean TPOT|Median ITL|Prefix cache|Accept length"
}
for w in $WORKLOADS; do
  case $w in
    wbatch) run W-batch --dataset-name random --num-prompts 64 --random-input-len 256 \
              --random-output-len 128 --random-range-ratio 1 --max-concurrency 32 --seed 1 ;;
    wsingle) run W-single --dataset-name random --num-prompts 8 --random-input-len 128 \
              --random-output-len 128 --random-range-ratio 1 --max-concurrency 1 --seed 2 ;;
    wprefill) run W-prefill --dataset-name random --num-prompts 4 --random-input-len 2048 \
              --random-output-len 8 --random-range-ratio 1 --max-concurrency 1 --seed 4 ;;
    wprefix) run W-prefix --dataset-name generated-shared-prefix --gsp-num-groups 8 \
              --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 64 \
              --gsp-output-len 32 --max-concurrency 16 --seed 3 ;;
    scale) for c in 1 4 16 64; do
             run "Scale-c$c" --dataset-name random --num-prompts $(( c > 8 ? c : 8 )) \
               --random-input-len 128 --random-output-len 64 --random-range-ratio 1 \
               --max-concurrency $c --seed $(( 10 + c ))
           done ;;
    wchat) IGNORE_EOS= run W-chat --dataset-name chat --num-prompts 16 --chat-output-len 160 \
              --max-concurrency 1 --seed 6 ;;
    # Issue 22: a ~300-token corpus passage to repeat or lightly edit; the answer copies the prompt.
    wedit) run W-edit --dataset-name edit --num-prompts 6 --edit-passage-len 300 --edit-output-len 256 \
              --max-concurrency 1 --seed 4 ;;
    # W-edit's passages copied into JSON under a schema (extraction): drafts pass the grammar's
    # masks. The answer ends when the JSON does (no --ignore-eos: past it only an end token fits).
    wjson) schema='{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}'
           if [ "$BACKEND" = lockstep ]; then  # SGLang's sampling_params.json_schema is a string
             body=$("$PY" -c 'import json, sys; print(json.dumps({"sampling_params": {"json_schema": sys.argv[1]}}))' "$schema")
           else body="{\"json_schema\": $schema}"; fi  # llama-server: the schema object
           IGNORE_EOS= run W-json --dataset-name edit --num-prompts 6 --edit-passage-len 300 --edit-output-len 256 \
              --max-concurrency 1 --seed 5 --extra-request-body "$body" ;;
    *) echo "unknown workload $w"; exit 2 ;;
  esac
done
