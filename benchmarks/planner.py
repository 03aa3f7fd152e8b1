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


# Published runs (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md: H100s of 96 GB, seq 8192 unless
# said): (table, model, GPUs, seq, global batch, the mesh and AC mode as published, memory GiB, tokens/s/GPU,
# precision). torchtitan's memory is the peak reserved by the caching allocator (the planner predicts what is
# allocated); runs "+compile" compiled their blocks (planned so: the trainer's --compile inductor); runs marked fp8
# used Float8 linears, which the planner's bf16 roofline does not model.
PUBLISHED = [
    ("T1", "8B", 8, 8192, 16, {"dp": 8}, "selective", 82.4, 5762, "bf16"),
    ("T1", "8B", 8, 8192, 16, {"dp": 8}, "selective", 77.0, 6667, "bf16+compile"),
    ("T3", "8B", 128, 8192, 256, {"dp": 128}, "selective", 67.0, 5605, "bf16"),
    ("T3", "8B", 128, 8192, 256, {"dp": 128}, "selective", 62.0, 6514, "bf16+compile"),
    ("T2", "8B", 8, 32768, 8, {"dp": 8}, "full", 83.9, 3890, "fp8+compile"),
    ("T2", "8B", 8, 262144, 1, {"cp": 8}, "full", 84.5, 548, "fp8+compile"),
    ("T4", "70B", 256, 8192, 512, {"dp": 32, "tp": 8}, "full", 71.9, 829, "fp8+compile"),
    ("T5", "405B", 512, 8192, 256, {"dp": 8, "tp": 8, "pp": 8, "schedule": "Interleaved1F1B"}, "full", 72.7, 128,
     "fp8+compile"),
    # its async-TP benchmark (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, the same machines), the vanilla
    # (synchronous) TP baseline in bf16: what fxshard's tp runs; no memory published
    ("A1", "70B", 256, 8192, 512, {"dp": 32, "tp": 8}, "full", None, 597.3, "bf16+compile"),
    ("A2", "8B", 64, 8192, 96, {"dp": 8, "tp": 8}, "selective", None, 4378, "bf16+compile"),
]


def published_rows(root: str, device: str = "h100-hbm2e", precision: str | None = None) -> list[dict]:
    """Each published run (those in ``precision`` when given) planned with its own mesh, AC mode
    and batch (the constants of the machine it ran on, 96 GiB, bf16; compiled where it was), and
    the planner's own best choice for the same GPUs and batch."""
    from fxshard.planner import plan_parallelism

    rows = []
    for table_, size, world, seq, batch, mesh, ac, gib, tps, published_in in PUBLISHED:
        if precision is not None and published_in != precision:
            continue
        kw = dict(memory_gib=96, seq=seq, global_batch=batch, device=device, dtype="bf16",
                  compiled="compile" in published_in)
        (e, *_) = plan_parallelism(config_dir(size, root), world, candidates=[{**mesh, "activation_checkpointing": ac}], **kw)
        best = plan_parallelism(config_dir(size, root), world, **kw)[0]
        predicted_gib = e.memory.get("total", 0) / 2**30
        rows.append({"run": f"{table_} Llama-3.1-{size}", "gpus": world, "seq": seq, "mesh": e.mesh_spec, "AC": ac,
                     "precision": published_in, "fits": "yes" if e.fits else f"no: {e.reason}", "pub_gib": gib,
                     "pred_gib": predicted_gib, "mem_ratio": predicted_gib / gib if gib else None, "pub_tps": tps,
                     "pred_tps": e.tokens_per_s, "tps_ratio": e.tokens_per_s / tps,
                     "best": f"{best.mesh_spec} {best.activation_checkpointing} accum {best.accum}" if best.fits else "-",
                     "best_tps": best.tokens_per_s if best.fits else 0.0})
    return rows


# Megatron-LM's weak-scaling table (its README's images/model_table.png: GPT models, vocabulary 131,072,
# sequence 4096, H100 SXM, data-parallel size 48): (size, heads, hidden, layers, tp, pp, GPUs, global batch,
# TFLOP/s per GPU).  Its activation recomputation is not published: the fastest mode that fits is planned.
MEGATRON = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def megatron_rows(root: str, device: str = "h100") -> list[dict]:
    """Megatron's GPT runs (HF's GPT-2 architecture at their sizes: learned positions, GELU, dropout
    0.1 as Megatron's defaults) planned with their mesh (interleaved pipeline), the fastest
    activation checkpointing mode that fits, compiled (Megatron runs Transformer Engine's fused
    kernels; fxshard's program fuses its elementwise ops under --compile inductor) and eager;
    their tokens/s from their TFLOP/s by Megatron's own count, 72 l h^2 (1 + s / 6h + V / 12lh)
    FLOPs a token (Narayanan et al., 2021)."""
    from fxshard.planner import plan_parallelism

    rows, seq, vocab = [], 4096, 131072
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON:
        path = os.path.join(root, f"gpt-{size}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=vocab, n_positions=seq,
                           n_embd=hidden, n_layer=layers, n_head=heads, tie_word_embeddings=False), fh)
        mesh = {"tp": tp, "pp": pp, "dp": 48}
        if pp > 1:
            mesh.update(schedule="Interleaved1F1B", microbatches=batch // 48)
        fastest = {}
        for compiled in (True, False):
            entries = plan_parallelism(path, gpus, memory_gib=80, seq=seq, global_batch=batch, device=device,
                                       dtype="bf16", compiled=compiled,
                                       candidates=[{**mesh, "activation_checkpointing": m} for m in ("none", "selective", "full")])
            fastest[compiled] = next((e for e in entries if e.fits), entries[0])
        e, eager = fastest[True], fastest[False]
        per_token = 72 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
        tps = tflops * 1e12 / per_token
        rows.append({"run": f"Megatron GPT {size}", "gpus": gpus, "seq": seq, "mesh": e.mesh_spec,
                     "AC": e.activation_checkpointing, "precision": "bf16", "fits": "yes" if e.fits else f"no: {e.reason}",
                     "pred_gib": e.memory.get("total", 0) / 2**30, "pub_tps": tps, "pred_tps": e.tokens_per_s,
                     "tps_ratio": e.tokens_per_s / tps, "eager_tps": eager.tokens_per_s,
                     "eager_ratio": eager.tokens_per_s / tps})
    return rows


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
    ap.add_argument("--published", action="store_true", help="only the table of published runs")
    ap.add_argument("--published-device", default="h100-hbm2e",
                    help="the constants the published runs are planned with (default: their machine's)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/planner.json)")
    a = ap.parse_args()
    import concurrent.futures
    import multiprocessing

    print(describe_machine())
    results = {}
    with tempfile.TemporaryDirectory() as root:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results["published"] = pool.submit(published_rows, root, a.published_device).result()
            results["megatron"] = pool.submit(megatron_rows, root).result()
        print(f"\nPublished runs (torchtitan, H100 96 GB) planned with their own mesh, AC mode and batch on "
              f"{a.published_device!r}; then the planner's own best for the same GPUs and batch:")
        print(table(results["published"], [("run", "run", ""), ("gpus", "GPUs", "d"), ("seq", "seq", "d"),
                                           ("mesh", "mesh", ""), ("AC", "AC", ""), ("precision", "published in", ""),
                                           ("fits", "fits", ""), ("pub_gib", "published GiB", ".1f"),
                                           ("pred_gib", "predicted GiB", ".1f"), ("mem_ratio", "ratio", ".2f"),
                                           ("pub_tps", "published tokens/s/GPU", ",.0f"),
                                           ("pred_tps", "predicted", ",.0f"), ("tps_ratio", "ratio", ".2f"),
                                           ("best", "planner's best", ""), ("best_tps", "predicted", ",.0f")]))
        print("\nMegatron-LM's GPT weak-scaling runs (H100 SXM, 'h100'; no memory published), their mesh, the "
              "fastest AC mode that fits, compiled (--compile inductor) and eager:")
        print(table(results["megatron"], [("run", "run", ""), ("gpus", "GPUs", "d"), ("mesh", "mesh", ""),
                                          ("AC", "AC", ""), ("fits", "fits", ""), ("pred_gib", "predicted GiB", ".1f"),
                                          ("pub_tps", "published tokens/s/GPU", ",.0f"),
                                          ("pred_tps", "predicted, compiled", ",.0f"), ("tps_ratio", "ratio", ".2f"),
                                          ("eager_tps", "eager", ",.0f"), ("eager_ratio", "ratio", ".2f")]))
        for size in ([] if a.published else a.sizes.split(",")):
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
