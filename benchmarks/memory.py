"""Memory: per-rank parameter bytes and the peak memory of the loss computation,
with and without loss parallel (tp=4).

The model is ``WithLoss(Llama)`` with a small hidden size and a large vocabulary, so
that the loss computation (logits -> cross-entropy, forward and backward) dominates the
activation memory of a training step.  Variants (plans prefixed ``model.``):

* ``single device``: the model on one rank, no plan;
* ``dense``: ``llama_plan()``: LM head replicated, full logits on every rank;
* ``gathered``: ``llama_plan(sequence_parallel=False, loss_parallel=False)`` plus
  ``output: colwise(out=Replicate())``: the head is sharded, its logits all-gathered;
* ``loss parallel``: ``llama_plan(loss_parallel=True)``: logits stay vocab-sharded and
  cross-entropy runs in its vocab-parallel form (three scalar-per-token all-reduces).

Measured: (1) parameter bytes per rank = the sharded ``state_dict()`` of the
transformed module (offline ``MeshSpec``, rank 0's shards); (2) peak memory of one
forward+backward step on real ranks (``--tp`` gloo processes): the maximum, over the
step, of the bytes allocated since it began, from the CPU allocator's allocation and
free events that ``torch.profiler(profile_memory=True)`` records (max over ranks);
(3) an estimate from the graph's local shapes: the largest local tensor (the logits).

Checkpoint load (``memory_checkpoint.json``): an HF Llama of ~0.6 B parameters in bf16,
saved with ``save_pretrained`` (several safetensors files), is loaded at ``--tp`` gloo
ranks into a model built on the meta device: ``fxshard.transform`` ->
``fxshard.materialize(init=None)`` -> ``fxshard.load_hf_checkpoint`` (each rank reads its
slices).  Per rank: the growth of its private memory (``RssAnon``, sampled every 5 ms)
from after the transform to the peak of the load, against the checkpoint size (goal:
about 1/tp plus a small constant), the file-backed pages it touched (``RssFile``: the
mmap'd files, reclaimable page cache: a column shard touches every page of its
tensor), and the time.

    python benchmarks/memory.py
    python benchmarks/memory.py --tp 2 --vocab 8192
    python benchmarks/memory.py --checkpoint-only --ckpt-layers 4 --ckpt-hidden 512
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, fmt_bytes, table, write_json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402

import fxshard  # noqa: E402
from fxshard import MeshSpec, Plan, colwise  # noqa: E402
from fxshard.testing.launch import spawn  # noqa: E402
from fxshard.meta import KEY, TensorInfo  # noqa: E402
from fxshard.testing.models import WithLoss, llama, llama_plan, tokens  # noqa: E402

VARIANTS = ("single device", "dense", "gathered", "loss parallel")


def plan_of(variant: str) -> dict | None:
    if variant == "single device":
        return None
    if variant == "dense":
        plan = llama_plan("tp")
    elif variant == "gathered":
        plan = {**llama_plan("tp", sequence_parallel=False, loss_parallel=False), "output": colwise("tp", out=Replicate())}
    elif variant == "loss parallel":
        plan = llama_plan("tp", loss_parallel=True)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return {"model." + k: v for k, v in plan.items()}


def make(cfg: dict):
    model = WithLoss(llama(seed=0, dim=cfg["dim"], n_layers=cfg["n_layers"], n_heads=8, n_kv_heads=4,
                           ffn_hidden=2 * cfg["dim"], vocab_size=cfg["vocab"], max_seq_len=max(32, cfg["seqlen"])))
    ids = tokens(cfg["batch"], cfg["seqlen"], cfg["vocab"], seed=1)
    tgt = tokens(cfg["batch"], cfg["seqlen"], cfg["vocab"], seed=2)
    return model, ids, tgt


def state_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def largest_local_tensor(gm) -> tuple[int, str]:
    """Bytes and description of the largest local value in the graph (from node.meta)."""
    best, what = 0, ""
    for n in gm.graph.nodes:
        meta = n.meta.get(KEY)
        v = getattr(meta, "value", None)
        if isinstance(v, TensorInfo) and n.op != "get_attr":
            nbytes = torch.Size(v.local_shape).numel() * v.dtype.itemsize
            if nbytes > best:
                best, what = nbytes, f"{n.name} {list(v.local_shape)}"
    return best, what


def offline(cfg: dict, tp: int) -> dict[str, dict]:
    """Parameter bytes per rank and the graph estimate, from an offline transform."""
    out = {}
    model, ids, tgt = make(cfg)
    for variant in VARIANTS:
        plan = plan_of(variant)
        if plan is None:
            out[variant] = dict(param_bytes=state_bytes(model), logits_bytes=ids.numel() * cfg["vocab"] * 4,
                                largest=f"logits {[cfg['batch'], cfg['seqlen'], cfg['vocab']]}")
            continue
        gm = fxshard.transform(model, Plan(MeshSpec(("tp",), (tp,)), plan), (ids, tgt))
        nbytes, what = largest_local_tensor(gm)
        out[variant] = dict(param_bytes=state_bytes(gm), logits_bytes=nbytes, largest=what)
    return out


# --------------------------------------------------------------------------- peak memory


def _allocations(prof) -> list[tuple[int, int]]:
    """(time ns, +bytes allocated / -bytes freed) of every CPU allocator event, in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device).startswith("cpu"):
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return sorted(events)


def peak_bytes(step) -> int:
    """Peak of the bytes allocated (net of frees) since the start of ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    current = peak = 0
    for _, size in _allocations(prof):
        current += size
        peak = max(peak, current)
    return peak


def _step_fn(module, ids, tgt):
    def step():
        loss = module(ids, tgt)
        loss.backward()
        del loss
    return step


def measure_peak(module, ids, tgt) -> int:
    _step_fn(module, ids, tgt)()  # warm-up: one-off allocations (caches) do not count
    module.zero_grad(set_to_none=True)  # the measured step allocates its gradients, as a first step does
    return peak_bytes(_step_fn(module, ids, tgt))


def _rank(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model, ids, tgt = make(cfg)
    peaks = {}
    for variant in VARIANTS[1:]:
        sharded = fxshard.transform(model, Plan(mesh, plan_of(variant)), (ids, tgt))
        t = torch.tensor([measure_peak(sharded, ids, tgt)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peaks[variant] = int(t.item())
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(peaks, fh)


def run_ranks(cfg: dict, tp: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "peaks.json")
        spawn(_rank, tp, cfg, out_path)
        with open(out_path) as fh:
            return json.load(fh)


# --------------------------------------------------------------------------- checkpoint load


def ckpt_config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 256 * 256 or 256,
                       num_hidden_layers=layers, num_attention_heads=max(4, hidden // 128), num_key_value_heads=4,
                       tie_word_embeddings=False, max_position_embeddings=2048)


class _RssSampler:
    """Peak ``RssAnon`` / ``RssFile`` of this process (``/proc/self/status``), sampled."""

    def __init__(self, period_s: float = 0.005):
        import threading

        self.period, self.peak_anon, self.peak_file, self._stop = period_s, 0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> tuple[int, int]:
        fields = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("RssAnon:", "RssFile:")):
                    k, v = line.split(":")
                    fields[k] = int(v.split()[0]) * 1024
        return fields["RssAnon"], fields["RssFile"]

    def _run(self):
        while not self._stop.is_set():
            anon, file = self.now()
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
            self._stop.wait(self.period)

    def __enter__(self):
        self.base_anon, self.base_file = self.now()
        self.peak_anon, self.peak_file = self.base_anon, self.base_file
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        anon, file = self.now()
        self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)


def _load_rank(rank: int, world_size: int, hidden: int, layers: int, path: str, out_path: str) -> None:
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt_config(hidden, layers)).to(torch.bfloat16)
    ids = torch.zeros(2, 16, dtype=torch.long)
    t0 = time.perf_counter()
    sharded = fxshard.transform(model, Plan.from_hf(mesh, model), example_kwargs={"input_ids": ids})
    t1 = time.perf_counter()
    rows = {}
    with _RssSampler() as s:
        t2 = time.perf_counter()
        fxshard.materialize(sharded, model, init=None)
        fxshard.load_hf_checkpoint(sharded, path, show_progress=False)
        t3 = time.perf_counter()
    local = sum(t.numel() * t.element_size() for t in {id(t): t for t in sharded.state_dict().values()}.values())
    rows["fxshard"] = dict(anon=s.peak_anon - s.base_anon, file=s.peak_file - s.base_file, local=local,
                           transform_s=t1 - t0, load_s=t3 - t2)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(gathered, fh)


def checkpoint_load(tp: int, hidden: int, layers: int) -> dict:
    """Save a bf16 HF Llama, load it at ``tp`` ranks; per-rank peaks (max over ranks)."""
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(ckpt_config(hidden, layers)).to(torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters())
        size_mb = 2 * n_params // 2**20
        model.save_pretrained(tmp, max_shard_size=f"{max(1, size_mb // 4)}MB")  # several files
        del model
        files = sorted(Path(tmp).glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        out_path = os.path.join(tmp, "rows.json")
        spawn(_load_rank, tp, hidden, layers, tmp, out_path)
        with open(out_path) as fh:
            per_rank = json.load(fh)
    rows = []
    for how in ("fxshard",):
        worst = {k: max(r[how][k] for r in per_rank) for k in per_rank[0][how]}
        rows.append(dict(how=how, tp=tp, params=n_params, checkpoint_bytes=size, files=len(files), **worst,
                         anon_vs_checkpoint=worst["anon"] / size, local_vs_checkpoint=worst["local"] / size))
    return dict(hidden=hidden, layers=layers, rows=rows)


def print_checkpoint_load(res: dict) -> None:
    r0 = res["rows"][0]
    print(f"\ncheckpoint load: HF Llama hidden {res['hidden']}, {res['layers']} layers, {r0['params'] / 1e9:.2f} B "
          f"parameters, bf16, {fmt_bytes(r0['checkpoint_bytes'])} in {r0['files']} safetensors files; "
          f"tp={r0['tp']} gloo ranks (max over ranks)\n")
    rows = [dict(r, anon_h=fmt_bytes(r["anon"]), file_h=fmt_bytes(r["file"]), local_h=fmt_bytes(r["local"])) for r in res["rows"]]
    print(table(rows, [("how", "load", ""), ("local_h", "shards/rank", ""), ("anon_h", "peak private growth", ""),
                       ("anon_vs_checkpoint", "x checkpoint", ".3f"), ("file_h", "file pages touched", ""),
                       ("load_s", "materialize+load s", ".2f"), ("transform_s", "transform s", ".2f")]))
    print(f"goal: peak private growth about 1/{r0['tp']} = {1 / r0['tp']:.3f} of the checkpoint plus a small constant")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--out", default=None)
    p.add_argument("--ckpt-hidden", type=int, default=1536, help="checkpoint-load model: hidden size")
    p.add_argument("--ckpt-layers", type=int, default=20, help="checkpoint-load model: layers (20 x 1536: 0.6 B)")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint-load measurement")
    p.add_argument("--checkpoint-only", action="store_true", help="only the checkpoint-load measurement")
    p.add_argument("--ckpt-out", default=None, help="results file of the checkpoint load")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.checkpoint_only:
        loss_memory(args)
    if not args.no_checkpoint:
        res = checkpoint_load(args.tp, args.ckpt_hidden, args.ckpt_layers)
        print_checkpoint_load(res)
        path = write_json("memory_checkpoint", dict(tp=args.tp, hidden=args.ckpt_hidden, layers=args.ckpt_layers), res,
                          args.ckpt_out)
        print(f"results: {path}")
    return 0


def loss_memory(args) -> None:
    cfg = dict(batch=args.batch, seqlen=args.seqlen, dim=args.dim, n_layers=args.n_layers, vocab=args.vocab)
    static = offline(cfg, args.tp)
    model, ids, tgt = make(cfg)
    peaks = {"single device": measure_peak(model, ids, tgt), **run_ranks(cfg, args.tp)}
    rows = []
    for variant in VARIANTS:
        s = static[variant]
        rows.append(dict(variant=variant, ranks=1 if variant == "single device" else args.tp,
                         param_bytes=s["param_bytes"], params=fmt_bytes(s["param_bytes"]),
                         peak_bytes=peaks[variant], peak=fmt_bytes(peaks[variant]),
                         peak_vs_gathered=peaks[variant] / peaks["gathered"],
                         logits_bytes=s["logits_bytes"], largest=f"{fmt_bytes(s['logits_bytes'])}: {s['largest']}"))
    print(f"memory per rank: WithLoss(Llama) dim {args.dim}, {args.n_layers} layer(s), vocab {args.vocab}, "
          f"batch {args.batch}x{args.seqlen}, fp32; tp={args.tp} gloo ranks")
    print(f"machine: {describe_machine()}\n")
    print(table(rows, [("variant", "variant", ""), ("ranks", "ranks", "d"), ("params", "params/rank", ""),
                       ("peak", "peak fwd+bwd", ""), ("peak_vs_gathered", "peak/gathered", ".2f"),
                       ("largest", "largest local tensor (graph estimate)", "")]))
    lp = next(r for r in rows if r["variant"] == "loss parallel")
    print(f"\nloss parallel / gathered logits, peak memory of the loss step at tp={args.tp}: "
          f"{lp['peak_vs_gathered']:.2f} (1/tp = {1 / args.tp:.2f})")
    print("peak: max over the step of the bytes allocated since it began, from torch.profiler(profile_memory=True) "
          "CPU allocator events, max over ranks; parameters: the sharded state_dict of rank 0.")
    path = write_json("memory", dict(tp=args.tp, **cfg), rows, args.out)
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
