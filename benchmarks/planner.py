"""How long ``fxshard.plan_parallelism`` takes on Llama-3-8B, -70B and 3.1-405B, and what it picks.

Each model is planned from its ``config.json`` alone (written here from the published
configuration, vocab 128256) on the meta device, on 64 ranks of 80 GiB (405B: 512; H100 constants),
in a fresh process: ``cold`` is the first call (it imports transformers' Llama code and
exports the first block), ``warm`` a second call in the same process (a new plan, the
imports done).  The best entries are printed, and the meshes torchtitan publishes for the
model beside them (evaluated with ``candidates=``; docs/planning.md discusses them).

    python benchmarks/planner.py                      # 8B, 70B and 405B
    python benchmarks/planner.py --sizes 70B --top 8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, fmt_bytes, table, write_json  # noqa: E402

LLAMA_3 = {  # the published configs
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "405B": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8),
}
WORLD = {"8B": 64, "70B": 64, "405B": 512}  # ranks per model (--world overrides)
# global batch (rows of 8192 tokens) and torchtitan's published meshes for each (docs/planning.md):
# 8B: FSDP over all ranks (docs/performance.md, 64 A100s, local batch 1..2); 70B: FSDP over all ranks with full
# recomputation (docs/performance.md, 64 A100s, local batch 1), and FSDP x TP 8 with full recomputation
# (torchtitan 0.3.0 llama3_70b config: tensor_parallel_degree=8, FullAC, local batch 8)
RUNS = {
    "8B": (128, [{"dp": 64}, {"dp": 64, "activation_checkpointing": True}]),
    "70B": (64, [{"dp": 64, "activation_checkpointing": True}, {"dp": 8, "tp": 8, "activation_checkpointing": True}]),
    # torchtitan's 405B runs: FSDP x TP 8 (its benchmarks/llama3_h100_202412_torchtitan.md), full recomputation
    "405B": (256, [{"dp": 64, "tp": 8, "activation_checkpointing": True}]),
}


def config_dir(size: str, root: str) -> str:
    path = os.path.join(root, f"llama-3-{size.lower()}")
    os.makedirs(path, exist_ok=True)
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, max_position_embeddings=8192,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **LLAMA_3[size])
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return path


def plan_once(path: str, world: int, memory: float, seq: int, batch: int, device: str, compare: list[dict]) -> dict:
    """In a fresh process: the cold and the warm call, the best entries, the published meshes."""
    import fxshard
    from fxshard.planner import plan_parallelism

    out = {}
    for phase in ("cold", "warm"):
        t0, c0 = time.perf_counter(), time.process_time()
        entries = plan_parallelism(path, world, memory_gib=memory, seq=seq, global_batch=batch, device=device)
        out[phase] = time.perf_counter() - t0
        out[phase + "_cpu"] = time.process_time() - c0  # the process's CPU seconds: what a loaded machine's wall hides
    out["candidates"] = len(entries)
    out["fit"] = sum(e.fits for e in entries)
    out["best"] = [_row(e, "planner") for e in entries if e.fits][:12]
    published = fxshard.plan_parallelism(path, world, memory_gib=memory, seq=seq, global_batch=batch, device=device,
                                         candidates=compare)
    out["published"] = [_row(e, "torchtitan") for e in published]
    import resource

    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's whole peak
    return out


def _row(e, source: str) -> dict:
    return {"source": source, "mesh": e.mesh_spec, "accum": e.accum, "M": e.microbatches, "schedule": e.schedule or "-",
            "AC": e.activation_checkpointing if e.activation_checkpointing != "none" else "-", "params": fmt_bytes(e.memory.get("params", 0)),
            "activations": fmt_bytes(e.memory.get("activations", 0)), "total": fmt_bytes(e.memory.get("total", 0)),
            "step_s": e.step_time_s, "tokens_s": e.tokens_per_s, "reason": e.reason or ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B,70B,405B")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 64; 405B: 512)")
    ap.add_argument("--memory", type=float, default=80.0)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/planner.json)")
    a = ap.parse_args()
    import concurrent.futures
    import multiprocessing

    print(describe_machine())
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for size in a.sizes.split(","):
            batch, compare = RUNS[size]
            world = a.world or WORLD[size]
            path = config_dir(size, root)
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                r = pool.submit(plan_once, path, world, a.memory, a.seq, batch, a.device, compare).result()
            results[size] = r
            print(f"\nLlama-3-{size} on {world} x {a.memory:g} GiB ({a.device}), seq {a.seq}, global batch {batch}: "
                  f"planned in {r['cold']:.1f} s cold, {r['warm']:.1f} s warm (CPU {r['cold_cpu']:.1f} s and "
                  f"{r['warm_cpu']:.1f} s; peak resident {r['peak_rss_mib']:.0f} MiB); "
                  f"{r['fit']} of {r['candidates']} fit")
            cols = [("source", "", ""), ("mesh", "mesh", ""), ("accum", "accum", ""), ("M", "M", ""), ("schedule", "schedule", ""), ("AC", "AC", ""),
                    ("params", "params", ""), ("activations", "activations", ""), ("total", "total", ""),
                    ("step_s", "step s", ".2f"), ("tokens_s", "tokens/s/GPU", ",.0f"), ("reason", "", "")]
            print(table(r["best"][:a.top] + r["published"], cols))
    path = write_json("planner", vars(a), results, a.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
