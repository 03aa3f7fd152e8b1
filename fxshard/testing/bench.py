"""Step-time comparison: fxshard vs DTensor ``parallelize_module`` vs hand-written Megatron layers.

One training step (forward, cross-entropy, backward, SGD) of :class:`fxshard.testing.models.Llama`
on real ranks (gloo processes on CPU, NCCL under ``torchrun`` on GPUs), for three
contenders built from the same weights and the same ``parallelize_module`` plan dict:

* ``fxshard``: ``fxshard.transform(model, Plan.from_torch(mesh, plan_dict))``;
* ``dtensor``: ``parallelize_module(model, mesh, plan_dict)``;
* ``megatron``: :class:`MegatronLlama`, column/row-parallel layers written by hand
  (local weight shards, autograd functions over functional collectives, no fx).

Each runs eagerly and under ``torch.compile``.  The contenders alternate step by step
(round-robin, rotating who goes first) so that machine noise hits all alike; medians
are compared with the hand-written reference.  All contenders start from the same
weights and see the same batch, so their losses must agree at every step: the table
says so (``loss ok``).  Used by ``benchmarks/step_time.py`` and
``python -m fxshard demo --bench``.

A second suite (``model="hf-llama"``, :data:`SUITES`) times transformers'
``LlamaForCausalLM`` (random weights, HF's loss from ``labels``): HF's own tensor
parallelism (``from_pretrained(dir, tp_plan="auto")``, the reference ``hf_tp``), fxshard
(``transform(model, Plan.from_hf(mesh, model), example_kwargs=batch)``), DTensor
(``parallelize_module`` with the same plan, :func:`torch_hf_llama_plan`) and one device
(``single``: the whole model on every rank).  Both suites share the timing loop
(:func:`interleave`), the rows and the table.

Example::

    from fxshard.testing import bench
    rows = bench.run_step_time([bench.SIZES["small"]], tp=2, modes=["eager"], iters=10)
    print(bench.format_table(rows))
    rows = bench.run_step_time([bench.HF_SIZES["small"]], modes=["eager"], iters=10, model="hf-llama")
"""
from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from fxshard.testing.launch import spawn
from fxshard.state.progress import progress
from fxshard.testing.bench_contenders import (CONTENDERS, FSDP_CONTENDERS, HF_CONTENDERS, HF_SIZES, MODES, SIZES,
                                              MegatronLlama, StepSize, build_contenders, build_fsdp_contenders,
                                              build_hf_contenders, hf_llama, hf_llama_config, hf_train_step, hf_tp_model,
                                              torch_hf_llama_plan, torch_llama_plan)
import torch.nn.functional as F
from torch import nn

__all__ = [
    "StepSize", "SIZES", "MODES", "CONTENDERS", "torch_llama_plan", "MegatronLlama",
    "run_step_time", "time_on_mesh", "format_table", "summary_ratios",
    "HF_CONTENDERS", "HF_SIZES", "SUITES", "Suite", "hf_llama", "hf_llama_config", "hf_tp_model",
    "torch_hf_llama_plan", "interleave", "first_loss_spread",
]

# --------------------------------------------------------------------------- suites


@dataclass(frozen=True)
class Suite:
    """One step-time comparison: its contenders and how to build and step them.

    ``build(size, mesh, device)`` returns ``({contender: module}, batch, single-device
    loss of the first step or None)``; ``step(module, optimizer, batch)`` one training
    step, returning the loss.  Rows carry ``ratio_vs_<reference>``; every contender's loss
    is compared at every step with ``loss_reference``'s (and the first one with one
    device's; ``None`` from ``build``: ``loss_reference`` is that device).
    """

    name: str
    contenders: tuple[str, ...]
    reference: str
    loss_reference: str
    sizes: dict
    build: Callable
    step: Callable
    file_prefix: str
    title: str
    # losses of the first ``loss_check_steps`` steps must agree (None: all steps).  Step 0
    # checks the forward, the next ones the gradients and the optimizer step; later, fp32
    # noise (TP splits the sums of row-parallel matmuls) grows with training: on HF Llama
    # small all TP contenders agree with one device to 1e-5 for ~20 SGD steps, then drift
    # apart by up to 1e-2 (HF's TP and DTensor bitwise equal, fxshard no further off).
    loss_check_steps: int | None = None
    # the mesh: ("tp",) over every rank, or ("dp", "tp") with dp = 2
    mesh_dims: tuple[str, ...] = ("tp",)


SUITES = {
    "llama": Suite("llama", CONTENDERS, "megatron", "megatron", SIZES, build_contenders,
                   lambda m, opt, batch: _train_step(m, opt, *batch), "step_time",
                   "fxshard.testing.models.Llama: hand-written Megatron (megatron), fxshard, DTensor parallelize_module"),
    "hf-llama": Suite("hf-llama", HF_CONTENDERS, "hf_tp", "single", HF_SIZES, build_hf_contenders, hf_train_step,
                      "step_time_hf_llama",
                      "transformers LlamaForCausalLM: HF from_pretrained(tp_plan='auto') (hf_tp), fxshard "
                      "(Plan.from_hf), DTensor parallelize_module (same plan), one device (single)",
                      loss_check_steps=5),
    "llama-fsdp": Suite("llama-fsdp", FSDP_CONTENDERS, "dtensor", "dtensor", SIZES, build_fsdp_contenders,
                        lambda m, opt, batch: _train_step(m, opt, *batch), "step_time_fsdp",
                        "fxshard.testing.models.Llama on a dp x tp mesh (dp=2): DTensor TP + FSDP2 as torchtitan "
                        "composes them (dtensor), fxshard TP + fxshard.fully_shard (fxshard), fxshard TP + its own "
                        "gradient sums over dp, each bucket waited on at once (fxshard_dp_sync) or at the end of the "
                        "backward (fxshard_dp_overlap)",
                        mesh_dims=("dp", "tp")),
}

def _inductor_skip_reason(device: str) -> str | None:
    if device == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")):
        return "no C++ compiler on PATH (inductor's CPU backend needs one)"
    return None


def _train_step(model, opt, ids, targets) -> torch.Tensor:
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_block(size: StepSize, mode: str, mesh, device: str, warmup: int, iters: int, bar, profile_dir: str | None,
                suite: "Suite | None" = None):
    """Times every contender of ``suite`` (default: the Llama one) for one (size, mode):
    returns {contender: record} (this rank)."""
    suite = suite or SUITES["llama"]
    torch._dynamo.reset()
    built, batch, single = suite.build(size, mesh, device)
    runs = {}
    for name, model in built.items():
        fn = model if mode == "eager" else torch.compile(model, backend=mode)
        runs[name] = {"fn": fn, "opt": torch.optim.SGD(model.parameters(), lr=0.01), "times": [], "losses": [],
                      "first_step_s": None, "error": None, "params_per_rank": _local_numel(model)}
    interleave(runs, lambda r: suite.step(r["fn"], r["opt"], batch), warmup, iters, bar, device,
               count_graphs=mode != "eager")
    if single is None:  # the suite times one device as a contender: its first loss is the reference
        single = runs[suite.loss_reference]["losses"][0] if runs[suite.loss_reference]["losses"] else float("nan")
    profiled = {}
    if profile_dir is not None:
        profiled = _profile(runs, lambda r: suite.step(r["fn"], r["opt"], batch), size, mode, device, profile_dir,
                            max(PROFILE_STEPS, iters // 3), prefix=suite.file_prefix)
    return {name: {k: v for k, v in r.items() if k not in ("fn", "opt")} | {"single_device_loss": single}
            | profiled.get(name, {}) for name, r in runs.items()}


def _local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds (a DTensor's local shard): shows that a TP
    contender is sharded as much as the others."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def interleave(runs: dict[str, dict], step, warmup: int, iters: int, bar, device: str = "cpu",
               count_graphs: bool = False) -> None:
    """The timing loop shared by every suite: ``warmup + iters`` rounds; in each, every
    contender takes one step (``step(run)`` returns its loss), the first contender rotating
    so that none always follows the same one; each step starts after a barrier.

    ``runs``: ``{name: {"times": [], "losses": [], "first_step_s": None, "error": None, ...}}``,
    filled in place (this rank's times; the caller reduces over ranks).  A step that raises
    (a backend that cannot compile a contender) records ``error`` and drops the contender.
    ``count_graphs``: also record per contender the graph breaks and graphs that dynamo
    counted during its steps (``graph_breaks``, ``graphs``).
    """
    from torch._dynamo.utils import counters

    def graph_counts():
        return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]

    order = list(runs)
    for r in runs.values():
        r.setdefault("graph_breaks", 0)
        r.setdefault("graphs", 0)
    for it in range(warmup + iters):
        k = it % len(order)  # rotate who goes first: no contender always follows the same one
        for name in order[k:] + order[:k]:
            r = runs[name]
            if r["error"] is not None:
                continue
            before = graph_counts() if count_graphs else None
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            try:
                loss = step(r)
                _sync(device)
            except Exception as e:  # a backend that cannot compile this contender: report, go on
                r["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
                continue
            dt = time.perf_counter() - t0
            if before is not None:
                after = graph_counts()
                r["graph_breaks"] += after[0] - before[0]
                r["graphs"] += after[1] - before[1]
            if it == 0:
                r["first_step_s"] = dt
            if it >= warmup:
                r["times"].append(dt)
            r["losses"].append(loss.item())
            bar.update()


_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")
PROFILE_STEPS = 5  # at least; short steps get more (a third of the timed steps), to average the noise


def _profile(runs, step, size, mode, device, profile_dir, steps: int, prefix: str = "step_time") -> dict[str, dict]:
    """torch.profiler tables (self CPU time per op, over ``steps`` steps) of every
    contender, written to ``profile_dir``; returns per contender the self CPU time per step
    spent outside collectives (compute and framework overhead) and inside them (mostly
    waiting for the peers)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    summary = {}
    for name, r in runs.items():
        if r["error"] is not None:
            continue
        dist.barrier()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step(r)
            _sync(device)
        averages = prof.key_averages()
        comm_us = sum(e.self_cpu_time_total for e in averages if e.key.startswith(_COMM_PREFIXES))
        total_us = sum(e.self_cpu_time_total for e in averages)
        summary[name] = dict(profile_cpu_ms=(total_us - comm_us) / 1e3 / steps,
                             profile_comm_ms=comm_us / 1e3 / steps, profile_steps=steps)
        if dist.get_rank() == 0:
            table = averages.table(sort_by="self_cpu_time_total", row_limit=30)
            path = os.path.join(profile_dir, f"{prefix}_profile_{size.name}_{mode}_{name}.txt")
            with open(path, "w") as fh:
                fh.write(f"{name}, {size.name} ({size.describe()}), {mode}: {steps} training steps, rank 0\n"
                         f"self CPU per step: {summary[name]['profile_cpu_ms']:.2f} ms outside collectives, "
                         f"{summary[name]['profile_comm_ms']:.2f} ms in them (mostly waiting for the peer)\n\n{table}\n")
    return summary


def time_on_mesh(mesh, sizes: Iterable[StepSize], modes: Iterable[str] = ("eager", "aot_eager"), *, warmup: int = 2,
                 iters: int | None = None, device: str = "cpu", profile_dir: str | None = None,
                 show_progress: bool = True, model: str = "llama") -> list[dict]:
    """The step-time comparison on an initialised 1-D ``("tp",)`` mesh; every rank calls
    it and gets the same rows (step times are the max over ranks).  Progress on rank 0.
    ``model``: the suite (:data:`SUITES`): ``"llama"`` (fxshard's Llama: megatron, fxshard,
    dtensor) or ``"hf-llama"`` (transformers' Llama: hf_tp, fxshard, dtensor, single).

    Example (inside each rank of a job, as ``python -m fxshard demo --bench`` does)::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        print(bench.format_table(bench.time_on_mesh(mesh, [bench.SIZES["small"]], ["eager"])))
    """
    suite = SUITES[model]
    names = suite.contenders
    sizes, modes = list(sizes), list(modes)
    rank = dist.get_rank()
    steps = {s.name: iters if iters is not None else s.iters for s in sizes}  # timed steps per contender
    total = sum(len(modes) * len(names) * (warmup + steps[s.name]) for s in sizes)
    rows = []
    with progress(total, f"step time {model}", show=show_progress and rank == 0, unit="step") as bar:
        for size in sizes:
            for mode in modes:
                bar.set_description(f"step time {model} {size.name}/{mode}")
                skip = _inductor_skip_reason(device) if mode == "inductor" else None
                if skip:
                    rows += [dict(size=size.name, mode=mode, contender=c, tp=mesh.size(), skipped=skip) for c in names]
                    bar.update(len(names) * (warmup + steps[size.name]))
                    continue
                records = _time_block(size, mode, mesh, device, warmup, steps[size.name], bar, profile_dir, suite)
                rows += _rows_of(size, mode, records, steps[size.name], device, mesh.size(), suite)
    return rows


def _reduce(values: list[float], op, device: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=op)
    return t.tolist()


def _rows_of(size: StepSize, mode: str, records: dict, iters: int, device: str, tp: int,
             suite: Suite | None = None) -> list[dict]:
    suite = suite or SUITES["llama"]
    rows = []
    ref_losses = records[suite.loss_reference]["losses"]
    for name in suite.contenders:
        rec = records[name]
        ok = _reduce([float(rec["error"] is None and len(rec["times"]) == iters)], dist.ReduceOp.MIN, device)[0]
        if not ok:
            rows.append(dict(size=size.name, mode=mode, contender=name, tp=tp,
                             skipped=rec["error"] or "failed on another rank"))
            continue
        times = _reduce(rec["times"], dist.ReduceOp.MAX, device)  # a step takes as long as its slowest rank
        first_s = _reduce([rec["first_step_s"]], dist.ReduceOp.MAX, device)[0]
        # every (checked) step against the reference contender, and the first step against one device
        diffs = [abs(a - b) for a, b in zip(rec["losses"], ref_losses)]
        first = [abs(rec["losses"][0] - rec["single_device_loss"])]
        diff = max(diffs[:suite.loss_check_steps] + first)
        diff_all = max(diffs + first)
        row = dict(size=size.name, mode=mode, contender=name, tp=tp, median_ms=1e3 * statistics.median(times),
                   p10_ms=1e3 * _quantile(times, 0.1), p90_ms=1e3 * _quantile(times, 0.9),
                   first_step_s=first_s, steps=len(rec["losses"]), loss_first=rec["losses"][0],
                   loss_single_device=rec["single_device_loss"],
                   loss_last=rec["losses"][-1], max_loss_diff=diff, max_loss_diff_all_steps=diff_all,
                   loss_checked_steps=min(len(rec["losses"]), suite.loss_check_steps or len(rec["losses"])),
                   losses=rec["losses"], times_ms=[1e3 * t for t in times],
                   **{k: rec[k] for k in ("params_per_rank", "profile_cpu_ms", "profile_comm_ms", "profile_steps")
                      if k in rec})
        if mode != "eager":  # what dynamo made of it (rank 0's counts)
            row.update(graph_breaks=rec.get("graph_breaks", 0), graphs=rec.get("graphs", 0))
        rows.append(row)
    ref = next((r for r in rows if r["contender"] == suite.reference and "median_ms" in r), None)
    for r in rows:
        if ref is not None and "median_ms" in r:
            r[f"ratio_vs_{suite.reference}"] = r["median_ms"] / ref["median_ms"]
    return rows


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# --------------------------------------------------------------------------- launching


def _spawned(rank: int, world_size: int, kwargs: dict, out_path: str) -> None:
    rows = _in_process(world_size, "cpu", **kwargs)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)


def _in_process(tp: int, device: str, sizes, modes, warmup, iters, profile_dir, show_progress,
                model: str = "llama") -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    if SUITES[model].mesh_dims == ("dp", "tp"):
        if tp % 2:
            raise ValueError(f"suite {model!r} runs on a dp=2 x tp mesh: the world size ({tp}) must be even")
        mesh = init_device_mesh(device.split(":")[0], (2, tp // 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh(device.split(":")[0], (tp,), mesh_dim_names=("tp",))
    return time_on_mesh(mesh, sizes, modes, warmup=warmup, iters=iters, device=device, profile_dir=profile_dir,
                        show_progress=show_progress, model=model)


def run_step_time(sizes: Iterable[StepSize], tp: int = 2, modes: Iterable[str] = ("eager", "aot_eager"), *,
                  warmup: int = 2, iters: int | None = None, device: str = "cpu", profile_dir: str | None = None,
                  show_progress: bool = True, model: str = "llama") -> list[dict]:
    """Times one training step of every contender of suite ``model`` (:data:`SUITES`);
    returns one row per (size, mode, contender).

    ``iters`` timed steps per contender (default: each size's ``iters``) after ``warmup``.
    On CPU, spawns ``tp`` gloo processes (one thread each).  Launched by ``torchrun``
    (``RANK``/``WORLD_SIZE`` set), runs in this process on ``device`` with ``tp`` =
    the world size (NCCL on CUDA); only rank 0 returns the rows, the others ``[]``.
    ``profile_dir``: also write a torch.profiler table per contender there.

    A row: ``size, mode, contender, tp, median_ms, p10_ms, p90_ms, ratio_vs_<reference>``
    (``ratio_vs_megatron``, ``ratio_vs_hf_tp``), ``first_step_s`` (includes compilation),
    ``loss_first, loss_single_device, loss_last, max_loss_diff`` (the largest difference
    from the loss reference's loss over the suite's checked steps, and of the first loss
    from the single-device one; ``max_loss_diff_all_steps``: over all steps),
    ``losses`` (every step's), under compile ``graph_breaks, graphs`` (dynamo's counts); or
    ``skipped`` with the reason.
    """
    sizes, modes = list(sizes), list(modes)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown modes {bad}; choose from {MODES}")
    if model not in SUITES:
        raise ValueError(f"unknown model {model!r}; choose from {list(SUITES)}")
    kwargs = dict(sizes=sizes, modes=modes, warmup=warmup, iters=iters, profile_dir=profile_dir,
                  show_progress=show_progress, model=model)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _under_torchrun(device, kwargs)
    if device != "cpu":
        raise ValueError(f"device={device!r}: launch with torchrun for accelerators (one process per device)")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        spawn(_spawned, tp, kwargs, out_path)
        with open(out_path) as fh:
            return json.load(fh)


def _under_torchrun(device: str, kwargs: dict) -> list[dict]:
    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rows = _in_process(dist.get_world_size(), device, **kwargs)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return rows if int(os.environ["RANK"]) == 0 else []


# --------------------------------------------------------------------------- reporting


def _contenders_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["contender"] for r in rows))


def _reference_of(rows: list[dict]) -> str | None:
    return next((k[len("ratio_vs_"):] for r in rows for k in r if k.startswith("ratio_vs_")), None)


def summary_ratios(rows: list[dict]) -> list[dict]:
    """Per (size, mode): ``fxshard_vs_<c>`` = fxshard's median step time / ``c``'s, for
    every other contender ``c`` (Llama: megatron, dtensor; HF Llama: hf_tp, dtensor,
    single); ``None`` where either was skipped."""
    out = []
    others = [c for c in _contenders_of(rows) if c != "fxshard"]
    keys = dict.fromkeys((r["size"], r["mode"]) for r in rows)
    for size, mode in keys:
        med = {r["contender"]: r.get("median_ms") for r in rows if r["size"] == size and r["mode"] == mode}
        fx = med.get("fxshard")
        out.append(dict(size=size, mode=mode, **{f"fxshard_vs_{c}": fx / med[c] if fx and med.get(c) else None
                                                 for c in others}))
    return out


def first_loss_spread(rows: list[dict]) -> list[dict]:
    """Per (size, mode): the largest difference between the contenders' step-0 losses
    (same weights, same batch: it should be float noise)."""
    out = []
    for size, mode in dict.fromkeys((r["size"], r["mode"]) for r in rows):
        losses = {r["contender"]: r["loss_first"] for r in rows
                  if r["size"] == size and r["mode"] == mode and "loss_first" in r}
        spread = max(losses.values()) - min(losses.values()) if losses else None
        out.append(dict(size=size, mode=mode, losses=losses, max_diff=spread))
    return out


def format_table(rows: list[dict], title: str | None = None) -> str:
    """The step-time table (one row per contender) and the fxshard ratios."""
    buf = io.StringIO()
    if title:
        print(title, file=buf)
    ref = _reference_of(rows) or "megatron"
    width = max([9] + [len(c) for c in _contenders_of(rows)])
    head = (f"{'size':<6} {'mode':<10} {'contender':<{width}} {'median ms':>10} {'p10-p90 ms':>16} {'vs ' + ref:>11} "
            f"{'1st step s':>10}  {'loss ok':<7}")
    print(head, file=buf)
    print("-" * len(head), file=buf)
    for r in rows:
        if "skipped" in r:
            print(f"{r['size']:<6} {r['mode']:<10} {r['contender']:<{width}} skipped: {r['skipped']}", file=buf)
            continue
        spread = f"{r['p10_ms']:.1f}-{r['p90_ms']:.1f}"
        ok = "yes" if r["max_loss_diff"] <= 1e-4 else f"NO ({r['max_loss_diff']:.1e})"
        drift = r.get("max_loss_diff_all_steps", 0)
        if drift > 1e-4:  # checked steps agree; fp32 noise grew later in training (Suite.loss_check_steps)
            ok += f" ({r['loss_checked_steps']} steps; all {r['steps']}: {drift:.0e})"
        note = f"  {r['graphs']} graphs, {r['graph_breaks']} breaks" if "graphs" in r else ""
        print(f"{r['size']:<6} {r['mode']:<10} {r['contender']:<{width}} {r['median_ms']:>10.2f} {spread:>16} "
              f"{r.get('ratio_vs_' + ref, float('nan')):>11.2f} {r['first_step_s']:>10.2f}  {ok:<7}{note}", file=buf)
    print(file=buf)
    for s, f in zip(summary_ratios(rows), first_loss_spread(rows)):
        ratios = "   ".join(f"{k.replace('_vs_', '/')} = {'n/a' if v is None else f'{v:.2f}'}"
                            for k, v in s.items() if k.startswith("fxshard_vs_"))
        diff = "n/a" if f["max_diff"] is None else f"{f['max_diff']:.1e}"
        print(f"{s['size']:<6} {s['mode']:<10} {ratios}   step-0 loss max diff = {diff}", file=buf)
    return buf.getvalue().rstrip("\n")


def sizes_by_name(names: Iterable[str], model: str = "llama", **overrides) -> list[StepSize]:
    """The sizes of suite ``model`` (``SIZES``, ``HF_SIZES``) by name, with field overrides
    (``batch=2``) applied to all."""
    table = SUITES[model].sizes
    out = []
    for n in names:
        if n not in table:
            raise ValueError(f"unknown size {n!r}; choose from {list(table)}")
        out.append(replace(table[n], **{k: v for k, v in overrides.items() if v is not None}))
    return out


def as_dict(size: StepSize) -> dict:
    return asdict(size)
