"""A reference training loop around fxshard: copy it and change the model and the data.

    torchrun --nproc-per-node 4 examples/train.py --model qwen3 --mesh dp=2,tp=2 --steps 20 \
        --clip 1.0 --accum 2 --ckpt-every 5 --ckpt-dir /tmp/ckpt
    python examples/train.py --model qwen3 --steps 20 --clip 1.0 --accum 2       # one process

What it shows, in the order a step runs:

* the model: a tiny HF causal LM built from its config class (``--model`` is an HF model
  type: ``qwen3``, ``llama``, ``mistral``, ``mixtral``...; random weights, no download), or
  torchtitan's Llama 3 (``--model torchtitan-llama3``, with torchtitan's own plan);
* the mesh: ``--mesh dp=2,tp=2`` (``dp``: FSDP2 over the batch; ``tp``/``ep``: the model's
  own plan, ``fxshard.Plan.from_hf``); one process: the plain model, no transform;
* the batch: every rank reads the same global batch of a step (seeded by the step, so a
  resumed run reads what the uninterrupted one read) and takes its share with
  ``fxshard.shard_inputs``; ``--accum k`` micro-batches, all but the last under
  ``fxshard.no_sync`` (one gradient sync per step);
* the loss: the sum of the token losses over the global count of scored tokens (-100 is
  padding), so every micro-batch and rank weighs its tokens as one device would;
  logged as the global mean with ``fxshard.reduce_over``;
* ``fxshard.clip_grad_norm_`` (the whole model's norm), AdamW, warmup + cosine;
* ``--bf16``: autocast to bf16 (parameters, gradients and their reductions stay fp32);
* ``--activation-checkpointing``: HF's ``gradient_checkpointing_enable()``, which
  ``fxshard.transform`` keeps per block (``fxshard.checkpoint_blocks``);
* ``--compile inductor``: ``fxshard.compile``, one compiled graph per transformer block,
  shared by the identical ones (FSDP2's hooks stay outside the graphs);
* checkpoints: ``fxshard.save(..., state=...)`` every ``--ckpt-every`` steps, committed
  only once every rank has written, and an automatic resume from
  ``fxshard.latest_checkpoint`` (so ``torchrun --max-restarts=N`` resumes a killed run);
* at the end, ``final checksum <float>``: the sum of the full state dict, in float64.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os

import torch
import torch.nn.functional as F

import fxshard


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3", help="an HF model type, built tiny from its config class")
    p.add_argument("--mesh", default="", help="axes and sizes, e.g. dp=2,tp=2 (their product: the number of processes)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows) of a step")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="HF's gradient_checkpointing_enable(): fxshard checkpoints each block of the sharded program")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="on a mesh: fxshard.compile, one graph per transformer block (aot_eager, inductor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--keep-last", type=int, default=2)
    return p.parse_args(argv)


TORCHTITAN = "torchtitan-llama3"


def build_model(name: str, seed: int):
    """``name``: an HF model type (``qwen3``) or ``torchtitan-llama3``: tiny, random weights."""
    if name == TORCHTITAN:
        from fxshard.testing.torchtitan_models import tiny_llama3

        return tiny_llama3(seed=seed, attn="sdpa")
    from fxshard.testing.hf_tiny import tiny_model

    return tiny_model(name, seed=seed)


def vocab_size(model) -> int:
    text_config = getattr(getattr(model, "config", None), "get_text_config", None)  # HF's
    return text_config().vocab_size if text_config is not None else model.tok_embeddings.num_embeddings


def logits_of(out):
    return getattr(out, "logits", out)  # an HF ModelOutput, or torchtitan's logits tensor


def global_batch(step: int, args, vocab: int):
    """The step's batch, the same on every rank: ``input_ids`` and ``labels`` (the next
    tokens are scored; the first quarter of each row is a prompt, -100); seeded by the step."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    # a learnable stream: each row counts from a random start by a random stride
    start = torch.randint(0, vocab - 3, (args.batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch, 1), generator=g)
    ids = (start + stride * torch.arange(args.seq)) % (vocab - 3) + 3
    labels = ids.clone()
    labels[:, : args.seq // 4] = -100
    return ids, labels


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss summed over the scored tokens (logits at t predict labels at t+1)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


def make_mesh(spec: str):
    axes = dict((k, int(v)) for k, v in (part.split("=") for part in spec.split(",") if part))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if math.prod(axes.values() or [1]) != world:
        raise SystemExit(f"--mesh {spec or '(none)'} has {math.prod(axes.values() or [1])} ranks; {world} processes run")
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    init_process_group()
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def init_process_group() -> None:
    """torchrun's process group, keyed by the restart count.  After ``--max-restarts``
    restarts the workers, they meet in the same store as the killed ones did, whose gloo
    addresses are still there: a restarted rank can read a dead peer's address and fail to
    connect.  A prefix per attempt keeps each attempt's keys apart."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=rank, world_size=world)


def shard_model(model, mesh, args, example):
    """The per-rank program: the model's own plan over tp/ep, FSDP2 over dp."""
    from torch.distributed.tensor import Shard

    axes = mesh.mesh_dim_names
    titan = args.model == TORCHTITAN
    name = "tokens" if titan else "input_ids"
    if {"tp", "ep"} & set(axes):
        plan = fxshard.Plan.from_torchtitan(mesh, model) if titan else fxshard.Plan.from_hf(mesh, model)
    else:
        plan = fxshard.Plan(mesh, {})
    if "dp" in axes:
        plan = plan.replace(inputs={**plan.inputs, name: {"dp": Shard(0)}}, fsdp="dp")
    # blocks="auto": one submodule per transformer block, for FSDP2's per-block hooks and fxshard.compile
    sharded = fxshard.transform(model, plan, example_kwargs={name: example}, blocks="auto" if args.compile else None)
    if "dp" in axes:
        fxshard.fully_shard(sharded, mesh)
    if args.compile:
        fxshard.compile(sharded, backend=args.compile)  # after fully_shard: its hooks stay outside the graphs
    return sharded


def lr_lambda(args):
    def at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return at


def main(argv=None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = make_mesh(args.mesh)
    rank = torch.distributed.get_rank() if mesh is not None else 0
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.seed)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()  # kept per block by fxshard.transform (fxshard.checkpoint_blocks)
    vocab = vocab_size(model)
    name = "tokens" if args.model == TORCHTITAN else "input_ids"
    example, _ = global_batch(0, args, vocab)
    fsdp = mesh is not None and "dp" in mesh.mesh_dim_names
    module = shard_model(model, mesh, args, example) if mesh is not None else model
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    dp = mesh["dp"].size() if fsdp else 1
    # bf16: autocast (fp32 parameters, gradients and reductions; matmuls in bf16).  Not FSDP2's
    # param_dtype: a captured HF graph keeps the fp32 casts it was captured with (RMSNorm's .to(input_dtype))
    autocast = (torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
                if args.bf16 else contextlib.nullcontext())

    start = 0
    latest = fxshard.latest_checkpoint(args.ckpt_dir) if args.ckpt_dir else None
    if latest is not None:
        state = fxshard.load(module, latest, optimizer=opt)
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {latest} at step {start}", flush=True)

    for step in range(start, args.steps):
        ids, labels = global_batch(step, args, vocab)
        scored = int((labels[:, 1:] != -100).sum())  # the global count: every rank's tokens weigh the same
        if mesh is not None:
            _, mine = fxshard.shard_inputs(module, **{name: ids})
            ids = mine[name]
            labels = labels.chunk(dp)[mesh["dp"].get_local_rank()] if fsdp else labels
        opt.zero_grad()
        total = torch.zeros(())
        micro = list(zip(ids.chunk(args.accum), labels.chunk(args.accum)))
        for k, (i, l) in enumerate(micro):
            last = k == len(micro) - 1
            with (contextlib.nullcontext() if last or mesh is None else fxshard.no_sync(module)), autocast:
                loss = token_loss_sum(logits_of(module(**{name: i})), l) / scored
            (loss * dp).backward()  # FSDP2 averages over dp: times dp, the sum over ranks
            total = total + loss.detach().float()
        if args.clip:
            if mesh is not None:
                fxshard.clip_grad_norm_(module, args.clip)
            else:
                torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip)
        opt.step()
        sched.step()
        logged = fxshard.reduce_over(total, ["dp"], op="sum") if fsdp else total  # each dp rank holds its tokens' share
        if rank == 0:
            print(f"step {step + 1} loss {logged.item():.8f}", flush=True)
        if args.ckpt_dir and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            state = {"step": step + 1, "sched": sched.state_dict(), "rng": torch.get_rng_state()}
            path = os.path.join(args.ckpt_dir, f"step{step + 1:06d}")
            fxshard.save(module, path, optimizer=opt, state=state, keep_last=args.keep_last)

    full = fxshard.full_state_dict(module) if mesh is not None else module.state_dict()
    checksum = sum(float(t.double().sum()) for t in full.values() if t.is_floating_point())
    if rank == 0:
        print(f"final checksum {checksum!r}", flush=True)
    if mesh is not None:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
