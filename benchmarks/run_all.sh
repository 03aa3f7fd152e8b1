#!/usr/bin/env bash
# Run every benchmark with its default arguments, then print the "Performance" section of docs/performance.md.
#
#   bash benchmarks/run_all.sh          # ~5 minutes on 2 CPU cores; results in benchmarks/results/
#
# Each script's table goes to benchmarks/results/<name>.txt as well; the Markdown section
# to benchmarks/results/performance.md.  Stops at the first failing benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
declare -A ARGS=([step_time]="--profile")  # the profile shows where time goes (docs/performance.md)
python benchmarks/step_time.py --model llama-fsdp --tp 4 --sizes small --modes eager,aot_eager --no-plot \
  2> benchmarks/results/step_time_fsdp.stderr | tee benchmarks/results/step_time_fsdp.txt
for name in step_time communication transform_time memory context_parallel moe_compile; do
  echo "=== python benchmarks/$name.py ${ARGS[$name]:-}" >&2
  start=$SECONDS
  # shellcheck disable=SC2086
  python "benchmarks/$name.py" ${ARGS[$name]:-} 2> "benchmarks/results/$name.stderr" | tee "benchmarks/results/$name.txt"
  echo "=== $name: $((SECONDS - start)) s" >&2
done
python benchmarks/report.py --out benchmarks/results/performance.md
