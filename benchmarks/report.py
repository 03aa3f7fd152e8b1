"""The "Performance" section of docs/performance.md, in Markdown, from the latest results files.

    python benchmarks/report.py                 # reads benchmarks/results/*.json, prints Markdown
    bash benchmarks/run_all.sh                  # runs every benchmark, then this

A benchmark whose results file is missing is listed as not run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe_machine, fmt_bytes  # noqa: E402


def _load(results_dir: Path, name: str):
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def step_time_section(p) -> str:
    rows = p["results"]["rows"]
    by = {}
    for r in rows:
        by.setdefault((r["size"], r["mode"]), {})[r["contender"]] = r
    sizes = {s["name"]: s for s in p["config"]["sizes"]}
    lines = [f"**Step time** (forward, cross-entropy, backward, SGD; tp={p['config']['tp']} gloo ranks, one thread each; "
             f"median of the timed steps, contenders alternating; `{p['command']}`):", ""]
    body = []
    for (size, mode), c in by.items():
        def ms(name):
            r = c.get(name, {})
            return f"{r['median_ms']:.1f}" if "median_ms" in r else "skipped"

        def ratio(a, b):
            ra, rb = c.get(a, {}), c.get(b, {})
            return f"**{ra['median_ms'] / rb['median_ms']:.2f}**" if "median_ms" in ra and "median_ms" in rb else "-"

        ok = all(r.get("max_loss_diff", 0) <= 1e-4 for r in c.values() if "median_ms" in r)
        body.append([size, mode, ms("megatron"), ms("fxshard"), ms("dtensor"), ratio("fxshard", "megatron"),
                     ratio("fxshard", "dtensor"), "yes" if ok else "NO"])
    lines.append(_md_table(["size", "mode", "hand-written ms", "fxshard ms", "DTensor ms", "fxshard / hand-written",
                            "fxshard / DTensor", "losses equal"], body))
    lines += ["", _ratio_summary(p["results"]["ratios"]), ""]
    for name, s in sizes.items():
        lines.append(f"- `{name}`: Llama dim {s['dim']}, {s['n_layers']} layers, {s['n_heads']}/{s['n_kv_heads']} heads, "
                     f"ffn {s['ffn_hidden']}, vocab {s['vocab_size']}, batch {s['batch']}x{s['seqlen']}; "
                     f"{s['iters']} timed steps per contender and mode")
    prof = [(size, mode, c) for (size, mode), c in by.items() if any("profile_cpu_ms" in r for r in c.values())]
    if prof:
        lines += ["", "Where the time goes (`--profile`: torch.profiler, self CPU ms per step on rank 0, outside collectives "
                      "= compute and framework overhead / inside = mostly waiting for the peer rank):", ""]
        def cpu(c, name):
            r = c.get(name, {})
            return f"{r['profile_cpu_ms']:.2f} / {r['profile_comm_ms']:.2f}" if "profile_cpu_ms" in r else "-"
        lines.append(_md_table(["size", "mode", "hand-written", "fxshard", "DTensor"],
                               [[size, mode, cpu(c, "megatron"), cpu(c, "fxshard"), cpu(c, "dtensor")] for size, mode, c in prof]))
    skipped = {(r["mode"], r["contender"]): r["skipped"] for r in rows if "skipped" in r}
    for (mode, name), why in skipped.items():
        lines.append(f"- skipped {name} under {mode}: {why}")
    return "\n".join(lines)


def step_time_fsdp_section(p) -> str:
    """``step_time.py --model llama-fsdp``: fxshard + FSDP2 vs DTensor TP + FSDP2 on dp x tp."""
    by = {}
    for r in p["results"]["rows"]:
        by.setdefault((r["size"], r["mode"]), {})[r["contender"]] = r
    world = p["config"]["tp"]
    lines = [f"**Step time on dp x tp = 2 x {world // 2}** (FSDP2 over dp; {world} gloo ranks, one thread each; each rank "
             f"steps on its dp half of the batch; `{p['command']}`):", ""]
    body = []
    for (size, mode), c in by.items():
        theirs, ours = c.get("dtensor", {}), c.get("fxshard", {})
        if "median_ms" not in theirs or "median_ms" not in ours:
            body.append([size, mode, "skipped", "skipped", "-", "-"])
            continue
        ok = all(r.get("max_loss_diff", 0) <= 1e-4 for r in c.values())
        body.append([size, mode, f"{theirs['median_ms']:.1f}", f"{ours['median_ms']:.1f}",
                     f"**{ours['median_ms'] / theirs['median_ms']:.2f}**", "yes" if ok else "NO"])
    lines.append(_md_table(["size", "mode", "DTensor TP + FSDP2 ms", "fxshard + FSDP2 ms", "fxshard / DTensor",
                            "losses equal"], body))
    return "\n".join(lines)


def _ratio_summary(ratios: list[dict]) -> str:
    """``fxshard / hand-written 1.00-1.05 (small), ...`` per size, over the modes."""
    parts = []
    for key, label in (("fxshard_vs_megatron", "fxshard / hand-written"), ("fxshard_vs_dtensor", "fxshard / DTensor")):
        per_size = {}
        for r in ratios:
            if r.get(key) is not None:
                per_size.setdefault(r["size"], []).append(r[key])
        spans = [f"{min(v):.2f}-{max(v):.2f} ({size})" if min(v) != max(v) else f"{v[0]:.2f} ({size})"
                 for size, v in per_size.items()]
        parts.append(f"{label}: " + ", ".join(spans))
    return "Ratios of median step times over the modes: " + "; ".join(parts) + "."


def communication_section(p) -> str:
    rows = p["results"]
    by = {}
    for r in rows:
        by.setdefault(r["case"], {})[r["contender"]] = r
    lines = [f"**Communication per training step** (tp={p['config']['tp']}, simulated ranks; the MoE case on "
             f"ep={p['config']['tp']} gloo ranks; calls, and bytes each rank sends with ring algorithms; `{p['command']}`):", ""]

    def cell(r):
        if r is None or "total" not in r:
            return "n/a"
        return f"{r['total']} ({r['by_kind']}), {r['wire']}"

    body = [[case, cell(c.get("fxshard")), cell(c.get("dtensor")), cell(c.get("minimum")),
             f"{c['fxshard']['wire_vs_min']:.2f}" if c.get("fxshard", {}).get("wire_vs_min") else "-"]
            for case, c in by.items()]
    lines.append(_md_table(["case", "fxshard", "DTensor", "Megatron minimum", "fxshard wire / minimum"], body))
    return "\n".join(lines)


def transform_section(p) -> str:
    res = p["results"]
    body = [[str(r["layers"]), str(r["traced_nodes"]), str(r["nodes"]), f"{r['trace_cpu_s']:.3f}",
             f"{r['transform_cpu_s']:.3f}", f"{r['total_cpu_s']:.3f}", f"{r['total_cpu_gc_s']:.3f}"] for r in res["rows"]]
    lines = [f"**Transform time** (`fxshard.trace` + `fxshard.transform`, Llama dim 64, MeshSpec tp={p['config']['tp']}, "
             f"CPU seconds, best of {p['config']['repeats']}; `{p['command']}`):", "",
             _md_table(["layers", "nodes traced", "nodes after", "trace", "transform", "total", "total, GC on"], body)]
    g = res.get("growth")
    if g:
        worst = max(g["passes_gc"].items(), key=lambda kv: kv[1])
        lines += ["", f"Growth {g['large']}/{g['small']} layers (linear: x{g['large'] / g['small']:.2f}): nodes x{g['nodes']:.2f}, "
                      f"CPU time x{g['total_cpu_s']:.2f} (trace x{g['trace_cpu_s']:.2f}, transform x{g['transform_cpu_s']:.2f}) "
                      f"with Python's cyclic GC off; x{g['total_cpu_gc_s']:.2f} with it on, where a full collection of the "
                      f"heap lands in one pass ({worst[0]} x{worst[1]:.2f})."]
    meta = res.get("hf_llama_meta")
    if meta:
        body = [[r["model"], f"{r['params'] / 1e9:.1f} B", str(r["captured_nodes"]), f"{r['capture_s']:.1f}",
                 f"{r['transform_s']:.2f}", f"{r['total_s']:.1f}", f"{r['total_cpu_s']:.1f}",
                 f"{r['plain_export_s']:.1f}" if "plain_export_s" in r else "n/a",
                 f"{r['vs_plain_export']:.2f}" if "vs_plain_export" in r else "n/a",
                 fmt_bytes(r["peak_rss"]), fmt_bytes(r["bf16_bytes"])]
                for r in meta]
        lines += ["", f"**Capture + transform on the meta device** (HF `LlamaForCausalLM`, Llama-3 configs; `Plan.from_hf`, "
                      f"offline `MeshSpec` tp={meta[0]['tp']}; each in a fresh process; wall seconds; peak RSS is the "
                      f"whole process, Python and libraries included; `{p['command']}`):", "",
                  _md_table(["model", "parameters", "nodes captured", "capture s", "transform s", "total s", "total CPU s",
                             "plain torch.export s", "total / plain export", "peak RSS", "bf16 weights (never allocated)"], body)]
        lines += [""] + [f"- {r['model']}: {r['capture_blocks']}" for r in meta if r.get("capture_blocks")]
    return "\n".join(lines)


def checkpoint_section(p) -> str:
    res = p["results"]
    (r,) = res["rows"]
    lines = [f"**Checkpoint load** (HF Llama, hidden {res['hidden']}, {res['layers']} layers, {r['params'] / 1e9:.2f} B "
             f"parameters in bf16, {fmt_bytes(r['checkpoint_bytes'])} in {r['files']} safetensors files, loaded at "
             f"tp={r['tp']} gloo ranks into a model built on the meta device: `transform`, `materialize(init=None)`, "
             f"`load_hf_checkpoint`; per rank, max over ranks; `{p['command']}`):", "",
             _md_table(["shards per rank", "peak private memory growth", "x checkpoint", "file pages touched (page cache)",
                        "materialize + load s"],
                       [[fmt_bytes(r["local"]), fmt_bytes(r["anon"]), f"{r['anon_vs_checkpoint']:.3f}", fmt_bytes(r["file"]),
                         f"{r['load_s']:.2f}"]]),
             "", f"Each rank's private memory grows by {r['anon_vs_checkpoint']:.3f} of the checkpoint (1/tp = "
                 f"{1 / r['tp']:.3f}): its shards, and no full tensor."]
    return "\n".join(lines)


def memory_section(p) -> str:
    c = p["config"]
    rows = {r["variant"]: r for r in p["results"]}
    body = [[v, str(r["ranks"]), fmt_bytes(r["param_bytes"]), fmt_bytes(r["peak_bytes"]), f"{r['peak_vs_gathered']:.2f}"]
            for v, r in rows.items()]
    lp = rows.get("loss parallel")
    lines = [f"**Memory per rank** (WithLoss(Llama) dim {c['dim']}, vocab {c['vocab']}, batch {c['batch']}x{c['seqlen']}, "
             f"tp={c['tp']}; peak of a forward+backward from torch.profiler CPU allocator events; `{p['command']}`):", "",
             _md_table(["variant", "ranks", "parameters", "peak", "peak / gathered"], body)]
    if lp:
        lines += ["", f"Loss parallel needs {lp['peak_vs_gathered']:.2f} of the gathered-logits peak at tp={c['tp']} "
                      f"(1/tp = {1 / c['tp']:.2f})."]
    return "\n".join(lines)


SECTIONS = (("step_time", step_time_section), ("step_time_fsdp", step_time_fsdp_section), ("communication", communication_section),
            ("transform_time", transform_section), ("memory", memory_section), ("memory_checkpoint", checkpoint_section))


def report(results_dir: Path = RESULTS) -> str:
    loaded = {name: _load(results_dir, name) for name, _ in SECTIONS}
    machine = next((p["machine"] for p in loaded.values() if p), None)
    when = max((p["time"] for p in loaded.values() if p), default="-")
    parts = ["## Performance", "",
             f"Measured {when} on {describe_machine(machine) if machine else 'this machine'}. The machine was shared "
             "with other jobs: step times are medians of interleaved runs, but expect a few percent of noise. "
             "Reproduce everything with `bash benchmarks/run_all.sh` (about 5 minutes on 2 cores); "
             "`python -m fxshard demo --bench` prints the step-time comparison of the demo model.", ""]
    for name, section in SECTIONS:
        p = loaded[name]
        parts += [section(p) if p else f"_{name}: not run (`python benchmarks/{name}.py`)_", ""]
    return "\n".join(parts).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS), help="folder of the results files")
    p.add_argument("--out", default=None, help="also write the Markdown here")
    args = p.parse_args(argv)
    text = report(Path(args.results))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
