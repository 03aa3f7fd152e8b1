#!/usr/bin/env bash
# The GPU checks of fxshard, for one CUDA machine (a single GPU is enough), in about 9 minutes.
#
#   bash benchmarks/gpu.sh              # everything -> $OUT/*.log, *.json, status.tsv and $OUT/../gpu.json
#   bash benchmarks/gpu.sh --dry-run    # print the steps and their time limits, run nothing
#   NPROC=2 bash benchmarks/gpu.sh      # NCCL runs on 2 GPUs instead of 1
#   STEPS="simulated_cuda cuda_tests" bash benchmarks/gpu.sh   # some of the steps
#
# Steps (each is logged and stopped at its time limit; a failing step is recorded and the others
# still run), run most wanted first: trainer, nccl_demo, simulated_cuda, cuda_tests, compile_time,
# step_time:
#   1. compile_time   the sharded 16-layer Llama compiled whole vs one graph per block
#                     (fxshard.compile), inductor (Triton kernels) and aot_eager, each run a fresh
#                     torchrun with the caches off (benchmarks/compile_time.py --device cuda)
#   2. nccl_demo      the main job on NCCL at world size NPROC (torchrun): dump, train, compare
#                     with one device, then the step-time comparison of the demo model
#                     (eager, aot_eager, inductor)
#   3. simulated_cuda 4 simulated ranks (LocalTensorMode) on the GPU: sharded loss == one-device
#                     loss before and after an SGD step (Llama dense, Llama and GPT-2 SP + loss parallel)
#   4. cuda_tests     the tests that need CUDA (skipped on CPU machines), with pytest
#   5. step_time      fxshard vs DTensor vs hand-written Megatron on NCCL at a realistic hidden
#                     size (dim 4096, ffn 14336, vocab 32768, batch 4 x 1024 tokens, fp32), eager
#                     and inductor
#   6. trainer        python -m fxshard train against the plain HF + AdamW loop on the same
#                     checkpoint and text (bf16, hidden 1024 x 8 layers, 8 x 1024 tokens):
#                     tokens/s, the ratio (>= 0.97 wanted) and MFU, and the planner's predicted peak
#                     memory against max_memory_allocated (within 15% wanted) (benchmarks/trainer.py)
# Everything lands in one JSON file, $OUT/../gpu.json (per step: command, exit status, seconds,
# log tail, and the step's own results JSON).  The machine's own python3 and torch are used.
set -u -o pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}
OUT=${OUT:-benchmarks/results/gpu}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
TORCHRUN=(python -m torch.distributed.run --standalone --nproc-per-node "$NPROC")

read -r -a STEPS <<< "${STEPS:-trainer nccl_demo simulated_cuda cuda_tests compile_time step_time}"
declare -A CMD LIMIT
CMD[compile_time]="python benchmarks/compile_time.py --device cuda --world $NPROC --backends ${COMPILE_BACKENDS:-inductor,aot_eager} --out $OUT/compile_time.json"
CMD[cuda_tests]="python -m pytest -q -p no:cacheprovider -m cuda $(grep -rl 'pytest.mark.cuda' tests | sort | tr '\n' ' ')"
LIMIT[compile_time]=260
LIMIT[nccl_demo]=100
LIMIT[simulated_cuda]=60
LIMIT[cuda_tests]=90
LIMIT[step_time]=140
LIMIT[trainer]=150
CMD[trainer]="python benchmarks/trainer.py --device cuda --bf16 --hidden 1024 --layers 8 --heads 16 --vocab 8192 --seq 1024 --batch 8 --steps 20 --warmup 5 --repeats 2 --out $OUT/trainer.json"
CMD[nccl_demo]="${TORCHRUN[*]} -m fxshard demo --steps 5 --bench --bench-modes eager,aot_eager,inductor --bench-iters 20"
CMD[simulated_cuda]="python benchmarks/device_equivalence.py --device cuda --tp 4 --out $OUT/simulated_cuda.json"
CMD[step_time]="${TORCHRUN[*]} benchmarks/step_time.py --device cuda --sizes gpu --modes eager,inductor --iters 10 --warmup 3 --no-plot --quiet --out $OUT/step_time.json"

if [ "$DRY" = 1 ]; then
  for s in "${STEPS[@]}"; do echo "$s (${LIMIT[$s]} s): ${CMD[$s]}"; done
  exit 0
fi

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "benchmarks/gpu.sh: no CUDA device visible to torch ($(python -c 'import torch; print(torch.__version__)'))" >&2
  exit 1
fi
nvidia-smi -L || true
mkdir -p "$OUT"
# fxshard.passes lives in passes/ (pyproject maps it). On a bare checkout, rather than rely on
# the machine's setuptools for an editable install (an old one adds the checkout to sys.path,
# which cannot express the mapping), link passes/ under fxshard/ for this run.
LINKED=0
if ! python -c "import fxshard.passes" 2>/dev/null; then
  ln -s ../passes fxshard/passes && LINKED=1
  trap '[ "$LINKED" = 1 ] && rm -f fxshard/passes' EXIT
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import fxshard.passes, networkx" || exit 1
: > "$OUT/status.tsv"
for s in "${STEPS[@]}"; do
  echo "=== $s: ${CMD[$s]}"
  t0=$SECONDS
  # shellcheck disable=SC2086  # the command is a word list on purpose
  timeout --kill-after=10 "${LIMIT[$s]}" ${CMD[$s]} > "$OUT/$s.log" 2>&1
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
