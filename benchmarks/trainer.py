"""Is ``python -m fxshard train`` as fast as the plain loop a user would write?

The same checkpoint, the same text and batches, AdamW and clipping at one rank:

* ``plain``: the HF model from ``from_pretrained``, ``F.cross_entropy`` on its logits,
  ``clip_grad_norm_``, ``AdamW.step`` (optionally ``torch.compile``d, under bf16 autocast);
* ``trainer``: ``python -m fxshard train`` on one process with the same flags, its own
  ``tokens_per_s`` from ``metrics.jsonl`` (what the trainer reports to users).

Both are timed per step (the data read included), the first ``--warmup`` steps left out; the
median of the rest is taken per run, the best of ``--repeats`` alternated runs is kept for each
loop, and printed with the ratio trainer / plain and, on a GPU, the MFU. A third row runs the
trainer's step and the plain step in one process, one of each in turn: what the trainer adds
per step, apart from the load of a shared machine drifting between runs.  Last, the planner's
prediction of the run's peak memory (``fxshard.plan_parallelism`` on the same checkpoint, batch
and dtype, one rank) against the trainer's measured peak (on a GPU ``max_memory_allocated``; on a
CPU the resident set, which holds the interpreter and libraries too: shown, not compared).

    python benchmarks/trainer.py                                        # CPU, a small Llama
    python benchmarks/trainer.py --device cuda --hidden 1024 --layers 8 --seq 1024 --batch 8 --bf16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from common import ROOT, describe_machine, table, write_json

TEXT = ROOT / "examples" / "data" / "genesis.txt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", default=None, metavar="BACKEND")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each loop, alternated; the best median is kept (a shared CPU's load comes and goes)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def make_checkpoint(args, root: str) -> str:
    from fxshard.testing.hf_checkpoints import make_hf_checkpoint

    return str(make_hf_checkpoint(os.path.join(root, "model"), args.model, text_files=[str(TEXT)], vocab_size=args.vocab,
                                  hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  num_key_value_heads=args.heads // 2, intermediate_size=4 * args.hidden,
                                  max_position_embeddings=max(64, args.seq), head_dim=args.hidden // args.heads))


def plain_loop(args, ckpt: str, cache: str) -> list[float]:
    """Seconds per step of the loop a user writes around the HF model."""
    from transformers import AutoModelForCausalLM

    from fxshard.trainer.data import PackedTokens, TextBatches, load_tokenizer

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").to(device).train()
    tokenizer = load_tokenizer(ckpt, model.config.vocab_size)
    batches = TextBatches(PackedTokens.from_files([str(TEXT)], tokenizer, args.seq, cache_dir=cache), args.batch)
    step_fn = torch.compile(model, backend=args.compile) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids, labels = (t.to(device) for t in batches.next_batch())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = step_fn(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def interleaved(args, ckpt: str, cache: str) -> tuple[list[float], list[float]]:
    """Seconds per step of the trainer's own step (``fxshard.trainer.loop.Run.train_step``) and of
    the plain loop on an identical copy of its model, in one process, one step of each in turn
    (which goes first alternates): the per-step overhead, apart from the load drifting between runs."""
    import copy

    from fxshard.trainer.arguments import add_train_arguments
    from fxshard.trainer.loop import Run

    flags = ["--model", ckpt, "--data", str(TEXT), "--steps", str(10 * args.steps), "--batch", str(args.batch),
             "--seq", str(args.seq), "--data-cache", cache, "--device", args.device, "--lr", "3e-3", "--clip", "1.0"]
    run = Run(add_train_arguments(argparse.ArgumentParser()).parse_args(flags + (["--bf16"] if args.bf16 else [])))
    run.setup()
    device = torch.device(args.device)
    model = copy.deepcopy(run.module)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def plain_step():
        ids, labels = (t.to(device) for t in run.batches.next_batch())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=ids).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    plain, trainer = [], []
    for i in range(args.steps):
        first, second = (plain_step, run.train_step) if i % 2 else (run.train_step, plain_step)
        a, b = timed(first), timed(second)
        plain.append(a if first is plain_step else b)
        trainer.append(b if first is plain_step else a)
    return plain, trainer


def trainer_run(args, ckpt: str, cache: str, logs: str) -> list[dict]:
    """``python -m fxshard train`` on one process; its metrics records."""
    cmd = [sys.executable, "-m", "fxshard", "train", "--model", ckpt, "--data", str(TEXT), "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq", str(args.seq), "--data-cache", cache, "--log-dir", logs,
           "--device", args.device, "--lr", "3e-3", "--clip", "1.0"]
    cmd += ["--bf16"] if args.bf16 else []
    cmd += ["--compile", args.compile] if args.compile else []
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    with open(os.path.join(logs, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "eval_loss" not in line]


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        ckpt, cache = make_checkpoint(args, root), os.path.join(root, "tokens")
        tokens = args.batch * args.seq
        plain_runs, trainer_runs = [], []
        for k in range(args.repeats):  # alternated, so both see the same load; plain first: it fills the token cache
            plain_runs.append(tokens / statistics.median(plain_loop(args, ckpt, cache)[args.warmup:]))
            records = trainer_run(args, ckpt, cache, os.path.join(root, f"logs{k}"))[args.warmup:]
            trainer_runs.append((statistics.median(r["tokens_per_s"] for r in records), records))
        plain_steps, trainer_steps = interleaved(args, ckpt, cache)
        memory = planned_memory(args, ckpt, max(r["peak_mem_gib"] for r in records))
    plain_tps = max(plain_runs)
    trainer_tps, records = max(trainer_runs, key=lambda run: run[0])
    plain_s, trainer_s = statistics.median(plain_steps[args.warmup:]), statistics.median(trainer_steps[args.warmup:])
    print(f"tokens/s per run: plain {[round(x) for x in plain_runs]}, trainer {[round(x) for x, _ in trainer_runs]}")
    print(f"in one process, a step of each in turn: plain {plain_s * 1e3:.1f} ms, trainer {trainer_s * 1e3:.1f} ms per step "
          f"(trainer / plain throughput {plain_s / trainer_s:.3f})")
    mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
    rows = [{"loop": "plain HF + AdamW", "tokens_per_s": plain_tps, "ratio": 1.0},
            {"loop": "python -m fxshard train", "tokens_per_s": trainer_tps, "ratio": trainer_tps / plain_tps,
             "tflops": statistics.median(r["tflops"] for r in records),
             "mfu": statistics.median(mfu) if mfu else None},
            {"loop": "trainer step, interleaved in one process", "tokens_per_s": tokens / trainer_s,
             "ratio": plain_s / trainer_s}]
    print(f"{args.model} hidden {args.hidden} x {args.layers} layers, batch {args.batch} x {args.seq} tokens, "
          f"{args.device}{', bf16' if args.bf16 else ''}{', compile ' + args.compile if args.compile else ''}; "
          f"median of steps {args.warmup + 1}-{args.steps}; {describe_machine()}")
    print(table(rows, [("loop", "loop", ""), ("tokens_per_s", "tokens/s", ",.0f"), ("ratio", "trainer / plain", ".3f"),
                       ("tflops", "TFLOPs", ".3f"), ("mfu", "MFU", ".1%")]))
    print(f"peak memory: predicted {memory['predicted_gib']:.3f} GiB ({memory['parts']}), measured "
          f"{memory['measured_gib']:.3f} GiB ({memory['measured_as']}), ratio {memory['ratio']:.2f}")
    write_json("trainer", vars(args), {"loops": rows, "memory": memory}, args.out)


def planned_memory(args, ckpt: str, measured_gib: float) -> dict:
    """The planner's predicted peak for this run (one rank, the trainer's dtype) beside the measured one."""
    from fxshard.planner import plan_parallelism

    (e,) = plan_parallelism(ckpt, 1, memory_gib=1e6, seq=args.seq, global_batch=args.batch,
                            device="cpu" if args.device == "cpu" else None, dtype="bf16" if args.bf16 else "fp32",
                            candidates=[{}])
    predicted = e.memory["total"] / 2**30
    return {"predicted_gib": predicted, "measured_gib": measured_gib, "ratio": predicted / measured_gib,
            "measured_as": "max_memory_allocated" if args.device.startswith("cuda") else "resident set (not comparable)",
            "parts": ", ".join(f"{k} {v / 2**30:.3f}" for k, v in e.memory.items() if k != "total")}


if __name__ == "__main__":
    main()
