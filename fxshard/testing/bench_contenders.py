"""The contenders of the step-time comparison (:mod:`fxshard.testing.bench`): the benchmarked
sizes, the ``parallelize_module`` plan dicts, hand-written Megatron layers, transformers'
Llama under HF's own tensor parallelism, and the dp x tp builds; each ``build_*`` returns
``({contender: module}, batch, single-device loss of the first step or None)``.

Example::

    from fxshard.testing.bench_contenders import SIZES, torch_llama_plan
    plan = fxshard.Plan.from_torch(mesh, torch_llama_plan())
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

import torch.nn.functional as F
from torch import nn


_c10d = torch.ops._c10d_functional

CONTENDERS = ("megatron", "fxshard", "dtensor")  # the reference first
MODES = ("eager", "aot_eager", "inductor")  # "eager": no torch.compile; else the compile backend


@dataclass(frozen=True)
class StepSize:
    """One benchmarked shape: the Llama and its batch."""

    name: str
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 128
    vocab_size: int = 128
    batch: int = 4
    seqlen: int = 16
    iters: int = 60  # default timed steps per contender: many when steps are short and noisy

    def model_args(self) -> dict:
        return dict(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                    ffn_hidden=self.ffn_hidden, vocab_size=self.vocab_size, max_seq_len=max(32, self.seqlen))

    def describe(self) -> str:
        return (f"dim {self.dim}, {self.n_layers} layers, {self.n_heads}/{self.n_kv_heads} heads, ffn {self.ffn_hidden}, "
                f"vocab {self.vocab_size}, batch {self.batch}x{self.seqlen}")


SIZES = {
    # the demo model: CPU overhead (Python, dispatch, collectives' latency) dominates
    "small": StepSize("small"),
    # matmuls dominate (still runs in seconds per step on one CPU core per rank)
    "large": StepSize("large", dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=1536, vocab_size=4096,
                      batch=4, seqlen=128, iters=15),
    # a realistic hidden size for one GPU (benchmarks/gpu.sh)
    "gpu": StepSize("gpu", dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32768,
                    batch=4, seqlen=1024, iters=10),
}


# --------------------------------------------------------------------------- the plan dict


def torch_llama_plan(sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
    """The ``parallelize_module`` plan for :class:`fxshard.testing.models.Llama` (torchtitan's).

    ``Plan.from_torch(mesh, torch_llama_plan())`` equals ``Plan(mesh, llama_plan())``;
    the step-time benchmark checks it and gives the same dict to both contenders.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel)

    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan.update({
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None)),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    if sequence_parallel or loss_parallel:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    return plan


def localize_llama_heads(model: nn.Module, tp: int) -> nn.Module:
    """After ``parallelize_module``, the attention's literal head counts must be local
    (the usual step of DTensor tensor parallelism: its views see local tensors)."""
    for layer in model.layers:
        attn = layer.attention
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
        attn.q_size //= tp
        attn.kv_size //= tp
    return model


# --------------------------------------------------------------------------- hand-written Megatron


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group_name))


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group_name), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group_name):
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _rows(w: torch.Tensor, rank: int, n: int) -> nn.Parameter:
    return nn.Parameter(w.detach().chunk(n, 0)[rank].clone())


def _cols(w: torch.Tensor, rank: int, n: int) -> nn.Parameter:
    return nn.Parameter(w.detach().chunk(n, 1)[rank].clone())


class _MegatronAttention(nn.Module):
    def __init__(self, attn: nn.Module, rank: int, n: int, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.n_heads, self.n_kv_heads = attn.n_heads // n, attn.n_kv_heads // n
        self.head_dim, self.half_dim, self.n_rep = attn.head_dim, attn.half_dim, attn.n_rep
        self.wq = _rows(attn.wq.weight, rank, n)  # heads are contiguous rows: a chunk is whole heads
        self.wk = _rows(attn.wk.weight, rank, n)
        self.wv = _rows(attn.wv.weight, rank, n)
        self.wo = _cols(attn.wo.weight, rank, n)

    def _rope(self, x, freqs_cis, bsz, seqlen, heads):
        x_ = torch.view_as_complex(x.float().reshape(bsz, seqlen, heads, -1, 2))
        return torch.view_as_real(x_ * freqs_cis.view(1, seqlen, 1, self.half_dim)).flatten(3).type_as(x)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        x = _CopyToTP.apply(x, self.group_name)
        q = F.linear(x, self.wq).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = F.linear(x, self.wk).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = F.linear(x, self.wv).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q = self._rope(q, freqs_cis, bsz, seqlen, self.n_heads)
        k = self._rope(k, freqs_cis, bsz, seqlen, self.n_kv_heads)
        if self.n_rep > 1:
            k = torch.repeat_interleave(k, self.n_rep, dim=2)
            v = torch.repeat_interleave(v, self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)
        return _ReduceFromTP.apply(F.linear(out, self.wo), self.group_name)


class _MegatronFeedForward(nn.Module):
    def __init__(self, ff: nn.Module, rank: int, n: int, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.w1, self.w3 = _rows(ff.w1.weight, rank, n), _rows(ff.w3.weight, rank, n)
        self.w2 = _cols(ff.w2.weight, rank, n)

    def forward(self, x):
        x = _CopyToTP.apply(x, self.group_name)
        h = F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3)
        return _ReduceFromTP.apply(F.linear(h, self.w2), self.group_name)


class _MegatronBlock(nn.Module):
    def __init__(self, block: nn.Module, rank: int, n: int, group_name: str):
        super().__init__()
        self.attention_norm = copy.deepcopy(block.attention_norm)
        self.attention = _MegatronAttention(block.attention, rank, n, group_name)
        self.ffn_norm = copy.deepcopy(block.ffn_norm)
        self.feed_forward = _MegatronFeedForward(block.feed_forward, rank, n, group_name)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class MegatronLlama(nn.Module):
    """Hand-written Megatron tensor parallelism of a :class:`fxshard.testing.models.Llama`
    (complex rope, unfused projections): q/k/v and w1/w3 column-parallel behind one
    ``f`` (grad all-reduce), o and w2 row-parallel followed by ``g`` (all-reduce);
    embedding, norms and LM head replicated.  No fx: the reference for the benchmarks.

    Example::

        local = MegatronLlama(model, rank=dist.get_rank(), n=2, group_name=dist.group.WORLD.group_name)
        logits = local(ids)   # == model(ids) on every rank
    """

    def __init__(self, model: nn.Module, rank: int, n: int, group_name: str):
        super().__init__()
        a = model.args
        if a.rope != "complex" or a.fused_qkv or a.fused_w13:
            raise ValueError("MegatronLlama: written for rope='complex' and unfused projections")
        if a.n_kv_heads % n:
            raise ValueError(f"MegatronLlama: n_kv_heads={a.n_kv_heads} is not divisible by tp={n}")
        self.tok_embeddings = copy.deepcopy(model.tok_embeddings)
        self.layers = nn.ModuleList(_MegatronBlock(b, rank, n, group_name) for b in model.layers)
        self.norm = copy.deepcopy(model.norm)
        self.output = copy.deepcopy(model.output)
        self.register_buffer("freqs_cis", model.freqs_cis.clone(), persistent=False)

    def forward(self, tokens):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------- contenders


def build_contenders(size: StepSize, mesh, device: str) -> tuple[dict[str, nn.Module], tuple, float]:
    """The three contenders, their batch ``(ids, targets)`` and the single-device loss of
    the first step (their reference)."""
    from fxshard.plan.plan import Plan
    from fxshard.transform import transform
    from fxshard.testing.models import llama, llama_plan, tokens
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    model = llama(seed=0, **size.model_args()).to(device)
    ids = tokens(size.batch, size.seqlen, size.vocab_size, seed=1).to(device)
    plan_dict = torch_llama_plan()
    plan = Plan.from_torch(mesh, plan_dict)
    if plan != Plan(mesh, llama_plan("tp")):
        raise AssertionError(f"Plan.from_torch(torch_llama_plan()) differs from llama_plan():\n{plan}\n{Plan(mesh, llama_plan('tp'))}")
    group_name = mesh.get_group("tp").group_name
    contenders = {
        "megatron": MegatronLlama(model, mesh.get_local_rank("tp"), tp, group_name),
        "fxshard": transform(model, plan, example_inputs=(ids.clone(),)),
        "dtensor": localize_llama_heads(parallelize_module(copy.deepcopy(model), mesh, plan_dict), tp),
    }
    targets = tokens(size.batch, size.seqlen, size.vocab_size, seed=2).to(device)
    with torch.no_grad():
        single = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten()).item()
    return {name: contenders[name] for name in CONTENDERS}, (ids, targets), single



# --------------------------------------------------------------------------- HF Llama


HF_CONTENDERS = ("hf_tp", "fxshard", "dtensor", "single")  # the reference first

HF_SIZES = {
    # CPU overhead (Python, dispatch, hooks, the latency of collectives) dominates
    "small": StepSize("small", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=2048,
                      batch=4, seqlen=32, iters=40),
    # matmuls dominate: about a second per step on one core per rank
    "large": StepSize("large", dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_hidden=2816, vocab_size=8192,
                      batch=2, seqlen=256, iters=8),
    # a realistic hidden size for one GPU each (torchrun)
    "gpu": StepSize("gpu", dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32768,
                    batch=4, seqlen=1024, iters=10),
}


def hf_llama_config(size: StepSize):
    """The transformers ``LlamaConfig`` of ``size`` (no KV cache: training)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=size.dim, intermediate_size=size.ffn_hidden, num_hidden_layers=size.n_layers,
                       num_attention_heads=size.n_heads, num_key_value_heads=size.n_kv_heads,
                       vocab_size=size.vocab_size, max_position_embeddings=max(128, size.seqlen), use_cache=False)


def hf_llama(size: StepSize, seed: int = 0) -> nn.Module:
    """``LlamaForCausalLM`` of ``size`` with random weights (``seed``), in train mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(hf_llama_config(size)).train()


def torch_hf_llama_plan() -> dict:
    """The ``parallelize_module`` plan equal to HF's own Llama TP plan (``model.tp_plan``):
    q/k/v and gate/up ``colwise``, o and down ``rowwise``, the token embedding
    vocab-parallel (``embedding_rowwise``) and the LM head ``colwise_gather_output``.
    HF's attention reshapes with ``-1`` heads, so local outputs need no head fix-up."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        plan[f"model.layers.*.{name}"] = ColwiseParallel()
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        plan[f"model.layers.*.{name}"] = RowwiseParallel()
    return plan


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars, no deprecation chatter from transformers while loading."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _torchrun_env(rank: int, world_size: int) -> Iterator[None]:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as torchrun sets them (transformers' TP
    reads them; spawned gloo ranks joined by TCP have none), restored afterwards."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    for k, v in zip(keys, (rank, world_size, rank)):
        os.environ.setdefault(k, str(v))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hf_tp_model(model: nn.Module, mesh) -> nn.Module:
    """HF's own tensor parallelism of ``model``: rank 0 ``save_pretrained`` s it to a
    temporary directory, then every rank loads it with ``from_pretrained(dir, tp_plan="auto")``
    (transformers builds its own ``("pp", "fsdp", "tp")`` mesh over the world, which must
    therefore be ``mesh``; the ranks must share a file system)."""
    if mesh.size() != dist.get_world_size():  # (HF's loader places the shards on its own device: LOCAL_RANK's)
        raise ValueError(f"HF's tp_plan='auto' shards over the whole world ({dist.get_world_size()} ranks), "
                         f"not over a {mesh.size()}-rank mesh")
    rank = dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="fxshard_hf_tp_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = holder[0]
    try:
        with _quiet_transformers():
            if rank == 0:
                model.save_pretrained(path)
            dist.barrier()
            with _torchrun_env(rank, dist.get_world_size()):
                tp = type(model).from_pretrained(path, tp_plan="auto")
        dist.barrier()  # every rank has read the files
    finally:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return tp.train()


def build_hf_contenders(size: StepSize, mesh, device: str) -> tuple[dict[str, nn.Module], dict, None]:
    """HF's TP, fxshard, DTensor and one device on ``LlamaForCausalLM`` of ``size``, all
    from the same weights, and their batch ``{"input_ids", "labels"}``."""
    from fxshard.plan.plan import Plan
    from fxshard.transform import transform
    from fxshard.testing.models import tokens
    from torch.distributed.tensor.parallel import parallelize_module

    model = hf_llama(size, seed=0).to(device)
    labels = tokens(size.batch, size.seqlen, size.vocab_size, seed=2)
    labels[:, :max(1, size.seqlen // 4)] = -100  # the prompt masked, as in a real batch
    batch = {"input_ids": tokens(size.batch, size.seqlen, size.vocab_size, seed=1).to(device), "labels": labels.to(device)}
    example = {name: t.clone() for name, t in batch.items()}  # transformed on other tensors than it runs on
    contenders = {
        "hf_tp": hf_tp_model(model, mesh),
        "fxshard": transform(model, Plan.from_hf(mesh, model), example_kwargs=example).train(),
        "dtensor": parallelize_module(copy.deepcopy(model), mesh, torch_hf_llama_plan()),
        "single": copy.deepcopy(model),  # every rank computes the whole model: the time of one device
    }
    return {name: contenders[name] for name in HF_CONTENDERS}, batch, None


def hf_train_step(model, opt, batch: dict) -> torch.Tensor:
    loss = model(**batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


# --------------------------------------------------------------------------- dp x tp: FSDP2


# the reference first; dtensor and fxshard compose with FSDP2 over dp, fxshard_dp_* sum the gradients over dp
# themselves (DDP's way), waiting on each bucket at once (sync) or at the end of the backward (overlap)
FSDP_CONTENDERS = ("dtensor", "fxshard", "fxshard_dp_sync", "fxshard_dp_overlap")
DP_BUCKET_MB = 4.0  # about a layer of the "large" size per bucket: the first all-reduce starts mid-backward


class _GradTimes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class MeanOverDp(nn.Module):
    """A program whose gradients fxshard sums over the batch-sharded axis it owns
    (docs/design.md §6), stepping as FSDP2's mean: its output's gradient is scaled by
    ``1 / dp`` (a power of two: exact)."""

    def __init__(self, program: nn.Module, dp: int):
        super().__init__()
        self.program, self.scale = program, 1.0 / dp

    def forward(self, ids):
        return _GradTimes.apply(self.program(ids), self.scale)


def build_fsdp_contenders(size: StepSize, mesh, device: str) -> tuple[dict[str, nn.Module], tuple, None]:
    """On a ``("dp", "tp")`` mesh: torchtitan's recipe (DTensor TP over ``tp``, then
    FSDP2's ``fully_shard`` per block and on the root over ``dp``) and fxshard's
    (``Plan(fsdp="dp")``, :func:`fully_shard_program`); each rank steps on its dp share
    of the batch."""
    from fxshard.plan.plan import Plan
    from fxshard.training.fsdp import fully_shard as fully_shard_program
    from fxshard.transform import transform
    from fxshard.testing.models import llama, llama_plan, tokens
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if size.batch % dp:
        raise ValueError(f"batch {size.batch} of size {size.name!r} does not divide over dp={dp}")
    model = llama(seed=0, **size.model_args()).to(device)
    ids = tokens(size.batch, size.seqlen, size.vocab_size, seed=1).to(device)
    targets = tokens(size.batch, size.seqlen, size.vocab_size, seed=2).to(device)
    plan = Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    ours = fully_shard_program(transform(model, plan, example_inputs=(ids.clone(),)), mesh)
    titan = localize_llama_heads(parallelize_module(copy.deepcopy(model), mesh["tp"], torch_llama_plan()), tp)
    for layer in titan.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(titan, mesh=mesh["dp"])
    contenders = {"dtensor": titan, "fxshard": ours}
    dp_plan = Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})
    for name, overlap in (("fxshard_dp_sync", False), ("fxshard_dp_overlap", True)):
        contenders[name] = MeanOverDp(transform(model, dp_plan, example_inputs=(ids.clone(),),
                                                        bucket_cap_mb=DP_BUCKET_MB, overlap_grad_syncs=overlap), dp)
    n = size.batch // dp
    mine = slice(mesh.get_local_rank("dp") * n, (mesh.get_local_rank("dp") + 1) * n)
    # each rank's loss is the mean over its own share: no single-device loss to compare it with
    return contenders, (ids[mine], targets[mine]), None
