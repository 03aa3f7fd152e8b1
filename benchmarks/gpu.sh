#!/usr/bin/env bash
# The GPU checks of fxshard, for one CUDA machine (a single GPU is enough).
#
#   bash benchmarks/gpu.sh              # everything (never run yet; estimate ~10 min on one H100/H200) -> benchmarks/results/gpu.json
#   bash benchmarks/gpu.sh --dry-run    # print the steps, run nothing
#   NPROC=2 bash benchmarks/gpu.sh      # NCCL runs on 2 GPUs instead of 1
#
# Steps (each is logged; a failing step is recorded and the others still run):
#   1. nccl_demo      the main job on NCCL at world size NPROC (torchrun): dump, train, compare
#                     with one device, then the step-time comparison of the demo model
#                     (eager, aot_eager, inductor)
#   2. simulated_cuda 4 simulated ranks (LocalTensorMode) on the GPU: sharded loss == one-device
#                     loss before and after an SGD step (Llama dense, Llama and GPT-2 SP + loss parallel)
#   3. step_time      fxshard vs DTensor vs hand-written Megatron on NCCL: the small (overhead-bound)
#                     model and a realistic hidden size (dim 4096, ffn 14336, vocab 32768,
#                     batch 4 x 1024 tokens, fp32), eager and inductor
# Everything lands in one JSON file: benchmarks/results/gpu.json (per step: command, exit
# status, seconds, log tail, and the step's own results JSON).
set -u -o pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}
OUT=${OUT:-benchmarks/results/gpu}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
TORCHRUN=(python -m torch.distributed.run --standalone --nproc-per-node "$NPROC")

STEPS=(nccl_demo simulated_cuda step_time)
declare -A CMD
CMD[nccl_demo]="${TORCHRUN[*]} -m fxshard demo --steps 5 --bench --bench-modes eager,aot_eager,inductor --bench-iters 20"
CMD[simulated_cuda]="python benchmarks/device_equivalence.py --device cuda --tp 4 --out $OUT/simulated_cuda.json"
CMD[step_time]="${TORCHRUN[*]} benchmarks/step_time.py --device cuda --sizes small,gpu --modes eager,inductor --iters 10 --warmup 3 --no-plot --quiet --out $OUT/step_time.json"

if [ "$DRY" = 1 ]; then
  for s in "${STEPS[@]}"; do echo "$s: ${CMD[$s]}"; done
  exit 0
fi

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "benchmarks/gpu.sh: no CUDA device visible to torch ($(python -c 'import torch; print(torch.__version__)'))" >&2
  exit 1
fi
nvidia-smi -L || true
mkdir -p "$OUT"
# fxshard.passes lives in passes/ (pyproject maps it): a bare checkout needs the editable install
# (offline-safe: no dependencies, no build isolation; torch and networkx must be there already)
if ! python -c "import fxshard.passes, networkx" 2>/dev/null; then
  pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
fi
: > "$OUT/status.tsv"
for s in "${STEPS[@]}"; do
  echo "=== $s: ${CMD[$s]}"
  t0=$SECONDS
  # shellcheck disable=SC2086  # the command is a word list on purpose
  ${CMD[$s]} > "$OUT/$s.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/$s.log"
  printf '%s\t%s\t%s\t%s\n' "$s" "$rc" "$((SECONDS - t0))" "${CMD[$s]}" >> "$OUT/status.tsv"
  echo "=== $s: exit $rc"
done

python - "$OUT" <<'EOF'
import json, os, sys, platform
out = sys.argv[1]
import torch
result = {"machine": {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                      "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None},
          "steps": {}}
for line in open(os.path.join(out, "status.tsv")):
    name, rc, seconds, cmd = line.rstrip("\n").split("\t", 3)
    log = open(os.path.join(out, name + ".log"), errors="replace").read().splitlines()
    step = {"command": cmd, "exit": int(rc), "seconds": float(seconds or 0), "log_tail": log[-60:]}
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        step["results"] = json.load(open(path))
    result["steps"][name] = step
dest = os.path.join(os.path.dirname(out.rstrip("/")), "gpu.json")
json.dump(result, open(dest, "w"), indent=1)
print(f"\n{dest}")
for name, step in result["steps"].items():
    print(f"  {name:<15} exit {step['exit']}  {step['seconds']:.0f} s")
sys.exit(1 if any(s["exit"] for s in result["steps"].values()) else 0)
EOF
