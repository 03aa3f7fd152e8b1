"""Step time: one training step of Llama, fxshard vs DTensor vs hand-written Megatron (or HF's TP).

A step is forward, cross-entropy, backward and SGD, on real ranks (``--tp`` gloo
processes, one CPU thread each; under ``torchrun --device cuda``, NCCL).  The three
contenders share the weights, the batch and the ``parallelize_module`` plan dict
(``fxshard.testing.bench.torch_llama_plan``; ``Plan.from_torch`` of it is checked to equal
``fxshard.testing.models.llama_plan()``):

* ``megatron``: column/row-parallel layers written by hand (the reference);
* ``fxshard``: ``fxshard.transform(model, Plan.from_torch(mesh, plan_dict))``;
* ``dtensor``: ``parallelize_module(model, mesh, plan_dict)``.

Each runs eagerly and under ``torch.compile`` (``aot_eager``, ``inductor``); the
contenders alternate step by step, medians are reported with the ratio to
``megatron``, and the losses of all contenders must agree at every step.

With ``--model hf-llama`` the model is transformers' ``LlamaForCausalLM`` (random
weights, no KV cache; the loss is HF's, from ``labels``) and the contenders are

* ``hf_tp``: HF's own tensor parallelism, ``from_pretrained(dir, tp_plan="auto")`` of the
  model saved by rank 0 (the reference);
* ``fxshard``: ``fxshard.transform(model, Plan.from_hf(mesh, model), example_kwargs=batch)``;
* ``dtensor``: ``parallelize_module`` with the same plan (``bench.torch_hf_llama_plan``);
* ``single``: the whole model on every rank, no communication (one device's step time);

results in ``results/step_time_hf_llama.json``.

With ``--model llama-fsdp`` (an even ``--tp``: the world size) the mesh is ``dp=2 x
tp``, each rank steps on its dp half of the batch, and the contenders are

* ``dtensor``: torchtitan's composition, ``parallelize_module`` over ``tp`` and then
  FSDP2's ``fully_shard`` on every block and the root over ``dp`` (the reference);
* ``fxshard``: ``fxshard.transform`` with ``Plan(..., fsdp="dp")``, then
  ``fxshard.fully_shard(sharded, mesh)``;
* ``fxshard_dp_sync``, ``fxshard_dp_overlap``: fxshard sums the gradients over dp itself
  (DDP's buckets, ``bench.DP_BUCKET_MB`` each), ``transform(..., overlap_grad_syncs=False)``
  (each bucket waited on at once) and ``True`` (started in the backward, waited on at its
  end); the overlap's gain is printed, and its losses must equal the synchronous ones;

results in ``results/step_time_fsdp.json``.

    python benchmarks/step_time.py                     # small + large, tp=2, all modes
    python benchmarks/step_time.py --model hf-llama    # the same for HF Llama
    python benchmarks/step_time.py --model llama-fsdp --tp 4 --sizes small --modes eager,aot_eager
    python benchmarks/step_time.py --tp 4 --modes eager
    python benchmarks/step_time.py --profile           # + torch.profiler tables per contender
    torchrun --nproc-per-node 1 benchmarks/step_time.py --device cuda --sizes gpu
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe_machine, pyplot, save_plot, table, write_json  # noqa: E402

from fxshard.testing import bench  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=list(bench.SUITES),
                   help="llama: fxshard.testing.models.Llama vs hand-written Megatron and DTensor; hf-llama: transformers' "
                        "LlamaForCausalLM vs HF's tp_plan='auto', DTensor and one device; llama-fsdp: dp=2 x tp, "
                        "fxshard + FSDP2 vs DTensor TP + FSDP2")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks to spawn on CPU (torchrun: the world size)")
    p.add_argument("--sizes", default="small,large",
                   help=f"comma-separated, from {list(bench.SIZES)} (hf-llama: {list(bench.HF_SIZES)})")
    p.add_argument("--modes", default="eager,aot_eager,inductor", help=f"comma-separated, from {list(bench.MODES)}")
    p.add_argument("--iters", type=int, default=None,
                   help="timed steps per contender (default: small 60, large 15; hf-llama: small 40, large 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender (the first compiles)")
    p.add_argument("--batch", type=int, default=None, help="override the batch size of every size")
    p.add_argument("--seqlen", type=int, default=None, help="override the sequence length of every size")
    p.add_argument("--n-layers", type=int, default=None, help="override the layer count of every size")
    p.add_argument("--device", default="cpu", help="cpu (spawned gloo ranks) or cuda (under torchrun)")
    p.add_argument("--profile", action="store_true", help="write torch.profiler tables (5 steps per contender)")
    p.add_argument("--out", default=None,
                   help="results JSON (default benchmarks/results/step_time.json, hf-llama: step_time_hf_llama.json)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def plot(rows, path_name="step_time", suite=bench.SUITES["llama"]):
    plt = pyplot()
    if plt is None:
        return None
    blocks = list(dict.fromkeys((r["size"], r["mode"]) for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(blocks), 3.2))
    names, key = suite.contenders, f"ratio_vs_{suite.reference}"
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next((r.get(key, 0) for r in rows if (r["size"], r["mode"]) == b and r["contender"] == name), 0)
              for b in blocks]
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(blocks))], ys, width, label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(blocks)), [f"{s}\n{m}" for s, m in blocks])
    ax.set_ylabel(f"median step time / {suite.reference}")
    ax.set_title("training step, lower is better")
    ax.legend(fontsize=8)
    path = save_plot(fig, path_name)
    plt.close(fig)
    return path


def print_profiles(rows, profile_dir, suite=bench.SUITES["llama"]) -> None:
    """Self CPU time per step outside / inside collectives per contender, and the top of
    fxshard's profile wherever it is >10% slower than the hand-written reference."""
    print(f"\nprofiles (rank 0): {profile_dir}/{suite.file_prefix}_profile_<size>_<mode>_<contender>.txt")
    prof = [r for r in rows if "profile_cpu_ms" in r]
    print(table(prof, [("size", "size", ""), ("mode", "mode", ""), ("contender", "contender", ""),
                       ("profile_cpu_ms", "self CPU ms/step outside collectives", ".2f"),
                       ("profile_comm_ms", "in collectives", ".2f"), ("profile_steps", "steps", "d"),
                       ("median_ms", "median step ms", ".2f")]))
    key = f"ratio_vs_{suite.reference}"
    for r in rows:
        if r["contender"] == "fxshard" and r.get(key, 0) > 1.10:
            f = Path(profile_dir) / f"{suite.file_prefix}_profile_{r['size']}_{r['mode']}_fxshard.txt"
            if f.exists():
                print(f"\nfxshard is {r[key]:.2f}x the reference at {r['size']}/{r['mode']}; its profile:")
                print("\n".join(f.read_text().splitlines()[:24]))


def main(argv=None) -> int:
    args = parse_args(argv)
    suite = bench.SUITES[args.model]
    sizes = bench.sizes_by_name([s for s in args.sizes.split(",") if s], model=args.model, batch=args.batch,
                                seqlen=args.seqlen, n_layers=args.n_layers)
    modes = [m for m in args.modes.split(",") if m]
    profile_dir = str(RESULTS) if args.profile else None
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.monotonic()
    if profile_dir:
        RESULTS.mkdir(parents=True, exist_ok=True)
    rows = bench.run_step_time(sizes, tp=args.tp, modes=modes, warmup=args.warmup, iters=args.iters,
                               device=args.device, profile_dir=profile_dir, show_progress=not args.quiet,
                               model=args.model)
    if not rows:  # a torchrun rank other than 0
        return 0
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    wall_s = time.monotonic() - t0
    tp = rows[0].get("tp", args.tp)
    print(f"step time: {suite.title}")
    print(f"training step (forward, cross-entropy, backward, SGD), tp={tp}, {args.device}; "
          f"median over the timed steps after {args.warmup} warm-up; max over ranks")
    print(f"machine: {describe_machine()}; load average before {_fmt_load(load_before)}, after {_fmt_load(load_after)}; "
          f"{wall_s:.0f} s")
    for s in sizes:
        print(f"  {s.name}: {s.describe()}; {args.iters or s.iters} timed steps")
    print()
    print(bench.format_table(rows))
    sized = [bench.as_dict(replace(s, iters=args.iters or s.iters)) for s in sizes]
    config = dict(model=args.model, tp=tp, device=args.device, warmup=args.warmup, modes=modes, sizes=sized,
                  load_avg_before=load_before, load_avg_after=load_after, wall_s=round(wall_s, 1))
    results = {"rows": rows, "ratios": bench.summary_ratios(rows), "first_loss": bench.first_loss_spread(rows)}
    path = write_json(suite.file_prefix, config, results, args.out)
    print(f"\nresults: {path}")
    if not args.no_plot:
        png = plot(rows, suite.file_prefix, suite)
        if png:
            print(f"plot: {png}")
    if profile_dir:
        print_profiles(rows, profile_dir, suite)
    if args.model == "llama-fsdp":
        print()
        for line in overlap_lines(rows):
            print(line)
    bad = [r for r in rows if "max_loss_diff" in r and not r["max_loss_diff"] <= 1e-4]
    bad += [r for r in rows if r["contender"] == "fxshard_dp_overlap" and not _same_losses_as_sync(rows, r)]
    if bad:
        print(f"\nERROR: losses of {[(r['size'], r['mode'], r['contender']) for r in bad]} differ from the reference")
        return 1
    return 0


def _sync_row(rows, row):
    return next((r for r in rows if (r["size"], r["mode"], r["contender"]) == (row["size"], row["mode"], "fxshard_dp_sync")
                 and "losses" in r), None)


def _same_losses_as_sync(rows, row) -> bool:
    """The overlapped contender's losses are the synchronous one's, bitwise, at every step."""
    sync = _sync_row(rows, row)
    return "losses" not in row or sync is None or row["losses"] == sync["losses"]


def overlap_lines(rows) -> list[str]:
    """Per (size, mode): the step time with the gradient syncs overlapped and without, and
    whether every step's loss is the same."""
    out = []
    for r in rows:
        sync = _sync_row(rows, r) if r["contender"] == "fxshard_dp_overlap" and "median_ms" in r else None
        if sync is not None:
            same = "bitwise equal" if r["losses"] == sync["losses"] else (
                f"DIFFER (max {max(abs(a - b) for a, b in zip(r['losses'], sync['losses'])):.1e})")
            out.append(f"{r['size']:<6} {r['mode']:<10} overlapped grad syncs {r['median_ms']:.2f} ms vs synchronous "
                       f"{sync['median_ms']:.2f} ms (overlap/sync = {r['median_ms'] / sync['median_ms']:.2f}); "
                       f"losses over {len(r['losses'])} steps: {same}")
    return out


def _fmt_load(load) -> str:
    return "n/a" if load is None else "/".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    sys.exit(main())
