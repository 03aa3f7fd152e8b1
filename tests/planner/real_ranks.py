"""What a training step really holds and sends on real gloo ranks, for the planner's tests.

``measure_configs(rank, world_size, configs, out_dir)`` (run it with ``harness.spawn``) builds
each configuration the way ``python -m fxshard train`` does (``fxshard.trainer.parallelize``: the
trainer's plans, FSDP2 on dp, ``pipeline_transform`` on pp, HF's activation checkpointing), runs
one step of its ``micro_loss`` (the program, ``token_loss_sum`` over the global count; under pp
``fxshard.train_step`` after a first step that exchanges torch's shape metadata), and writes per
rank ``out_dir/rank{r}.json``: ``{name: {params, grads, optimizer, activations, comm, seconds}}``:

- ``params`` / ``grads`` / ``optimizer``: bytes of this rank's parameters (FSDP2's local shards),
  their gradients after the backward, AdamW's ``exp_avg`` and ``exp_avg_sq`` after a step;
- ``activations``: the peak bytes of the unique storages autograd keeps for the backward
  (``saved_tensors_hooks``; parameters and buffers excluded), live from pack to last unpack;
- ``comm``: ``[axis-less kind, bytes, count]`` of every collective of the step (functional,
  c10d, FSDP2's), bytes as ``fxshard.comm_summary`` counts them;
- ``seconds``: the fastest of ``timed`` steps, taken round-robin over the configurations (a
  load that drifts over minutes weighs on all of them alike).

A configuration: ``{"name", "model" (an HF type), "overrides", "mesh", "seq", "batch",
"microbatches", "schedule", "ac", "timed"}``.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
               "all_to_all_single": "all_to_all"}
_C10D = {"send": "send", "recv_": "recv", "broadcast_": "broadcast", "allreduce_": "all_reduce",
         "_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "allgather_into_tensor_coalesced_": "all_gather", "reduce_scatter_tensor_coalesced_": "reduce_scatter"}


class CommLog(TorchDispatchMode):
    """(kind, bytes) of every collective: an all-gather's output, a reduce-scatter's input, else the tensor."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            x = args[0]
            n = x.numel() * x.element_size() * (args[1] if name == "all_gather_into_tensor" else 1)
            self.calls[(_FUNCTIONAL[name], n)] += 1
        elif func.namespace == "c10d" and name in _C10D:
            if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
                tensors = args[0]  # the gathered outputs
            elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
                tensors = args[1]  # the inputs to scatter
            else:
                tensors = args[0]
            tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            self.calls[(_C10D[name], sum(t.numel() * t.element_size() for t in tensors))] += 1
        return func(*args, **(kwargs or {}))


class SavedLog:
    """Peak bytes of the storages autograd keeps (parameters and buffers excluded).

    A storage is live from its first pack until every packed reference to it is unpacked or
    released by autograd (a saved tensor the backward never reads is freed with its node):
    a count that only fell at unpack kept such storages live forever, and a later storage at
    the same address then went uncounted, which made the peak vary from run to run."""

    def __init__(self, module: torch.nn.Module):
        self.excluded = {t.untyped_storage()._cdata for t in module.buffers()}
        self.live: dict[int, list] = {}  # storage -> [bytes, packs outstanding]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        key = t.untyped_storage()._cdata
        if (base.is_leaf and base.requires_grad) or key in self.excluded:
            return t
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Packed(self, key, t)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def unpack(self, packed):
        return packed.take() if isinstance(packed, _Packed) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Packed:
    """One saved reference: released at its first unpack, or when autograd frees it unread."""

    def __init__(self, log: SavedLog, key: int, t: torch.Tensor):
        self.log, self.key, self.t, self.held = log, key, t, True

    def take(self) -> torch.Tensor:
        if self.held:
            self.held = False
            self.log.release(self.key)
        return self.t

    def __del__(self):
        if self.held:
            self.held = False
            self.log.release(self.key)


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _one(rank: int, world_size: int, cfg: dict):
    """Build ``cfg``, measure one step; returns the result and a function that runs a step."""
    import fxshard
    from fxshard.training.token_loss import token_loss_sum
    from fxshard.trainer.models import ModelSource
    from fxshard.recipe.parallel_dims import ParallelDims
    from fxshard.trainer.parallelize import ParallelOptions, parallelize

    source = ModelSource.resolve(cfg["model"], cfg.get("overrides", {}))
    source.positions = cfg["seq"]
    model = source.build(meta=False)
    dims = ParallelDims.parse(cfg["mesh"], world_size)
    mesh = dims.build_mesh("cpu")
    M = cfg.get("microbatches", 1) if dims.pp > 1 else 1
    opts = ParallelOptions(microbatches=M, schedule=cfg.get("schedule") or "1F1B", activation_checkpointing=cfg.get("ac", False))
    g = torch.Generator().manual_seed(7)
    vocab = source.vocab_size()
    example = torch.randint(0, vocab, (cfg["batch"] // M, cfg["seq"]), generator=g)
    program = parallelize(model, source, dims, mesh, opts, example, log=lambda s: None)
    module = program.module
    ids = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=g)
    labels = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=g)
    if dims.dp > 1:
        r = mesh["dp"].get_local_rank()
        ids, labels = ids.chunk(dims.dp)[r], labels.chunk(dims.dp)[r]
    count = torch.tensor(float(cfg["batch"] * cfg["seq"]))

    def piece(x):
        if dims.cp == 1:
            return x
        if program.pipelined:
            return x.chunk(dims.cp, 1)[mesh["cp"].get_local_rank()]
        return fxshard.split_sequence(x, "cp", sharded=module)

    def step():
        fxshard.bind_mesh(mesh)  # the mesh fxshard's collectives resolve axes through: this configuration's
        if program.pipelined:
            share = module.spec.microbatches * module.batch_ranks
            target = labels if program.gathers_sequence else piece(labels)

            def loss_fn(output, tgt):
                return token_loss_sum(output, tgt, *program.vocab_parallel or ()) * (share / count)
            return fxshard.train_step(module, {source.input_name: piece(ids)}, loss_fn=loss_fn, target=target)
        out = module(**{source.input_name: piece(ids)})
        loss = token_loss_sum(out, piece(labels), *program.vocab_parallel or ()) / count
        (loss * dims.dp).backward()
        return loss

    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    if program.pipelined:
        step()  # the first step sends torch's shape metadata: not a step's traffic
        opt.zero_grad(set_to_none=True)
    saved = SavedLog(module)
    with CommLog() as log, saved.hooks():
        step()
    params = sum(_local_bytes(p) for p in module.parameters())
    grads = sum(_local_bytes(p.grad) for p in module.parameters() if p.grad is not None)
    opt.step()
    optim = sum(_local_bytes(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s)

    def timed_step() -> float:
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        opt.step()
        dist.barrier()
        return time.perf_counter() - t0

    return {"params": params, "grads": grads, "optimizer": optim, "activations": saved.peak,
            "comm": [[k, b, n] for (k, b), n in sorted(log.calls.items())],
            "pp_rank": mesh["pp"].get_local_rank() if dims.pp > 1 else 0}, timed_step


def measure_configs(rank: int, world_size: int, configs: list[dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    results, steps = {}, {}
    for cfg in configs:
        torch.manual_seed(0)
        results[cfg["name"]], steps[cfg["name"]] = _one(rank, world_size, cfg)
    times: dict[str, list[float]] = {c["name"]: [] for c in configs if c.get("timed")}
    for _ in range(max((c.get("timed", 0) for c in configs), default=0)):
        for name in times:
            times[name].append(steps[name]())
    for name, ts in times.items():
        results[name]["seconds"] = min(ts)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def read_results(out_dir: str, world_size: int) -> list[dict]:
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world_size)]


def calibrate_and_measure(rank: int, world_size: int, configs: list[dict], out_dir: str) -> None:
    """The device and link constants measured by all ranks at once (as the steps will run:
    sharing the cores), written by rank 0 to ``out_dir/calibration.json``; then :func:`measure_configs`."""
    from fxshard.planner.calibration import calibrate

    torch.set_num_threads(1)
    cal = calibrate("cpu", repeats=3)
    if rank == 0:
        cal.save(os.path.join(out_dir, "calibration.json"))
    measure_configs(rank, world_size, configs, out_dir)
