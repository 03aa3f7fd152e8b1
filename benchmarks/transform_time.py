"""Transform time: ``fxshard.trace`` + ``fxshard.transform`` wall time and node count
for Llama at 2, 8, 32 and 64 layers (offline ``MeshSpec``, tp=4), and capture +
transform of HF Llama with the Llama-3-8B and -70B configs on the meta device
(``MeshSpec`` tp=8), each in a fresh process with its peak resident memory.

Times are best-of-``--repeats``, CPU time of this process (robust to other jobs on a
shared machine; the growth ratios use it) and wall clock, each run after a
``gc.collect()``, twice: with Python's cyclic GC off (the intrinsic cost, as ``timeit``
measures it) and on (what a user waits).  The difference matters: a full GC collection
scans every live object -- thousands of fx nodes with their metadata, fake tensors -- and
lands in whichever pass crosses the threshold, so with the GC on one pass can look
superlinear (measured: normalize x5.3 from 32 to 64 layers with the GC on, x2.1 with it
off; the whole transform x2.07 with it off).  The cost should grow linearly with the number of layers: the growth ratio from 32 to
64 layers should be ~2 (as the node count's).  Each pass of the pipeline is timed
separately (``fxshard.transform(..., timings=)``: wall time per pass of its ``PIPELINE``,
by name), so a superlinear pass shows up by name; ``--profile``
adds a cProfile of the largest transform.

    python benchmarks/transform_time.py
    python benchmarks/transform_time.py --layers 2,8,32,64,128 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe_machine, fmt_bytes, pyplot, save_plot, table, write_json  # noqa: E402

import fxshard  # noqa: E402
from fxshard import MeshSpec, Plan  # noqa: E402
from fxshard.meta import program_meta  # noqa: E402
from fxshard.testing.models import llama, llama_plan, tokens  # noqa: E402

def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _trace_and_transform(model, plan: Plan, ids, gc_on: bool):
    """One timed trace + transform from a clean heap; GC off (as ``timeit`` does) unless ``gc_on``."""
    per_pass: dict[str, float] = defaultdict(float)
    gc.collect()  # the garbage of earlier runs must not bill this one
    if not gc_on:
        gc.disable()
    try:
        w0, c0 = _clocks()
        gm = fxshard.trace(model, plan, (ids,))
        w1, c1 = _clocks()
        sharded = fxshard.transform(gm, plan, timings=per_pass)  # wall time per pass, by name ("capture": the copy)
        w2, c2 = _clocks()
    finally:
        gc.enable()
    times = dict(trace_s=w1 - w0, trace_cpu_s=c1 - c0, transform_s=w2 - w1, transform_cpu_s=c2 - c1)
    return gm, sharded, times, dict(per_pass)


def measure(n_layers: int, plan: Plan, ids, repeats: int) -> dict:
    """Best-of-``repeats`` wall and CPU times of trace and transform, with Python's cyclic
    GC off (the intrinsic cost, as ``timeit`` measures) and on (what a user waits)."""
    model = llama(n_layers=n_layers, n_heads=8, n_kv_heads=4)
    t = defaultdict(list)
    passes, passes_gc = [], []
    for _ in range(repeats):
        gm, sharded, times, per_pass = _trace_and_transform(model, plan, ids, gc_on=False)
        for k, v in times.items():
            t[k].append(v)
        passes.append(per_pass)
        del gm, sharded
        gm, sharded, times, per_pass = _trace_and_transform(model, plan, ids, gc_on=True)
        for k, v in times.items():
            t[k.replace("_s", "_gc_s")].append(v)
        passes_gc.append(per_pass)
        nodes = (len(gm.graph.nodes), len(sharded.graph.nodes))
        del gm, sharded
    best = {k: min(v) for k, v in t.items()}
    return dict(layers=n_layers, traced_nodes=nodes[0], nodes=nodes[1], **best,
                total_s=best["trace_s"] + best["transform_s"], total_cpu_s=best["trace_cpu_s"] + best["transform_cpu_s"],
                total_gc_s=best["trace_gc_s"] + best["transform_gc_s"],
                total_cpu_gc_s=best["trace_cpu_gc_s"] + best["transform_cpu_gc_s"],
                passes_s={p: min(run[p] for run in passes) for p in passes[0]},
                passes_gc_s={p: min(run[p] for run in passes_gc) for p in passes_gc[0]})


TIMES = ("trace_s", "transform_s", "total_s", "trace_cpu_s", "transform_cpu_s", "total_cpu_s",
         "trace_cpu_gc_s", "transform_cpu_gc_s", "total_cpu_gc_s", "total_gc_s")


def growth(rows: list[dict], small: int, large: int) -> dict:
    """Ratios large/small of times and node counts (and of each pass's CPU time)."""
    a = next(r for r in rows if r["layers"] == small)
    b = next(r for r in rows if r["layers"] == large)
    out = {k: b[k] / a[k] for k in TIMES + ("nodes", "traced_nodes")}
    out["passes"] = {p: b["passes_s"][p] / a["passes_s"][p] for p in b["passes_s"] if a["passes_s"].get(p)}
    out["passes_gc"] = {p: b["passes_gc_s"][p] / a["passes_gc_s"][p] for p in b["passes_gc_s"] if a["passes_gc_s"].get(p)}
    return out


def profile_transform(n_layers: int, plan: Plan, ids, top: int = 25) -> str:
    gm = fxshard.trace(llama(n_layers=n_layers, n_heads=8, n_kv_heads=4), plan, (ids,))
    prof = cProfile.Profile()
    prof.enable()
    fxshard.transform(gm, plan)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def plot(rows):
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    xs = [r["layers"] for r in rows]
    for key, label in (("trace_cpu_s", "trace"), ("transform_cpu_s", "transform"), ("total_cpu_s", "total"),
                       ("total_cpu_gc_s", "total, GC on")):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    last = rows[-1]
    ax.plot(xs, [last["total_cpu_s"] * x / last["layers"] for x in xs], ls="--", color="grey", lw=0.8, label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("CPU seconds (best of repeats)")
    ax.set_title("fxshard trace + transform, Llama, tp=4")
    ax.legend(fontsize=8)
    path = save_plot(fig, "transform_time")
    plt.close(fig)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="2,8,32,64", help="comma-separated layer counts")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="best-of repeats per layer count")
    p.add_argument("--profile", action="store_true", help="cProfile the transform of the largest model")
    p.add_argument("--out", default=None)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-hf", action="store_true", help="skip the HF Llama-3-8B/70B (meta device) capture + transform")
    p.add_argument("--hf-sizes", default="8B,70B", help="Llama-3 configs captured on the meta device")
    p.add_argument("--no-plain-export", action="store_true", help="skip the yardstick: a plain torch.export of each HF model")
    return p.parse_args(argv)


LLAMA_3 = {  # the published configs (hidden, intermediate, layers, heads, kv heads)
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}


def measure_hf_llama_meta(size: str = "8B", tp: int = 8, repeats: int = 1, plain_export: bool = True) -> dict | None:
    """Capture (torch.export) + transform of HF ``LlamaForCausalLM`` with a Llama-3 config
    (vocab 128256) built on the meta device, ``Plan.from_hf`` on an offline ``MeshSpec``
    tp=8.  Runs in a fresh process, so that its peak resident memory (``ru_maxrss``) is
    this model's alone: no parameter is ever materialized."""
    import concurrent.futures
    import multiprocessing

    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_hf_llama_meta, size, tp, repeats, plain_export).result()


def _hf_llama_meta(size: str, tp: int, repeats: int, plain_export: bool = True) -> dict:
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, **LLAMA_3[size])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    kwargs = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    plan = Plan.from_hf(MeshSpec(("tp",), (tp,)), model)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = {}
    for _ in range(repeats):
        gc.collect()
        w0, c0 = _clocks()
        gm = fxshard.trace(model, plan, example_kwargs=kwargs)
        w1, c1 = _clocks()
        sharded = fxshard.transform(gm, plan)
        w2, c2 = _clocks()
        run = dict(capture_s=w1 - w0, capture_cpu_s=c1 - c0, transform_s=w2 - w1, transform_cpu_s=c2 - c1,
                   total_s=w2 - w0, total_cpu_s=c2 - c0)
        best = {k: min(v, best.get(k, v)) for k, v in run.items()}
    assert all(t.is_meta for t in sharded.parameters()), "a parameter was materialized"
    note = program_meta(gm).capture_blocks or ""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the yardstick below
    # the yardstick: a plain non-strict torch.export of the same model, batch and sequence dynamic
    from torch.export import Dim

    model.config.use_cache = False
    export_s = float("nan")
    if plain_export:
        w0, _ = _clocks()
        torch.export.export(model, (), kwargs, strict=False, dynamic_shapes={"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}})
        export_s = _clocks()[0] - w0
    return dict(model=f"HF Llama-3-{size} config (meta)", params=n_params, tp=tp, layers=config.num_hidden_layers,
                captured_nodes=len(gm.graph.nodes), nodes=len(sharded.graph.nodes), peak_rss=peak, capture_blocks=note,
                plain_export_s=export_s, vs_plain_export=best["total_s"] / export_s,
                rss_before=rss_before, bf16_bytes=2 * n_params, **best)


def measure_gemma3_startup(mesh: str) -> dict | None:
    """Start-up under context parallelism: capture + transform of a small HF Gemma3 (12
    layers, sliding window 512: the real models' window) for ``mesh`` ("tp=2", "cp=2",
    "cp=2,tp=2") on an offline ``MeshSpec``, in a fresh process with its peak memory.  The
    window once set the cost of capture under cp (a traced scalar op per mask grid point:
    417 s and 5x the memory of tp for a user's Gemma3); the cp rows should match tp's."""
    import concurrent.futures
    import multiprocessing

    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_gemma3_startup, mesh).result()


def _gemma3_startup(mesh: str) -> dict:
    import resource

    import torch
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    from fxshard.plan.specs import context_parallel
    from fxshard.testing.hf_tiny import tiny_config

    sizes = dict(part.split("=") for part in mesh.split(","))
    spec = MeshSpec(tuple(sizes), tuple(int(n) for n in sizes.values()))
    cfg = tiny_config("gemma3_text", num_hidden_layers=12, sliding_window=512, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    plan = Plan.from_hf(spec, model) if "tp" in sizes else Plan(spec, {})
    if "cp" in sizes:
        plan = Plan(spec, {**plan.specs, "model.layers.*.self_attn": context_parallel("cp")},
                    inputs={"input_ids": {"cp": Shard(1)}})
    w0, c0 = _clocks()
    fxshard.transform(model, plan, example_kwargs={"input_ids": torch.zeros(2, 64, dtype=torch.long)})
    w1, c1 = _clocks()
    return dict(model="HF Gemma3 (12 layers, window 512)", mesh=mesh, total_s=w1 - w0, total_cpu_s=c1 - c0,
                peak_h=fmt_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def main(argv=None) -> int:
    args = parse_args(argv)
    layers = sorted(int(x) for x in args.layers.split(",") if x)
    plan = Plan(MeshSpec(("tp",), (args.tp,)), llama_plan("tp"))
    ids = tokens(2, 8, 128)
    fxshard.transform(llama(n_layers=1, n_heads=8, n_kv_heads=4), plan, (ids,))  # warm-up: imports, caches
    rows = [measure(n, plan, ids, args.repeats) for n in layers]
    print(f"transform time: fxshard.trace + fxshard.transform of Llama (dim 64, 8/4 heads), MeshSpec tp={args.tp}, "
          f"best of {args.repeats}")
    print(f"machine: {describe_machine()}\n")
    print("CPU seconds of this process; 'gc on': Python's cyclic GC enabled during the run, as users run it\n")
    print(table(rows, [("layers", "layers", "d"), ("traced_nodes", "traced nodes", "d"), ("nodes", "nodes after", "d"),
                       ("trace_cpu_s", "trace", ".3f"), ("transform_cpu_s", "transform", ".3f"),
                       ("total_cpu_s", "total", ".3f"), ("total_s", "total wall", ".3f"),
                       ("trace_cpu_gc_s", "trace gc on", ".3f"), ("transform_cpu_gc_s", "transform gc on", ".3f"),
                       ("total_cpu_gc_s", "total gc on", ".3f"), ("total_gc_s", "total wall gc on", ".3f")]))
    result = {"rows": rows}
    if len(layers) >= 2:
        small, large = layers[-2], layers[-1]
        g = growth(rows, small, large)
        result["growth"] = dict(small=small, large=large, **g)
        print(f"\ngrowth {large}/{small} layers (linear: x{large / small:.2f}): nodes x{g['nodes']:.2f}; "
              f"CPU time: trace x{g['trace_cpu_s']:.2f}, transform x{g['transform_cpu_s']:.2f}, total x{g['total_cpu_s']:.2f}; "
              f"with the GC on: total x{g['total_cpu_gc_s']:.2f}")
        a, b = rows[-2], rows[-1]
        per_pass = [dict(part=p, small_s=a["passes_s"].get(p), large_s=b["passes_s"][p], ratio=r,
                         small_gc_s=a["passes_gc_s"].get(p), large_gc_s=b["passes_gc_s"].get(p), ratio_gc=g["passes_gc"].get(p))
                    for p, r in sorted(g["passes"].items(), key=lambda kv: -b["passes_s"][kv[0]])]
        print(f"\ntransform, CPU time per pass ({small} -> {large} layers):")
        print(table(per_pass, [("part", "pass", ""), ("small_s", f"{small} layers s", ".4f"),
                               ("large_s", f"{large} layers s", ".4f"), ("ratio", "ratio", ".2f"),
                               ("small_gc_s", f"{small} gc on", ".4f"), ("large_gc_s", f"{large} gc on", ".4f"),
                               ("ratio_gc", "ratio gc on", ".2f")]))
    if not args.no_hf:
        meta_rows = [r for r in (measure_hf_llama_meta(size, repeats=args.repeats, plain_export=not args.no_plain_export) for size in args.hf_sizes.split(",")) if r]
        if meta_rows:
            result["hf_llama_8b"] = meta_rows[0]
            result["hf_llama_meta"] = meta_rows
            for r in meta_rows:
                r["peak_h"], r["weights_h"] = fmt_bytes(r["peak_rss"]), fmt_bytes(r["bf16_bytes"])
            print(f"\nHF Llama-3 configs on the meta device, Plan.from_hf, MeshSpec tp={meta_rows[0]['tp']} "
                  f"(goals: 8B under 5 s, 70B under 10 s, at most 0.6x a plain non-strict torch.export of the same model); "
                  f"peak memory: the whole process (Python, torch, transformers), never the weights:")
            print(table(meta_rows, [("model", "model", ""), ("captured_nodes", "captured nodes", "d"),
                                    ("nodes", "nodes after", "d"), ("capture_s", "capture (torch.export) s", ".2f"),
                                    ("transform_s", "transform s", ".2f"), ("total_s", "total wall s", ".2f"),
                                    ("total_cpu_s", "total CPU s", ".2f"), ("plain_export_s", "plain export s", ".2f"),
                                    ("vs_plain_export", "total / plain export", ".2f"), ("peak_h", "peak RSS", ""),
                                    ("weights_h", "bf16 weights", "")]))
            for r in meta_rows:
                print(f"  {r['model']}: {r['capture_blocks']}")
    if not args.no_hf:
        startup = [r for r in (measure_gemma3_startup(m) for m in ("tp=2", "cp=2", "cp=2,tp=2")) if r]
        if startup:
            result["gemma3_startup"] = startup
            print("\nstart-up under context parallelism (capture + transform, MeshSpec; the cp rows should match tp's):")
            print(table(startup, [("model", "model", ""), ("mesh", "mesh", ""), ("total_s", "wall s", ".2f"),
                                  ("total_cpu_s", "CPU s", ".2f"), ("peak_h", "peak RSS", "")]))
    if args.profile:
        text = profile_transform(layers[-1], plan, ids)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / "transform_time_profile.txt"
        path.write_text(text)
        print(f"\ncProfile of transform at {layers[-1]} layers (top by own time): {path}")
        print("\n".join(text.splitlines()[:40]))
    path = write_json("transform_time", dict(layers=layers, tp=args.tp, repeats=args.repeats), result, args.out)
    print(f"\nresults: {path}")
    if not args.no_plot:
        png = plot(rows)
        if png:
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
