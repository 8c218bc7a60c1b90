#!/usr/bin/env bash
# Data-parallel dispatch side by side: the same shared-prefix workload through `--dp-size 2`
# with each --load-balance-method, one server at a time, ROUNDS rounds interleaved.
# Prints each run's metrics (prefix cache hit rate, throughput, TTFT) and appends JSON lines to
# $OUT; server logs go to $LOGDIR. Usage: benchmarks/dp_routing.sh [METHOD ...]   (default: cache_aware round_robin)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-dp_routing.jsonl}
ROUNDS=${ROUNDS:-2}
LOGDIR=${LOGDIR:-$(mktemp -d)}  # one server log per run
METHODS=("$@")
[ ${#METHODS[@]} -gt 0 ] || METHODS=(cache_aware round_robin)
WORKLOAD=(--dataset-name generated-shared-prefix --gsp-num-groups 8 --gsp-prompts-per-group 8
          --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 8
          --max-concurrency 8 --seed 7 --ignore-eos --disable-tqdm)

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run_one() {  # method round
  local port pid
  port=$(free_port)
  "$PY" -m lockstep.launch_server --port "$port" --dp-size 2 --load-balance-method "$1" \
      > "$LOGDIR/dp_routing-$1-$2.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server for $1 died; see $LOGDIR/dp_routing-$1-$2.log"; exit 1; }
    sleep 1
  done
  echo "== dp 2, --load-balance-method $1, round $2 (load $(cut -d' ' -f1 /proc/loadavg))"
  "$PY" -m lockstep.bench.serving --backend lockstep --port "$port" "${WORKLOAD[@]}" \
      --output-file "$OUT" | grep -E "Prefix cache|Output token|Total token|Median TTFT|Benchmark duration|Successful"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
}

for round in $(seq "$ROUNDS"); do
  order=("${METHODS[@]}")
  if [ $((round % 2)) = 0 ]; then order=($(printf '%s\n' "${METHODS[@]}" | tac)); fi
  for m in "${order[@]}"; do run_one "$m" "$round"; done
done
