"""Small mixture-of-experts transformers: the MoE tests, the example and the demo use them.

Two MoE block styles on the same Llama-style skeleton (``layers.{i}.attention_norm``,
``layers.{i}.attention`` with GQA and rotary embeddings, ``layers.{i}.moe_norm``, the
MoE block, final ``norm`` and ``output``):

* ``style="grouped"`` -- :class:`GroupedMoE` at ``layers.{i}.moe``: a ``gate`` linear
  (the router, with a bias), top-k routing written in the block, and
  :class:`GroupedExperts` called in the grouped convention ``experts(x,
  num_tokens_per_expert)`` with weights stacked ``[E, ...]`` (torchtitan style).
* ``style="mixtral"`` -- :class:`MixtralSparseMoE` at ``layers.{i}.block_sparse_moe``:
  ``gate`` + ``experts: nn.ModuleList`` of SwiGLU FFNs, with the HF transformers
  forward (a loop over experts with ``torch.where``; not traceable by torch.fx).

With ``vocab_size`` the model maps token ids to logits; without it, it maps hidden
states ``[B, S, dim]`` to ``[B, S, dim]`` (so tests can check input gradients).
Deterministic initialisation as in :mod:`fxshard.testing.models` (:func:`init_params`).

Example::

    model = moe_transformer(seed=0)                 # grouped experts, float inputs
    plan = fxshard.Plan(mesh, moe_plan("ep"), inputs={"x": {"ep": Shard(0)}})
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fxshard.testing.models import Attention, LlamaArgs, init_params

__all__ = [
    "MoEArgs", "MoETransformer", "GroupedExperts", "GroupedMoE", "MixtralExpert", "MixtralSparseMoE",
    "moe_transformer", "mixtral", "moe_plan", "mixtral_plan", "route_to", "run_moe_demo",
]


@dataclass
class MoEArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    n_experts: int = 4
    top_k: int = 2
    ffn_hidden: int = 32
    vocab_size: int | None = None
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    style: Literal["grouped", "mixtral"] = "grouped"
    experts_impl: Literal["loop", "gather"] = "loop"
    router_bias: bool = True

    def __post_init__(self):
        if self.style not in ("grouped", "mixtral"):
            raise ValueError(f"style must be 'grouped' or 'mixtral', got {self.style!r}")
        if self.experts_impl not in ("loop", "gather"):
            raise ValueError(f"experts_impl must be 'loop' or 'gather', got {self.experts_impl!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts], got {self.top_k}")

    def llama_args(self) -> LlamaArgs:
        return LlamaArgs(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                         vocab_size=self.vocab_size or 1, max_seq_len=self.max_seq_len, norm_eps=self.norm_eps)


# --------------------------------------------------------------------------- grouped experts


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts with stacked weights, called as ``experts(x, num_tokens_per_expert)``.

    ``x``: ``[T, dim]`` tokens sorted by expert; ``num_tokens_per_expert``: ``[E]``.
    ``impl="loop"`` splits ``x`` by the counts (``.tolist()``: not traceable by fx);
    ``impl="gather"`` gathers each token's expert weights (traceable, more memory).
    """

    def __init__(self, n_experts: int, dim: int, hidden: int, impl: str = "loop"):
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x, num_tokens_per_expert):
        if self.impl == "gather":
            ids = torch.repeat_interleave(torch.arange(self.w1.shape[0], device=x.device), num_tokens_per_expert)
            xs = x.unsqueeze(-1)
            h = F.silu((self.w1[ids] @ xs).squeeze(-1)) * (self.w3[ids] @ xs).squeeze(-1)
            return (self.w2[ids] @ h.unsqueeze(-1)).squeeze(-1)
        outs = []
        for e, xe in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append(F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e]))
        return torch.cat(outs)


class GroupedMoE(nn.Module):
    """Top-k MoE block: ``gate`` (router) linear, tokens sorted by expert, grouped experts."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts = args.n_experts
        self.top_k = args.top_k
        self.gate = nn.Linear(args.dim, args.n_experts, bias=args.router_bias)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.ffn_hidden, args.experts_impl)

    def forward(self, x):
        bsz, seqlen, dim = x.shape
        h = x.reshape(bsz * seqlen, dim)
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.n_experts)
        token = order // self.top_k
        y = self.experts(h[token], counts)
        y = y * weights.reshape(-1, 1)[order]
        return torch.zeros_like(h).index_add(0, token, y).reshape(bsz, seqlen, dim)


# --------------------------------------------------------------------------- Mixtral style


class MixtralExpert(nn.Module):
    """One SwiGLU expert: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoE(nn.Module):
    """Mixtral's sparse MoE block (HF transformers layout and forward): ``gate`` +
    ``experts: nn.ModuleList``; softmax in float32, top-k, renormalize, weighted sum."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts = args.n_experts
        self.top_k = args.top_k
        self.gate = nn.Linear(args.dim, args.n_experts, bias=args.router_bias)
        self.experts = nn.ModuleList(MixtralExpert(args.dim, args.ffn_hidden) for _ in range(args.n_experts))

    def forward(self, hidden_states):
        bsz, seqlen, dim = hidden_states.shape
        h = hidden_states.view(-1, dim)
        weights = F.softmax(self.gate(h), dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        mask = F.one_hot(selected, num_classes=self.n_experts).permute(2, 1, 0)  # [E, k, T]
        for e, expert in enumerate(self.experts):
            choice, token = torch.where(mask[e])
            if token.shape[0] == 0:  # as in HF; data-dependent Python: fx cannot trace this forward
                continue
            out.index_add_(0, token, expert(h[token]) * weights[token, choice, None])
        return out.view(bsz, seqlen, dim)


# --------------------------------------------------------------------------- the transformer


class MoEBlock(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.llama_args())
        self.moe_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.style == "grouped":
            self.moe = GroupedMoE(args)
        else:
            self.block_sparse_moe = MixtralSparseMoE(args)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis, None)
        moe = self.moe if hasattr(self, "moe") else self.block_sparse_moe
        return h + moe(self.moe_norm(h))


class MoETransformer(nn.Module):
    """Llama-style attention + MoE blocks (see the module docstring)."""

    def __init__(self, args: MoEArgs | None = None):
        super().__init__()
        args = args if args is not None else MoEArgs()
        self.args = args
        if args.vocab_size:
            self.vocab_size = args.vocab_size
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(MoEBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size or args.dim, bias=False)
        head_dim = args.dim // args.n_heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        ang = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)

    def forward(self, x):
        seqlen = x.shape[1]
        h = self.tok_embeddings(x) if self.args.vocab_size else x
        freqs_cis = self.freqs_cis.narrow(0, 0, seqlen)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def moe_transformer(seed: int = 0, args: MoEArgs | None = None, **overrides) -> MoETransformer:
    """``MoETransformer(replace(args or MoEArgs(), **overrides))`` initialised from ``seed``
    (expert weights ``randn / sqrt(fan_in)``, router bias ``0.1 * randn``)."""
    a = replace(args if args is not None else MoEArgs(), **overrides)
    with torch.random.fork_rng(devices=[]):
        model = MoETransformer(a)
    return init_params(model, seed).eval()


def mixtral(seed: int = 0, **overrides) -> MoETransformer:
    """A tiny Mixtral: token ids to logits, ``gate`` + ``nn.ModuleList`` experts, no router bias."""
    kw = dict(style="mixtral", vocab_size=128, router_bias=False)
    kw.update(overrides)
    return moe_transformer(seed, **kw)


def route_to(model: nn.Module, experts: list[int], strength: float = 20.0) -> nn.Module:
    """Force the routing (tests): every router's bias gets ``+strength`` on ``experts``,
    so every token picks them (in bias order when ``len(experts) == top_k``).  In place."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, (GroupedMoE, MixtralSparseMoE)):
                if mod.gate.bias is None:
                    raise ValueError(f"{name}.gate has no bias; build the model with router_bias=True")
                for rank, e in enumerate(experts):
                    mod.gate.bias[e] += strength - rank  # distinct, so the top-k order is fixed
    return model


# --------------------------------------------------------------------------- plans


def _attention_tp(tp: str) -> dict:
    from fxshard.plan.specs import colwise, rowwise

    plan = {f"layers.*.attention.{w}": colwise(tp) for w in ("wq", "wk", "wv")}
    plan["layers.*.attention.wo"] = rowwise(tp)
    return plan


def moe_plan(ep: str = "ep", tp: str | None = None) -> dict:
    """Experts of every ``layers.*.moe`` split over ``ep``; with ``tp``, attention is
    tensor-parallel (q/k/v column-, o row-parallel) over ``tp``."""
    from fxshard.runtime.moe import expert_parallel

    return {**(_attention_tp(tp) if tp else {}), "layers.*.moe": expert_parallel(ep)}


def mixtral_plan(ep: str = "ep", tp: str | None = None) -> dict:
    """``layers.*.block_sparse_moe`` expert-parallel over ``ep`` with the default
    router (softmax in float32, top-k from the block's ``top_k``, renormalize)."""
    from fxshard.runtime.moe import expert_parallel, softmax_topk

    return {**(_attention_tp(tp) if tp else {}), "layers.*.block_sparse_moe": expert_parallel(ep, router=softmax_topk())}


# --------------------------------------------------------------------------- the demo


def _demo_rank(rank: int, world_size: int, steps: int, layer: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fxshard.debug.dump import dump
    from fxshard.plan.plan import Plan
    from fxshard.runtime.collectives import all_reduce
    from fxshard.transform import transform

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model = mixtral(seed=0, n_experts=2 * world_size)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2 * world_size, 16), generator=g)
    targets = torch.randint(0, 128, (2 * world_size, 16), generator=g)
    sharded = transform(model, Plan(mesh, mixtral_plan("ep"), inputs={"x": {"ep": Shard(0)}}), (ids,))
    if rank == 0:
        print(f"fxshard MoE demo: Mixtral-style model, {model.args.n_experts} experts (top-{model.args.top_k}), "
              f"expert parallel on {world_size} gloo ranks, batch sharded over 'ep'\n")
        print(dump(sharded, region=f"{layer}.*", recursive=True))
        print()
    n = ids.shape[0] // world_size
    mine = slice(rank * n, (rank + 1) * n)

    def train(m, x, t):
        opt = torch.optim.SGD(m.parameters(), lr=0.005)  # the loss is a sum over tokens
        losses = []
        for _ in range(steps):
            loss = F.cross_entropy(m(x).flatten(0, 1), t.flatten(), reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    ours = train(sharded, ids[mine], targets[mine])
    ours = [all_reduce(l, "ep").item() for l in ours]  # the sum of the per-rank losses
    reference = train(mixtral(seed=0, n_experts=2 * world_size), ids, targets)
    if rank == 0:
        print(f"{'step':>4}  {'fxshard loss':>13}  {'1-device loss':>13}  {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(ours, reference)):
            print(f"{i:>4}  {a:>13.5f}  {b.item():>13.5f}  {abs(a - b.item()):>9.2e}")
        worst = max(abs(a - b.item()) / max(1.0, abs(b.item())) for a, b in zip(ours, reference))
        print(f"\nmax relative loss difference over {steps} SGD steps: {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"fxshard MoE demo: sharded and single-device losses differ by {worst:.2e}")


def run_moe_demo(world_size: int = 2, steps: int = 3, layer: str = "layers.0") -> int:
    """``python -m fxshard demo --moe``: a tiny Mixtral, expert parallel over
    ``world_size`` gloo ranks on CPU: dump one layer (with the all-to-alls inside the
    MoE block), train a few SGD steps and compare the loss with one device."""
    from fxshard.testing.launch import spawn

    spawn(_demo_rank, world_size, steps, layer)
    return 0
