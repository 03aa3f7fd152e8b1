"""Random small transformer-like models x random sharding plans, for fuzzing fxshard.

A case is plain data (dataclasses of ints, strings, tuples and dicts), so the
falsifying example hypothesis prints is a reproducer::

    from grammar import *                       # tests/fuzz on sys.path
    case = FuzzCase(model=ModelCfg(...), mesh=(("tp", 2),), entries=(...), ...)
    model = build_model(case.model)              # deterministic from case.model.seed
    inputs = build_inputs(case.model)            # global (single-device) inputs the program runs on
    example = build_example_inputs(case.model)   # other tensors to transform with (aliased: case.model.example)
    plan = build_plan(case, mesh)                # an fxshard.Plan on a DeviceMesh or MeshSpec
    print(plan_source(case))                     # the plan as fxshard code

Models (:class:`ModelCfg`) are built from the parts of real transformers: token
embeddings (with a literal or traced ``sqrt(dim)`` scale, learned positions
``pos_embed(torch.arange(S))``) or float inputs; pre-norm blocks (called positionally or
by keyword) with attention (separate, fused ``[q|k|v]`` split or grouped ``[groups,
parts, hd]`` projections; GQA by ``repeat_interleave`` or ``expand``; hand-written
attention ``q @ k^T * scale`` (a literal, ``1.0 / math.sqrt(q.size(-1))`` or
``q.size(-1) ** -0.5``) or ``einsum``, masked from a causal buffer sliced ``mask[:S, :S]``
(``masked_fill``, additive, ``torch.where``), ``F.scaled_dot_product_attention`` with
``is_causal`` or a mask; rotary tables narrowed ``torch.narrow(cos, 0, 0, S)`` by the model
or inside the attention; heads moved by transpose or permute and merged by reshape,
flatten or ``view(B, S, -1)``) and MLPs (plain, SwiGLU, fused ``w13`` chunked, grouped
``[G, 2, F]`` split or unbound; activations as functions or modules); norms as modules
(``nn.LayerNorm``, ``nn.RMSNorm``) or written out; a final norm; a linear, tied or
functional-tied (``F.linear(h, embed.weight)``) head; a tail view (flatten, split the last
dim, transpose) or an in-graph loss (cross entropy mean/sum, log_softmax + gather) on a
second input.  Widths are drawn mostly divisible by the mesh, sometimes not.  What third-party
code does and a capture must take as it is: masks and rotary tables kept as plain tensor
attributes (``self.mask = torch.tril(...)``, not buffers); trivial leaf modules on the path
(``nn.Identity``, ``nn.Dropout(0.0)``, activation modules); head-sharded values used only
for their shape (``torch.ones_like(scores[0, 0], dtype=torch.bool).tril()``,
``q.new_zeros(q.shape)``, ``q.size(1)``); and example inputs aliased where the run's are
distinct (:func:`build_example_inputs`: the ids passed as the targets too, or a view of
them), so an input bound by identity instead of by name is a wrong number.  Module names
follow Meta's Llama (``layers.0.attention.wq``, ``feed_forward.w1``, ``embed``, ``norm``,
``head``) so plan patterns look real.

Plans (:func:`fuzz_cases`) start from a right one (:func:`right_plan`: Megatron tensor
parallel, sequence parallel with per-module or per-projection gathers, data parallel, 2-D
tensor parallel over ``dp`` x ``tp``) on ``{"tp": 2}``, ``{"tp": 4}`` or ``{"dp": 2, "tp": 2}``
(batch sharded on ``dp``), may rewrite it without changing its meaning (:data:`REWRITES`:
presets spelled out as ModuleSpecs, ``w[qkv]`` patterns, redundant entries, negative dims,
bare placements, inputs by position), apply deliberate mistakes (:data:`MUTATIONS`:
swapped presets, missing or extra entries, wrong layouts and dims, unknown or mixed-up axes,
patterns that match nothing, wrong ``splits``, wrong graph-input layouts or names), and may
go through ``Plan.from_torch`` (torch's parallel styles) or ``capture="export"``.  A
quarter of the cases run at another batch and sequence length than the example inputs.

Layouts in a case are written with short strings: ``"R"`` (Replicate), ``"S0"``,
``"S-1"`` (Shard), ``"P"`` (Partial); a dict ``{"tp": "S0"}`` is a layout by axis; a
dict of layouts ``{"x": {"tp": "R"}}`` is keyed by forward argument name.  No case
ever asks for a ``Partial`` output layout, so the model output is comparable.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard.testing.models import RMSNorm  # hand-written: x * rsqrt(mean(x^2) + eps) * w

__all__ = [
    "AttnCfg", "MlpCfg", "BlockCfg", "ModelCfg", "Entry", "FuzzCase",
    "build_model", "build_inputs", "build_example_inputs", "build_plan", "plan_source", "right_plan", "model_configs", "fuzz_cases",
    "MESHES", "MUTATIONS", "REWRITES",
]

MESHES = ((("tp", 2),), (("tp", 4),), (("dp", 2), ("tp", 2)))


# ============================================================================ model description


@dataclass(frozen=True)
class AttnCfg:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv: str = "separate"   # "separate" wq/wk/wv | "fused" wqkv split [q|k|v] | "grouped" wqkv viewed [kv groups, parts, hd]
    core: str = "sdpa"      # "sdpa" (is_causal) | "sdpa_mask" (attn_mask=mask[:S, :S]) | "manual" (q @ k^T * scale,
                            # mask buffer, softmax, @ v) | "einsum" (manual with torch.einsum)
    gqa: str = "repeat_interleave"  # | "expand" (k[:, :, :, None].expand(...).reshape(...))
    scale: str = "literal"  # manual core: "literal" self.scale | "sqrt" 1.0 / math.sqrt(q.size(-1)) | "pow" q.size(-1) ** -0.5
    mask: str = "bool"      # manual core: "bool" masked_fill(~mask[:S, :S]) | "additive" scores + mask[:S, :S]
                            # | "where" torch.where(mask[:S, :S], scores, -inf)
    heads: str = "transpose"  # [B, S, H, hd] -> [B, H, S, hd]: "transpose" (1, 2) | "permute" (0, 2, 1, 3)
    softmax: str = "plain"  # "plain" | "float" F.softmax(scores.float(), -1).type_as(q)
    split_view: str = "literal"  # q/k/v views: "literal" view(B, S, H, hd) | "infer" view(B, S, -1, hd)
    rope: str = "none"      # "none" | "shared" (tables narrowed by the model, passed in) | "local" (narrowed here by x.size(1))
    rope_view: str = "view"  # "view" cos.view(1, S, 1, hd) | "index" cos[None, :, None, :]
    merge: str = "reshape"  # heads back: "reshape" (B, S, H*hd) | "flatten" flatten(2) | "view_infer" view(B, S, -1)
    bias: bool = False      # q/k/v (or wqkv) bias
    out_bias: bool = False  # wo bias
    shape_use: str = "none"  # a head-sharded value used only for its shape: "ones_like_tril" (manual cores: the causal
                            # mask is torch.ones_like(scores[0, 0], dtype=torch.bool).tril(), no buffer) | "new_zeros"
                            # (q + q.new_zeros(q.shape)) | "size" (heads merged by reshape(B, S, q.size(1) * q.size(-1)))


@dataclass(frozen=True)
class MlpCfg:
    kind: str = "mlp"       # "mlp" w2(act(w1)) | "swiglu" w2(silu(w1) * w3) | "fused" w13.chunk(2) | "grouped" w13 viewed [G, 2, F]
    hidden: int = 16
    groups: int = 2         # "grouped": hidden = groups * F
    act: str = "gelu"       # "gelu" | "relu" | "silu" (mlp kind)
    bias: bool = False
    act_module: bool = False  # the activation as a module (self.act = nn.GELU()) instead of F.gelu
    parts: str = "split"    # "grouped": the two parts by "split" (+ flatten) or "unbind"


@dataclass(frozen=True)
class BlockCfg:
    norm: str = "rmsnorm"   # "layernorm" nn.LayerNorm | "rmsnorm" nn.RMSNorm | "written_rms" | "written_ln"
    attn: AttnCfg | None = None
    mlp: MlpCfg | None = None
    call: str = "positional"  # the block calls attention / feed_forward "positional"-ly or by "keyword" (x=..., cos=...)


@dataclass(frozen=True)
class ModelCfg:
    dim: int = 16
    batch: int = 2
    seq: int = 4
    max_seq: int = 8
    input: str = "tokens"   # placeholder name: "tokens" / "input_ids" (nn.Embedding) or "x" / "hidden_states" (float)
    vocab: int = 16
    embed_scale: str = "none"  # "none" | "literal" h * sqrt(dim) | "traced" h * math.sqrt(h.size(-1))
    layers: tuple = ()
    final_norm: str | None = None
    head: str = "none"      # "none" | "linear" | "tied" (head.weight = embed.weight) | "functional" F.linear(h, embed.weight)
    head_out: int = 16
    head_bias: bool = False
    seq_from: str = "input"  # where the model reads S for the shared rotary tables: "input" | "hidden"
    tail: str = "none"      # "none" | "flatten" out.flatten(0, 1) | "split_last" out.view(B, S, 2, -1) | "transpose" out.transpose(0, 1)
    pos_embed: bool = False  # learned positions: + pos_embed(torch.arange(S)) (GPT-2's wpe), S read as for the rotary tables
    loss: str = "none"      # in-graph loss on the head's logits and a second input (targets): "none" | "ce" (mean) | "ce_sum"
                            # | "log_softmax" (-(log_softmax(logits).gather(targets)).mean())
    seed: int = 0
    tables: str = "buffer"  # masks and rotary tables: "buffer" (register_buffer) | "attribute" (a plain tensor
                            # attribute set in __init__, self.mask = torch.tril(...), as much third-party code has)
    leaf: str = "none"      # trivial leaf modules on the path: "none" | "identity" (nn.Identity) | "dropout"
                            # (nn.Dropout(0.0)): after the embedding, on attention probabilities, on the MLP hidden
    example: str = "distinct"  # the example inputs the model is transformed with (the run always passes distinct
                            # tensors of other values): "distinct" | "same" (one tensor under both names: targets is
                            # the ids) | "view" (targets a view of the ids); the aliased ones need ids and targets

    @property
    def uses_ids(self) -> bool:
        return self.input in ("tokens", "input_ids")

    @property
    def targets_name(self) -> str:
        return {"tokens": "targets", "input_ids": "labels", "x": "y", "hidden_states": "labels"}[self.input]

    @property
    def out_dim(self) -> int:
        return self.head_out if self.head in ("linear", "tied", "functional") else self.dim

    @property
    def same_layers(self) -> bool:
        return len(set(self.layers)) <= 1


# ============================================================================ model building blocks


class LayerNorm(nn.Module):
    """Hand-written LayerNorm (mean, centred second moment, rsqrt, affine)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        xc = x - x.mean(-1, keepdim=True)
        var = xc.pow(2).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + self.eps) * self.weight + self.bias


_NORMS = ("layernorm", "rmsnorm", "written_rms", "written_ln")
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, RMSNorm, LayerNorm)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=1e-5)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-5)
    if kind == "written_rms":
        return RMSNorm(dim)
    if kind == "written_ln":
        return LayerNorm(dim)
    raise ValueError(kind)


def rope_tables(head_dim: int, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x, half: int):
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def store_table(module: nn.Module, name: str, table: torch.Tensor, tables: str) -> None:
    """A mask or rotary table as a non-persistent buffer, or as a plain tensor attribute
    (``tables="attribute"``: not in ``named_buffers``, not in the state dict)."""
    if tables == "attribute":
        setattr(module, name, table)
    else:
        module.register_buffer(name, table, persistent=False)


def make_leaf(kind: str) -> nn.Module | None:
    """A trivial leaf module (computes its input unchanged), or None for ``"none"``."""
    if kind == "none":
        return None
    return {"identity": nn.Identity, "dropout": lambda: nn.Dropout(0.0)}[kind]()


class Attention(nn.Module):
    def __init__(self, dim: int, cfg: AttnCfg, max_seq: int, tables: str = "buffer", leaf: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.half = cfg.head_dim // 2
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if cfg.qkv == "separate":
            self.wq = nn.Linear(dim, self.q_size, bias=cfg.bias)
            self.wk = nn.Linear(dim, self.kv_size, bias=cfg.bias)
            self.wv = nn.Linear(dim, self.kv_size, bias=cfg.bias)
        else:
            self.wqkv = nn.Linear(dim, self.q_size + 2 * self.kv_size, bias=cfg.bias)
        self.wo = nn.Linear(self.q_size, dim, bias=cfg.out_bias)
        self.mask_from_shape = cfg.shape_use == "ones_like_tril" and cfg.core in ("manual", "einsum")
        if cfg.core in ("manual", "einsum", "sdpa_mask") and not self.mask_from_shape:
            causal = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool))
            additive = cfg.mask == "additive" and cfg.core != "sdpa_mask"
            mask = torch.zeros(max_seq, max_seq).masked_fill(~causal, float("-inf")) if additive else causal
            store_table(self, "mask", mask, tables)
        if cfg.rope == "local":
            cos, sin = rope_tables(cfg.head_dim, max_seq)
            store_table(self, "cos", cos, tables)
            store_table(self, "sin", sin, tables)
        self.leaf = leaf != "none"
        if self.leaf:
            self.attn_drop = make_leaf(leaf)

    def _rope(self, x, cos, sin, S):
        if self.cfg.rope_view == "view":
            c, s = cos.view(1, S, 1, self.head_dim), sin.view(1, S, 1, self.head_dim)
        else:
            c, s = cos[None, :, None, :], sin[None, :, None, :]
        return x * c + rotate_half(x, self.half) * s

    def _repeat(self, t, B, S):
        if self.n_rep == 1:
            return t
        if self.cfg.gqa == "repeat_interleave":
            return torch.repeat_interleave(t, self.n_rep, dim=2)
        t = t[:, :, :, None, :].expand(B, S, self.n_kv_heads, self.n_rep, self.head_dim)
        return t.reshape(B, S, self.n_heads, self.head_dim)

    def forward(self, x, cos=None, sin=None):
        cfg = self.cfg
        B, S, _ = x.shape
        H, K, hd = self.n_heads, self.n_kv_heads, self.head_dim
        hq, hk = (H, K) if cfg.split_view == "literal" else (-1, -1)
        if cfg.qkv == "separate":
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
            q, k, v = q.view(B, S, hq, hd), k.view(B, S, hk, hd), v.view(B, S, hk, hd)
        elif cfg.qkv == "fused":
            q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k, v = q.view(B, S, hq, hd), k.view(B, S, hk, hd), v.view(B, S, hk, hd)
        else:  # grouped: per kv group [n_rep q heads, k, v]
            qkv = self.wqkv(x).view(B, S, K, self.n_rep + 2, hd)
            q, k, v = qkv.split([self.n_rep, 1, 1], dim=3)
            q, k, v = q.reshape(B, S, H, hd), k.reshape(B, S, K, hd), v.reshape(B, S, K, hd)
        if cfg.rope == "local":
            cos, sin = torch.narrow(self.cos, 0, 0, S), torch.narrow(self.sin, 0, 0, S)
        if cfg.rope != "none":
            q, k = self._rope(q, cos, sin, S), self._rope(k, cos, sin, S)
        k, v = self._repeat(k, B, S), self._repeat(v, B, S)
        if cfg.heads == "transpose":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        if cfg.shape_use == "new_zeros":
            q = q + q.new_zeros(q.shape)  # a zeros tensor shaped like the (head-sharded) q
        if cfg.core == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif cfg.core == "sdpa_mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:S, :S])
        else:
            if cfg.scale == "literal":
                scale = self.scale
            elif cfg.scale == "sqrt":
                scale = 1.0 / math.sqrt(q.size(-1))
            else:
                scale = q.size(-1) ** -0.5
            if cfg.core == "einsum":
                scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
            else:
                scores = (q @ k.transpose(-2, -1)) * scale
            if self.mask_from_shape:  # [S, S] of a head-sharded [B, H, S, S]: its shape only
                causal = torch.ones_like(scores[0, 0], dtype=torch.bool).tril()
                mask = causal if cfg.mask != "additive" else torch.zeros_like(scores[0, 0]).masked_fill(~causal, float("-inf"))
            else:
                mask = self.mask[:S, :S]
            if cfg.mask == "bool":
                scores = scores.masked_fill(~mask, float("-inf"))
            elif cfg.mask == "where":
                scores = torch.where(mask, scores, float("-inf"))
            else:
                scores = scores + mask
            if cfg.softmax == "float":
                probs = F.softmax(scores.float(), dim=-1).type_as(q)
            else:
                probs = F.softmax(scores, dim=-1)
            if self.leaf:
                probs = self.attn_drop(probs)
            out = torch.einsum("bhqk,bhkd->bhqd", probs, v) if cfg.core == "einsum" else probs @ v
        out = out.transpose(1, 2) if cfg.heads == "transpose" else out.permute(0, 2, 1, 3)
        if cfg.shape_use == "size":  # the local width from the head-sharded q's sizes
            out = out.reshape(B, S, q.size(1) * q.size(-1))
        elif cfg.merge == "reshape":
            out = out.reshape(B, S, self.q_size)
        elif cfg.merge == "flatten":
            out = out.flatten(2)
        else:
            out = out.contiguous().view(B, S, -1)
        return self.wo(out)


_ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class FeedForward(nn.Module):
    def __init__(self, dim: int, cfg: MlpCfg, leaf: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.drop = make_leaf(leaf) or (lambda t: t)  # on the (feature-sharded) hidden, as HF's MLP dropout
        h = cfg.hidden
        if cfg.kind == "mlp":
            self.w1 = nn.Linear(dim, h, bias=cfg.bias)
        elif cfg.kind == "swiglu":
            self.w1 = nn.Linear(dim, h, bias=cfg.bias)
            self.w3 = nn.Linear(dim, h, bias=cfg.bias)
        else:
            self.w13 = nn.Linear(dim, 2 * h, bias=cfg.bias)
        self.w2 = nn.Linear(h, dim, bias=cfg.bias)
        if cfg.act_module:
            act = cfg.act if cfg.kind == "mlp" else "silu"
            self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "silu": nn.SiLU()}[act]
        else:
            self.act = _ACTS[cfg.act] if cfg.kind == "mlp" else F.silu

    def forward(self, x):
        cfg = self.cfg
        if cfg.kind == "mlp":
            return self.w2(self.drop(self.act(self.w1(x))))
        if cfg.kind == "swiglu":
            return self.w2(self.drop(self.act(self.w1(x)) * self.w3(x)))
        if cfg.kind == "fused":
            a, b = self.w13(x).chunk(2, dim=-1)
            return self.w2(self.act(a) * b)
        u = self.w13(x).unflatten(-1, (cfg.groups, 2, cfg.hidden // cfg.groups))
        if cfg.parts == "unbind":
            a, b = u.unbind(-2)
            return self.w2((self.act(a) * b).flatten(-2))
        a, b = u.split(1, dim=-2)
        return self.w2((self.act(a) * b).flatten(-3))


class Block(nn.Module):
    def __init__(self, dim: int, cfg: BlockCfg, max_seq: int, tables: str = "buffer", leaf: str = "none"):
        super().__init__()
        self.has_attn, self.has_mlp = cfg.attn is not None, cfg.mlp is not None
        self.keyword = cfg.call == "keyword"
        if self.has_attn:
            self.attention_norm = make_norm(cfg.norm, dim)
            self.attention = Attention(dim, cfg.attn, max_seq, tables, leaf)
        if self.has_mlp:
            self.ffn_norm = make_norm(cfg.norm, dim)
            self.feed_forward = FeedForward(dim, cfg.mlp, leaf)

    def forward(self, x, cos=None, sin=None):
        if self.has_attn:
            if self.keyword:
                x = x + self.attention(x=self.attention_norm(x), cos=cos, sin=sin)
            else:
                x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.has_mlp:
            x = x + (self.feed_forward(x=self.ffn_norm(x)) if self.keyword else self.feed_forward(self.ffn_norm(x)))
        return x


class FuzzModel(nn.Module):
    """``embed`` (or a float input), ``layers.{i}``, ``norm``, ``head``."""

    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.cfg = cfg
        if cfg.uses_ids:
            self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        if cfg.pos_embed:
            self.pos_embed = nn.Embedding(cfg.max_seq, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg.dim, b, cfg.max_seq, cfg.tables, cfg.leaf) for b in cfg.layers)
        shared = [b.attn for b in cfg.layers if b.attn is not None and b.attn.rope == "shared"]
        self.shared_rope = bool(shared)
        if shared:
            cos, sin = rope_tables(shared[0].head_dim, cfg.max_seq)
            store_table(self, "cos", cos, cfg.tables)
            store_table(self, "sin", sin, cfg.tables)
        if cfg.leaf != "none":
            self.embed_drop = make_leaf(cfg.leaf)
        if cfg.final_norm is not None:
            self.norm = make_norm(cfg.final_norm, cfg.dim)
        if cfg.head in ("linear", "tied"):
            self.head = nn.Linear(cfg.dim, cfg.head_out, bias=cfg.head_bias)
            if cfg.head == "tied":
                self.head.weight = self.embed.weight
        self.embed_scale = math.sqrt(cfg.dim)

    def _forward(self, inp, targets=None):
        cfg = self.cfg
        h = self.embed(inp) if cfg.uses_ids else inp
        if cfg.embed_scale == "literal":
            h = h * self.embed_scale
        elif cfg.embed_scale == "traced":
            h = h * math.sqrt(h.size(-1))
        if cfg.leaf != "none":
            h = self.embed_drop(h)
        cos = sin = None
        if self.shared_rope or cfg.pos_embed:
            S = inp.size(1) if cfg.seq_from == "input" else h.size(1)
        if cfg.pos_embed:
            h = h + self.pos_embed(torch.arange(S, device=inp.device))
        if self.shared_rope:
            cos, sin = torch.narrow(self.cos, 0, 0, S), torch.narrow(self.sin, 0, 0, S)
        for layer in self.layers:
            h = layer(h, cos, sin)
        if cfg.final_norm is not None:
            h = self.norm(h)
        if cfg.head in ("linear", "tied"):
            h = self.head(h)
        elif cfg.head == "functional":
            h = F.linear(h, self.embed.weight)
        if cfg.tail == "flatten":
            h = h.flatten(0, 1)
        elif cfg.tail == "split_last":
            B, S, _ = h.shape
            h = h.view(B, S, 2, -1)
        elif cfg.tail == "transpose":
            h = h.transpose(0, 1)
        if cfg.loss in ("ce", "ce_sum"):
            return F.cross_entropy(h.flatten(0, 1), targets.flatten(), reduction="mean" if cfg.loss == "ce" else "sum")
        if cfg.loss == "log_softmax":
            logp = F.log_softmax(h, dim=-1)
            return -logp.gather(-1, targets.unsqueeze(-1)).mean()
        return h


# the placeholder names are the forward's argument names
class TokensModel(FuzzModel):
    def forward(self, tokens):
        return self._forward(tokens)


class InputIdsModel(FuzzModel):
    def forward(self, input_ids):
        return self._forward(input_ids)


class XModel(FuzzModel):
    def forward(self, x):
        return self._forward(x)


class HiddenStatesModel(FuzzModel):
    def forward(self, hidden_states):
        return self._forward(hidden_states)


class TokensLossModel(FuzzModel):
    def forward(self, tokens, targets):
        return self._forward(tokens, targets)


class InputIdsLossModel(FuzzModel):
    def forward(self, input_ids, labels):
        return self._forward(input_ids, labels)


class XLossModel(FuzzModel):
    def forward(self, x, y):
        return self._forward(x, y)


class HiddenStatesLossModel(FuzzModel):
    def forward(self, hidden_states, labels):
        return self._forward(hidden_states, labels)


_MODEL_CLASSES = {"tokens": TokensModel, "input_ids": InputIdsModel, "x": XModel, "hidden_states": HiddenStatesModel}
_LOSS_MODEL_CLASSES = {"tokens": TokensLossModel, "input_ids": InputIdsLossModel, "x": XLossModel,
                       "hidden_states": HiddenStatesLossModel}


def init_params(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic, non-trivial values: norm weights 1 + 0.1 randn, biases 0.1 randn,
    embeddings 0.5 randn, other weights randn / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    owner = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod, leaf = owner[id(p)], name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=g)
            if isinstance(mod, NORM_TYPES):
                val = 1.0 + 0.1 * noise if leaf == "weight" else 0.1 * noise
            elif leaf == "bias":
                val = 0.1 * noise
            elif isinstance(mod, nn.Embedding):
                val = 0.5 * noise
            else:
                val = noise / math.sqrt(p.shape[-1] if p.dim() > 1 else p.shape[0])
            p.copy_(val)
    return model


def build_model(cfg: ModelCfg) -> nn.Module:
    """The single-device model of ``cfg`` (deterministic; the global RNG is untouched)."""
    with torch.random.fork_rng(devices=[]):
        model = (_LOSS_MODEL_CLASSES if cfg.loss != "none" else _MODEL_CLASSES)[cfg.input](cfg)
    return init_params(model, cfg.seed).eval()


def build_inputs(cfg: ModelCfg, shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """The global inputs: ids ``[B, S]`` or a float ``[B, S, dim]``, and class targets
    ``[B, S]`` for an in-graph loss (-100 on some positions for cross entropy); ``shape`` =
    ``(B, S)`` other than the config's."""
    B, S = shape or (cfg.batch, cfg.seq)
    g = torch.Generator().manual_seed(1000 + cfg.seed + 7 * B + S)
    if cfg.uses_ids:
        x = torch.randint(0, cfg.vocab, (B, S), generator=g)
    else:
        x = torch.randn(B, S, cfg.dim, generator=g)
    if cfg.loss == "none":
        return (x,)
    targets = torch.randint(0, cfg.out_dim, (B, S), generator=g)
    if cfg.loss in ("ce", "ce_sum"):  # cross entropy skips -100: the first position and about a quarter of the rest
        skip = torch.rand((B, S), generator=g) < 0.25
        skip[:, 0], skip[:, -1] = True, False
        targets = targets.masked_fill(skip, -100)
    return x, targets


def build_example_inputs(cfg: ModelCfg) -> tuple[torch.Tensor, ...]:
    """The inputs to transform with: new tensors, of other values than :func:`build_inputs`
    (the run's), at the config's ``(B, S)``.  ``cfg.example == "same"`` passes one ids
    tensor as both the ids and the targets, ``"view"`` the targets as a view of the ids
    (values below both the vocabulary and the head's width); the run passes distinct
    tensors, so a capture that binds inputs by identity computes from the wrong one."""
    B, S = cfg.batch, cfg.seq
    g = torch.Generator().manual_seed(5000 + cfg.seed + 7 * B + S)
    if cfg.example != "distinct":
        ids = torch.randint(0, min(cfg.vocab, cfg.out_dim), (B, S), generator=g)
        return ids, (ids if cfg.example == "same" else ids.view(B, S))
    x = torch.randint(0, cfg.vocab, (B, S), generator=g) if cfg.uses_ids else torch.randn(B, S, cfg.dim, generator=g)
    if cfg.loss == "none":
        return (x,)
    return x, torch.randint(0, cfg.out_dim, (B, S), generator=g)


# ============================================================================ plan description


def placement(s: str):
    if s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    if s.startswith("S"):
        return Shard(int(s[1:]))
    raise ValueError(f"placement {s!r}")


def layout_of(v):
    """A case's layout form -> what a user writes in a plan: "S0" -> Shard(0),
    {"tp": "S0"} -> {"tp": Shard(0)}, {"x": {"tp": "R"}} -> {"x": {"tp": Replicate()}}."""
    if v is None:
        return None
    if isinstance(v, str):
        return placement(v)
    if isinstance(v, dict):
        return {k: layout_of(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return tuple(layout_of(x) for x in v)
    raise TypeError(v)


def _src(v) -> str:
    """A layout form as plan source code."""
    if v is None:
        return "None"
    if isinstance(v, str):
        p = placement(v)
        return f"Shard({p.dim})" if isinstance(p, Shard) else f"{type(p).__name__}()"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_src(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_src(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


_ENTRY_FIELDS = ("axis", "inputs", "out", "splits", "dim", "params", "in_src", "out_src", "out_dst", "optional", "style_hint")


@dataclass
class Entry:
    """One plan entry: a preset (``style`` "colwise", "rowwise", "sequence_parallel",
    "vocab_parallel") with its options, or a hand-written ModuleSpec (``style`` "spec")."""

    pattern: str
    style: str
    axis: str = "tp"
    inputs: Any = None
    out: Any = None
    splits: tuple | None = None
    dim: int | None = None
    params: dict | None = None
    in_src: Any = None
    out_src: Any = None
    out_dst: Any = None
    optional: tuple | None = None  # spec: optional_params (a Linear without bias)
    style_hint: str | None = None  # torch front end: PrepareModuleInput by "kwargs" or by position

    def __repr__(self) -> str:
        kw = [f"{f}={getattr(self, f)!r}" for f in _ENTRY_FIELDS
              if getattr(self, f) is not None and not (f == "axis" and self.style == "spec")]
        return f"Entry({self.pattern!r}, {self.style!r}" + "".join(", " + k for k in kw) + ")"

    def to_spec(self) -> fxshard.ModuleSpec:
        if self.style in ("colwise", "rowwise"):
            kw = {}
            if self.inputs is not None:
                kw["inputs"] = layout_of(self.inputs)
            if self.out is not None:
                kw["out"] = layout_of(self.out)
            if self.splits is not None:
                if self.style != "colwise":
                    raise ValueError("splits on rowwise")
                kw["splits"] = list(self.splits)
            return getattr(fxshard, self.style)(self.axis, **kw)
        if self.style == "sequence_parallel":
            return fxshard.sequence_parallel(self.axis, **({} if self.dim is None else {"dim": self.dim}))
        if self.style == "vocab_parallel":
            return fxshard.vocab_parallel(self.axis, **({} if self.out is None else {"out": layout_of(self.out)}))
        if self.style == "spec":
            return fxshard.ModuleSpec(params={k: layout_of(v) for k, v in (self.params or {}).items()},
                                      inputs=layout_of(self.inputs), in_src=layout_of(self.in_src),
                                      out_src=layout_of(self.out_src), out_dst=layout_of(self.out_dst),
                                      splits=self.splits, optional_params=tuple(self.optional or ()))
        raise ValueError(self.style)

    def torch_style(self, axis: str):
        """The ``torch.distributed.tensor.parallel`` style this entry converts from with
        ``Plan.from_torch`` (None: it has none, or it names another axis)."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel)

        if self.style != "spec" and self.axis != axis:
            return None
        if self.style == "colwise" and self.splits is None:
            return ColwiseParallel(input_layouts=placement(self.inputs or "R"), output_layouts=placement(self.out or "S-1"))
        if self.style == "rowwise":
            return RowwiseParallel(input_layouts=placement(self.inputs or "S-1"), output_layouts=placement(self.out or "R"))
        if self.style == "vocab_parallel":
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=placement(self.out or "R"))
        if self.style == "sequence_parallel" and self.dim in (None, 1):
            return SequenceParallel()
        if self.style == "spec" and not self.params and self.out_src is None and self.splits is None:
            if self.inputs is None and self.in_src is None and isinstance(self.out_dst, dict) and set(self.out_dst) == {axis}:
                return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=placement(self.out_dst[axis]))
            if (self.out_dst is None and isinstance(self.inputs, dict) and isinstance(self.in_src, dict)
                    and list(self.inputs) == ["x"] and list(self.in_src) == ["x"]
                    and self.inputs["x"] == {axis: "R"} and set(self.in_src["x"]) == {axis}):
                src = placement(self.in_src["x"][axis])
                if self.style_hint == "kwargs":
                    return PrepareModuleInput(input_kwarg_layouts={"x": src}, desired_input_kwarg_layouts={"x": Replicate()})
                return PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(Replicate(),))
        return None

    def source(self) -> str:
        if self.style == "spec":
            kw = []
            if self.params:
                kw.append("params={" + ", ".join(f"{k!r}: {_src(v)}" for k, v in self.params.items()) + "}")
            for f in ("inputs", "in_src", "out_src", "out_dst"):
                if getattr(self, f) is not None:
                    kw.append(f"{f}={_src(getattr(self, f))}")
            if self.splits is not None:
                kw.append(f"splits={list(self.splits)}")
            if self.optional:
                kw.append(f"optional_params={tuple(self.optional)!r}")
            return "ModuleSpec(" + ", ".join(kw) + ")"
        kw = [repr(self.axis)]
        if self.inputs is not None:
            kw.append(f"inputs={_src(self.inputs)}")
        if self.out is not None:
            kw.append(f"out={_src(self.out)}")
        if self.splits is not None:
            kw.append(f"splits={list(self.splits)}")
        if self.dim is not None:
            kw.append(f"dim={self.dim}")
        return f"{self.style}(" + ", ".join(kw) + ")"


@dataclass
class FuzzCase:
    """A model, a mesh and a plan.  ``style`` names the right plan the entries started
    from and ``mutations`` the mistakes applied to it; ``expect_equal``: no mistake and
    every sharded size divides, so a PlanError would be a refusal of a right plan.
    ``run_shape``: ``(B, S)`` the sharded program is run at, when not the example
    inputs' (transformed at one batch and sequence length, run at another)."""

    model: ModelCfg
    mesh: tuple
    entries: tuple
    inputs: dict = field(default_factory=dict)
    style: str = ""
    mutations: tuple = ()
    expect_equal: bool = False
    run_shape: tuple | None = None
    frontend: str = "fxshard"  # "torch": the entries as torch.distributed.tensor.parallel styles, via Plan.from_torch
    capture: str = "auto"      # fxshard.transform(capture=...): "auto" (torch.fx here) or "export" (torch.export)

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)


def build_plan(case: FuzzCase, mesh) -> fxshard.Plan:
    """``fxshard.Plan(mesh, {pattern: spec}, inputs=...)`` for the case, or
    ``Plan.from_torch(mesh, {pattern: torch style}, inputs=...)`` (may raise PlanError)."""
    inputs = {k: layout_of(v) for k, v in case.inputs.items()}
    if case.frontend == "torch":
        (axis,) = case.mesh_shape
        return fxshard.Plan.from_torch(mesh, {e.pattern: e.torch_style(axis) for e in case.entries}, inputs=inputs)
    specs = {e.pattern: e.to_spec() for e in case.entries}
    return fxshard.Plan(mesh, specs, inputs=inputs)


def _torch_source(style) -> str:
    name = type(style).__name__
    if name in ("ColwiseParallel", "RowwiseParallel"):
        return f"{name}(input_layouts={style.input_layouts[0]!r}, output_layouts={style.output_layouts[0]!r})"
    if name == "SequenceParallel":
        return "SequenceParallel()"
    if name == "PrepareModuleOutput":
        return f"PrepareModuleOutput(output_layouts={style.output_layouts[0]!r}, desired_output_layouts={style.desired_output_layouts[0]!r})"
    if style.with_kwargs:
        return (f"PrepareModuleInput(input_kwarg_layouts={style.input_kwarg_layouts!r}, "
                f"desired_input_kwarg_layouts={style.desired_input_kwarg_layouts!r})")
    return f"PrepareModuleInput(input_layouts={tuple(style.input_layouts)!r}, desired_input_layouts={tuple(style.desired_input_layouts)!r})"


def plan_source(case: FuzzCase) -> str:
    """The case's plan as fxshard code (``mesh`` is a DeviceMesh of ``case.mesh_shape``)."""
    run = f"; run at (B, S) = {case.run_shape}" if case.run_shape else ""
    run += f"; capture={case.capture!r}" if case.capture != "auto" else ""
    lines = [f"# mesh {case.mesh_shape}; style {case.style!r}; mutations {list(case.mutations)}{run}",
             "plan = Plan.from_torch(mesh, {" if case.frontend == "torch" else "plan = Plan(mesh, {"]
    if case.frontend == "torch":
        (axis,) = case.mesh_shape
        lines += [f"    {e.pattern!r}: {_torch_source(e.torch_style(axis))}," for e in case.entries]
    else:
        lines += [f"    {e.pattern!r}: {e.source()}," for e in case.entries]
    ins = "{" + ", ".join(f"{k!r}: {_src(v)}" for k, v in case.inputs.items()) + "}"
    lines.append("}" + (f", inputs={ins})" if case.inputs else ")"))
    return "\n".join(lines)


# ============================================================================ strategies: models

_DIMS = (8, 12, 16, 24, 32)
_HEADS = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (3, 1), (3, 3), (6, 2), (8, 4), (8, 2), (2, 1), (4, 2))
_HEAD_DIMS = (2, 4, 6, 8)
_HIDDEN = (8, 12, 16, 24, 32, 48, 6, 10)


def _sized(draw, options, n: int, aligned_chance: int = 3):
    """One of ``options``; usually (3 in 4) one that ``n`` divides, so that right plans
    are mostly feasible, and sometimes any (a width the axis does not divide)."""
    fit = [o for o in options if o % n == 0]
    if fit and draw(st.integers(0, aligned_chance)):
        return draw(st.sampled_from(fit))
    return draw(st.sampled_from(options))


@st.composite
def attn_configs(draw, n: int = 1):
    fit = [hk for hk in _HEADS if hk[0] % n == 0 and hk[1] % n == 0]
    n_heads, n_kv = draw(st.sampled_from(fit if fit and draw(st.integers(0, 3)) else _HEADS))
    return AttnCfg(
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=draw(st.sampled_from(_HEAD_DIMS)),
        qkv=draw(st.sampled_from(("separate", "fused", "grouped"))),
        core=draw(st.sampled_from(("sdpa", "manual", "sdpa_mask", "sdpa", "manual", "einsum"))),
        gqa=draw(st.sampled_from(("repeat_interleave", "expand"))),
        scale=draw(st.sampled_from(("literal", "sqrt", "pow"))),
        mask=draw(st.sampled_from(("bool", "additive", "where"))),
        heads=draw(st.sampled_from(("transpose", "permute"))),
        softmax=draw(st.sampled_from(("plain", "float"))),
        split_view=draw(st.sampled_from(("literal", "infer"))),
        rope=draw(st.sampled_from(("none", "shared", "local"))),
        rope_view=draw(st.sampled_from(("view", "index"))),
        merge=draw(st.sampled_from(("reshape", "flatten", "view_infer"))),
        bias=draw(st.booleans()), out_bias=draw(st.booleans()),
        shape_use=draw(st.sampled_from(("none", "none", "none", "ones_like_tril", "new_zeros", "size"))))


@st.composite
def mlp_configs(draw, n: int = 1):
    kind = draw(st.sampled_from(("mlp", "swiglu", "fused", "grouped")))
    if kind == "grouped":
        groups = _sized(draw, (1, 2, 4), n)
        hidden = groups * draw(st.sampled_from((2, 3, 4, 6)))
    else:
        hidden = _sized(draw, _HIDDEN, n)
        groups = 1
    return MlpCfg(kind=kind, hidden=hidden, groups=groups, act=draw(st.sampled_from(("gelu", "relu", "silu"))),
                  bias=draw(st.booleans()), act_module=draw(st.booleans()), parts=draw(st.sampled_from(("split", "unbind"))))


@st.composite
def block_configs(draw, n: int = 1):
    parts = draw(st.sampled_from(("both", "both", "both", "attn", "mlp")))
    return BlockCfg(norm=draw(st.sampled_from(_NORMS)),
                    attn=draw(attn_configs(n)) if parts in ("both", "attn") else None,
                    mlp=draw(mlp_configs(n)) if parts in ("both", "mlp") else None,
                    call=draw(st.sampled_from(("positional", "positional", "keyword"))))


@st.composite
def model_configs(draw, n: int = 1, dp: int = 1):
    """A :class:`ModelCfg`; sizes mostly divisible by ``n`` (the tensor-parallel size)
    and the batch by ``dp``."""
    n_layers = draw(st.sampled_from((1, 2, 1, 2, 1, 2, 1, 0)))
    first = draw(block_configs(n))
    if n_layers == 2 and draw(st.booleans()):
        layers = (first, draw(block_configs(n)))
    else:
        layers = (first,) * n_layers
    # one head_dim for the shared rotary tables
    shared = [b.attn.head_dim for b in layers if b.attn is not None and b.attn.rope == "shared"]
    if shared:
        layers = tuple(dataclasses.replace(b, attn=dataclasses.replace(b.attn, head_dim=shared[0]))
                       if b.attn is not None and b.attn.rope == "shared" else b for b in layers)
    inp = draw(st.sampled_from(("tokens", "input_ids", "x", "hidden_states")))
    uses_ids = inp in ("tokens", "input_ids")
    vocab = _sized(draw, (8, 12, 16, 24, 32, 10), n)
    head = draw(st.sampled_from(("none", "linear", "linear", "tied", "functional") if uses_ids else ("none", "linear", "linear")))
    if head == "functional" and draw(st.integers(0, 3)):  # the known functional-use defect: keep it rare
        head = "tied"
    head_out = vocab if head in ("tied", "functional") else _sized(draw, (8, 12, 16, 24, 6, 10), n)
    tail = draw(st.sampled_from(("none", "none", "none", "flatten", "split_last", "transpose")))
    out_dim_even = (head_out if head != "none" else 2) % 2 == 0
    if tail == "split_last" and (head == "none" or not out_dim_even):
        tail = "none"
    loss = draw(st.sampled_from(("none", "none", "none", "ce", "ce_sum", "log_softmax"))) if head != "none" else "none"
    if loss != "none":
        tail = "none"
    return ModelCfg(
        dim=_sized(draw, _DIMS, n), batch=_sized(draw, (2, 3, 4), dp), seq=_sized(draw, tuple(range(2, 9)), n),
        max_seq=8, input=inp, vocab=vocab,
        embed_scale=draw(st.sampled_from(("none", "none", "literal", "traced"))) if uses_ids else "none",
        layers=layers, final_norm=draw(st.sampled_from((None,) + _NORMS)), head=head, head_out=head_out,
        head_bias=draw(st.booleans()) if head == "linear" else False,
        seq_from=draw(st.sampled_from(("input", "input", "hidden"))), tail=tail,
        pos_embed=draw(st.sampled_from((False, False, True))), loss=loss, seed=draw(st.integers(0, 3)),
        tables=draw(st.sampled_from(("buffer", "buffer", "attribute"))),
        leaf=draw(st.sampled_from(("none", "none", "identity", "dropout"))),
        example=draw(st.sampled_from(("distinct", "same", "same", "view"))) if uses_ids and loss != "none" else "distinct")


# ============================================================================ right plans


def _layer_prefixes(m: ModelCfg) -> list[tuple[str, BlockCfg]]:
    if m.same_layers:
        return [("layers.*", m.layers[0])] if m.layers else []
    return [(f"layers.{i}", b) for i, b in enumerate(m.layers)]


def _gather(arg: str, axis: str) -> Entry:
    """A module whose ``arg`` arrives sequence-sharded and is gathered on entry."""
    return Entry("", "spec", inputs={arg: {axis: "R"}}, in_src={arg: {axis: "S1"}})


def right_plan(m: ModelCfg, mesh: dict, style: str, sp_gather: str = "module", embed: str = "vocab",
               head_out: str = "R") -> tuple[list[Entry], dict]:
    """The Megatron-style plan of ``style`` for model ``m``:

    * ``"tp"``: column-parallel q/k/v/w1/w3 (fused projections part by part; grouped
      ones by group), row-parallel wo/w2, vocab-parallel or colwise embedding, a
      colwise head gathering its output (``head_out="R"``) or leaving it sharded (loss
      parallel, ``"S-1"``);
    * ``"sp"``: ``"tp"`` with sequence parallelism: sequence-sharded residual stream,
      ``sequence_parallel`` norms, row-parallel outputs reduce-scattered, inputs
      gathered per module (``sp_gather="module"``) or per projection (``"linear"``,
      ``colwise(inputs=Shard(1))``);
    * ``"dp"``: no tensor parallelism, the batch sharded;
    * ``"2d"``: MLPs sharded over both axes of a 2-D mesh (the hidden dim over
      dp x tp), the rest replicated.
    On a 2-D mesh the batch is sharded on ``dp`` and the tensor parallel axis is ``tp``.
    """
    two_d = "dp" in mesh
    tp = "tp"
    entries: list[Entry] = []
    inputs: dict = {}
    if two_d and m.loss == "none":  # (an in-graph loss of a sharded batch would be a Partial output)
        inputs[m.input] = {"dp": "S0"}
    sp = style == "sp"
    seq = "S1" if sp else "R"

    def add(pattern, style_, **kw):
        entries.append(Entry(pattern, style_, **kw))

    if style == "dp":
        if not two_d:
            inputs[m.input] = "S0"
        return entries, inputs
    if style == "2d":
        both = ("dp", "tp")
        for prefix, b in _layer_prefixes(m):
            if b.mlp is None:
                continue
            ff = f"{prefix}.feed_forward"
            col = dict(params={"weight": {a: "S0" for a in both}, **({"bias": {a: "S0" for a in both}} if b.mlp.bias else {})},
                       inputs={a: "R" for a in both}, out_src={a: "S-1" for a in both})
            names = {"mlp": ["w1"], "swiglu": ["w1", "w3"], "fused": [], "grouped": ["w13"]}[b.mlp.kind]
            if b.mlp.kind == "fused":
                entries.append(Entry(f"{ff}.w13", "spec", **col))
                entries[-1].splits = (b.mlp.hidden, b.mlp.hidden)
            for n in names:
                entries.append(Entry(f"{ff}.{n}", "spec", **col))
            entries.append(Entry(f"{ff}.w2", "spec", params={"weight": {a: "S-1" for a in both}},
                                 inputs={a: "S-1" for a in both}, out_src={a: "P" for a in both},
                                 out_dst={"dp": "S0" if inputs else "R", "tp": "R"}))
        return entries, inputs

    # "tp" / "sp"
    if m.uses_ids:
        if embed == "vocab":
            add("embed", "vocab_parallel", axis=tp, out=seq if sp else None)
        elif embed == "colwise":
            add("embed", "colwise", axis=tp, out="S1" if sp else "R")
        elif sp:  # a replicated embedding, sliced onto the sequence on exit
            add("embed", "spec", out_dst={tp: "S1"})
    elif sp:
        inputs[m.input] = {**inputs.get(m.input, {}), tp: "S1"}
    if sp and m.pos_embed:  # positions [S, D] sliced like the tokens [B, S, D] (GPT-2's wpe)
        add("pos_embed", "spec", out_dst={tp: "S0"})
    col_in = "S1" if sp and sp_gather == "linear" else None
    for prefix, b in _layer_prefixes(m):
        if b.attn is not None:
            a = b.attn
            at = f"{prefix}.attention"
            if a.qkv == "separate":
                for w in ("wq", "wk", "wv"):
                    add(f"{at}.{w}", "colwise", axis=tp, inputs=col_in)
            elif a.qkv == "fused":
                add(f"{at}.wqkv", "colwise", axis=tp, inputs=col_in,
                    splits=(a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim))
            else:
                add(f"{at}.wqkv", "colwise", axis=tp, inputs=col_in)
            add(f"{at}.wo", "rowwise", axis=tp, out="S1" if sp else None)
            if sp:
                add(f"{prefix}.attention_norm", "sequence_parallel", axis=tp)
                if sp_gather == "module":
                    g = _gather("x", tp)
                    g.pattern = at
                    g.style_hint = "kwargs" if b.call == "keyword" else None
                    entries.append(g)
        if b.mlp is not None:
            ff = f"{prefix}.feed_forward"
            cols = {"mlp": ["w1"], "swiglu": ["w1", "w3"], "fused": ["w13"], "grouped": ["w13"]}[b.mlp.kind]
            for n in cols:
                add(f"{ff}.{n}", "colwise", axis=tp, inputs=col_in,
                    splits=(b.mlp.hidden, b.mlp.hidden) if b.mlp.kind == "fused" else None)
            add(f"{ff}.w2", "rowwise", axis=tp, out="S1" if sp else None)
            if sp:
                add(f"{prefix}.ffn_norm", "sequence_parallel", axis=tp)
                if sp_gather == "module":
                    g = _gather("x", tp)
                    g.pattern = ff
                    g.style_hint = "kwargs" if b.call == "keyword" else None
                    entries.append(g)
    if sp and m.final_norm is not None:
        add("norm", "sequence_parallel", axis=tp)
    if m.head in ("linear", "tied"):
        if m.head == "linear" or embed == "vocab":  # a tied head is laid out like the embedding
            add("head", "colwise", axis=tp, inputs="S1" if sp else None, out=head_out)
        elif m.head == "tied" and sp:
            add("head", "spec", inputs={tp: "R"}, in_src={tp: "S1"}, out_dst={tp: head_out})
    return entries, inputs


def _divides(m: ModelCfg, mesh: dict, style: str, embed: str, head_out: str, inputs: dict) -> bool:
    """Do all sizes a right plan of ``style`` shards divide their axes?"""
    n = mesh["tp"]
    dp = mesh.get("dp", 1)
    ok = True
    if "dp" in mesh or style == "dp":
        ok &= m.batch % (dp if "dp" in mesh else n) == 0
    if style == "dp":
        return ok
    if style == "2d":
        for b in m.layers:
            if b.mlp is not None:
                if b.mlp.kind == "fused":
                    ok = False  # splits= need the fused weight sharded on one axis: rightly refused
                elif b.mlp.kind == "grouped":
                    ok &= b.mlp.groups % (n * dp) == 0  # the view [G, 2, F] keeps groups outermost
                else:
                    ok &= b.mlp.hidden % (n * dp) == 0
        return ok
    sp = style == "sp"
    if sp:
        ok &= m.seq % n == 0
        if m.pos_embed and (m.seq_from == "hidden" or not m.uses_ids):
            ok = False  # torch.arange(S) of a sharded sequence length is rightly refused
    for b in m.layers:
        if b.attn is not None:
            a = b.attn
            ok &= a.n_heads % n == 0 and a.n_kv_heads % n == 0
        if b.mlp is not None:
            ok &= (b.mlp.groups % n == 0) if b.mlp.kind == "grouped" else (b.mlp.hidden % n == 0)
    if m.uses_ids:
        if embed == "vocab":
            ok &= m.vocab % n == 0
        elif embed == "colwise":
            ok &= m.dim % n == 0
    if m.head in ("linear", "tied"):
        ok &= m.head_out % n == 0
    if m.head == "functional":
        return False  # the known functional-use defect
    # the output layout, through the tail view
    out_last_sharded = m.head in ("linear", "tied") and head_out == "S-1"
    seq_sharded_out = sp and m.head == "none"
    if m.tail == "flatten" and seq_sharded_out:
        ok = False  # merging batch with a sharded sequence is rightly refused
    if m.tail == "split_last" and out_last_sharded:
        ok &= 2 % n == 0
    if m.loss == "log_softmax" and out_last_sharded:
        ok = False  # gather from vocab-sharded log-probs needs communication: rightly refused
    return ok


# ============================================================================ mutations (deliberate mistakes)

_PLACEMENTS = ("R", "S0", "S1", "S-1", "S2")


def _mut_drop(draw, case):
    if not case.entries:
        return None
    i = draw(st.integers(0, len(case.entries) - 1))
    e = case.entries.pop(i)
    return f"drop {e.pattern}"


def _mut_swap(draw, case):
    idx = [i for i, e in enumerate(case.entries) if e.style in ("colwise", "rowwise", "vocab_parallel")]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    new = {"colwise": "rowwise", "rowwise": "colwise", "vocab_parallel": "colwise"}[e.style]
    case.entries[i] = Entry(e.pattern, new, axis=e.axis, out=e.out)
    return f"swap {e.pattern} {e.style}->{new}"


def _mut_out(draw, case):
    idx = [i for i, e in enumerate(case.entries) if e.style in ("colwise", "rowwise", "vocab_parallel")]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    e.out = draw(st.sampled_from(_PLACEMENTS))
    return f"out {e.pattern}={e.out}"


def _mut_inputs(draw, case):
    idx = [i for i, e in enumerate(case.entries) if e.style in ("colwise", "rowwise")]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    e.inputs = draw(st.sampled_from(_PLACEMENTS))
    return f"inputs {e.pattern}={e.inputs}"


def _mut_axis(draw, case):
    idx = [i for i, e in enumerate(case.entries) if e.style != "spec"]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    e.axis = draw(st.sampled_from([a for a in ("dp", "tp", "mp") if a != e.axis]))
    return f"axis {e.pattern}={e.axis}"


def _mut_mix_axes(draw, case):
    """Every ``tp`` entry written with ``dp`` (axis names mixed up)."""
    if "dp" not in case.mesh_shape or not case.entries:
        return None
    for e in case.entries:
        if e.style != "spec":
            e.axis = "dp" if e.axis == "tp" else e.axis
    return "mix axes tp->dp"


_TYPOS = (("attention", "attn"), ("feed_forward", "mlp"), ("layers.*", "layer.*"), ("layers.*.", ""), ("embed", "tok_embeddings"),
          ("head", "output"), ("layers.*", "layers.9"), ("wq", "q_proj"), ("w2", "w[23]"), ("layers.*", "*"))


def _mut_pattern(draw, case):
    if not case.entries:
        return None
    i = draw(st.integers(0, len(case.entries) - 1))
    e = case.entries[i]
    old, new = draw(st.sampled_from(_TYPOS))
    if old not in e.pattern:
        return None
    e.pattern = e.pattern.replace(old, new, 1)
    return f"pattern {e.pattern}"


def _mut_splits(draw, case):
    idx = [i for i, e in enumerate(case.entries) if e.style == "colwise"]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    if e.splits is not None and draw(st.booleans()):
        e.splits = None if draw(st.booleans()) else tuple(reversed(e.splits))
    else:
        e.splits = tuple(draw(st.lists(st.sampled_from((2, 4, 8, 12, 16)), min_size=2, max_size=3)))
    return f"splits {e.pattern}={e.splits}"


def _mut_seq_dim(draw, case):
    idx = [i for i, e in enumerate(case.entries) if e.style == "sequence_parallel"]
    if not idx:
        return None
    e = case.entries[draw(st.sampled_from(idx))]
    e.dim = draw(st.sampled_from((0, 2, -1)))
    return f"sequence_parallel {e.pattern} dim={e.dim}"


def _rand_layout(draw, axes, allow_partial=False):
    choices = _PLACEMENTS + (("P",) if allow_partial else ())
    if draw(st.booleans()) and len(axes) == 1:
        return draw(st.sampled_from(choices))  # a bare placement
    return {a: draw(st.sampled_from(choices)) for a in axes if draw(st.booleans())} or {axes[-1]: draw(st.sampled_from(choices))}


def _mut_spec(draw, case):
    """A preset replaced by a hand-written ModuleSpec with random layouts (never a
    Partial on exit: ``out_dst`` is Replicate/Shard or absent, and present on the
    modules whose output may be the model's)."""
    if not case.entries:
        return None
    i = draw(st.integers(0, len(case.entries) - 1))
    e = case.entries[i]
    axes = list(case.mesh_shape)
    params = {}
    if draw(st.booleans()):
        params["weight"] = {a: draw(st.sampled_from(("S0", "S1", "S-1", "S2", "R"))) for a in axes if draw(st.booleans())} or {"tp": "S0"}
    if draw(st.booleans()):
        params["bias"] = {"tp": draw(st.sampled_from(("S0", "R")))}
    final = e.pattern in ("head", "embed") or not case.model.layers
    spec = Entry(e.pattern, "spec", params=params,
                 inputs=_rand_layout(draw, axes) if draw(st.booleans()) else None,
                 out_src=_rand_layout(draw, axes, allow_partial=True) if draw(st.booleans()) else None,
                 out_dst=_rand_layout(draw, axes) if final or draw(st.booleans()) else None)
    case.entries[i] = spec
    return f"spec {e.pattern}"


def _mut_plan_inputs(draw, case):
    m = case.model
    if m.loss != "none":
        return None  # a sharded batch makes an in-graph loss Partial: no comparable output
    kind = draw(st.sampled_from(("bare", "wrong_name", "seq", "feature", "drop")))
    if kind == "bare":
        case.inputs[m.input] = "S0"
    elif kind == "wrong_name":
        other = {"tokens": "input_ids", "input_ids": "tokens", "x": "hidden_states", "hidden_states": "x"}[m.input]
        if m.input in case.inputs:
            case.inputs[other] = case.inputs.pop(m.input)
        else:
            case.inputs[other] = {"tp": "S0"}
    elif kind == "seq":
        case.inputs[m.input] = {**(case.inputs.get(m.input) or {}), "tp": "S1"} if isinstance(case.inputs.get(m.input, {}), dict) else {"tp": "S1"}
    elif kind == "feature":
        case.inputs[m.input] = {"tp": "S-1"}
    else:
        if m.input not in case.inputs:
            return None
        case.inputs.pop(m.input)
    return f"plan inputs {kind}"


def _mut_arg_keyed(draw, case):
    """``inputs`` keyed by the forward argument name: ``{"x": {"tp": R}}`` on a block
    module, or the bare-placement form ``{"input": Replicate()}`` on a linear."""
    idx = [i for i, e in enumerate(case.entries) if e.style in ("colwise", "rowwise") and e.pattern != "embed"]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    spec = e.to_spec()
    axis = e.axis
    req = spec.inputs[axis] if isinstance(spec.inputs, dict) and axis in spec.inputs else Replicate()
    exp = spec.in_src.get(axis) if isinstance(spec.in_src, dict) else None
    short = lambda p: "R" if isinstance(p, Replicate) else f"S{p.dim}"
    bare = draw(st.booleans())
    params = {k: {a: short(p) for a, p in v.items()} for k, v in spec.params.items()}
    case.entries[i] = Entry(e.pattern, "spec", params=params, optional=tuple(spec.optional_params) or None,
                            inputs={"input": short(req) if bare else {axis: short(req)}},
                            in_src={"input": {axis: short(exp)}} if exp is not None else None,
                            out_src={axis: "P" if e.style == "rowwise" else "S-1"},
                            out_dst={axis: short(spec.out_dst[axis])} if spec.out_dst else None)
    return f"arg-keyed inputs {e.pattern}{' (bare)' if bare else ''}"


def _mut_extra(draw, case):
    m = case.model
    options = [("norm", Entry("norm", "colwise")), ("layers.*.attention", Entry("layers.*.attention", "rowwise")),
               ("layers.*.ffn_norm", Entry("layers.*.ffn_norm", "spec", params={"weight": {"tp": "S0"}})),
               ("layers.*.attention_norm", Entry("layers.*.attention_norm", "sequence_parallel")),
               ("embed", Entry("embed", "colwise")), ("head", Entry("head", "rowwise", out="S-1")),
               ("layers.*.feed_forward", Entry("layers.*.feed_forward", "spec", inputs={"x": {"tp": "S1"}}))]
    name, e = draw(st.sampled_from(options))
    e = dataclasses.replace(e)
    if "dp" in case.mesh_shape and draw(st.booleans()):
        e.axis = "dp"
    case.entries.append(e)
    return f"extra {name}"


# ---- rewrites that keep a plan's meaning (a right plan stays right)


def _rw_desugar(draw, case):
    """A preset on a linear written out as the ModuleSpec it stands for."""
    idx = [i for i, e in enumerate(case.entries) if e.style in ("colwise", "rowwise", "sequence_parallel")
           and e.pattern not in ("embed", "pos_embed")]
    if not idx:
        return None
    i = draw(st.sampled_from(idx))
    e = case.entries[i]
    spec = e.to_spec()

    def short(v):
        if isinstance(v, dict):
            return {a: short(p) for a, p in v.items()}
        return "R" if isinstance(v, Replicate) else "P" if isinstance(v, Partial) else f"S{v.dim}"

    case.entries[i] = Entry(e.pattern, "spec", params={k: short(v) for k, v in spec.params.items()} or None,
                            inputs=short(spec.inputs) if spec.inputs is not None else None,
                            in_src=short(spec.in_src) if spec.in_src is not None else None,
                            out_src=short(spec.out_src) if spec.out_src is not None else None,
                            out_dst=short(spec.out_dst) if spec.out_dst is not None else None,
                            splits=spec.splits, optional=tuple(spec.optional_params) or None)
    return f"desugar {e.pattern}"


def _rw_char_class(draw, case):
    """Entries with one spec on sibling modules merged into one pattern: ``w[qkv]``."""
    groups: dict = {}
    for i, e in enumerate(case.entries):
        head, _, last = e.pattern.rpartition(".")
        if head and len(last) == 2 and last[0] == "w":
            groups.setdefault((head, repr(e)), []).append(i)
    merge = [ix for ix in groups.values() if len(ix) > 1]
    if not merge:
        return None
    ix = draw(st.sampled_from(merge))
    first = case.entries[ix[0]]
    head = first.pattern.rpartition(".")[0]
    chars = "".join(case.entries[i].pattern[-1] for i in ix)
    merged = dataclasses.replace(first, pattern=f"{head}.w[{chars}]")
    case.entries = [e for i, e in enumerate(case.entries) if i not in ix] + [merged]
    return f"merge {merged.pattern}"


def _rw_redundant(draw, case):
    """A wildcard entry repeated for one layer (same spec: allowed)."""
    idx = [i for i, e in enumerate(case.entries) if e.pattern.startswith("layers.*.")]
    if not idx:
        return None
    e = case.entries[draw(st.sampled_from(idx))]
    case.entries.append(dataclasses.replace(e, pattern=e.pattern.replace("layers.*.", "layers.0.", 1)))
    return f"redundant layers.0 copy of {e.pattern}"


_BOUNDARY_FIELDS = ("inputs", "out", "in_src", "out_src", "out_dst")


def _map_layouts(v, fn):
    if isinstance(v, str):
        return fn(v)
    if isinstance(v, dict):
        return {k: _map_layouts(x, fn) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return tuple(_map_layouts(x, fn) for x in v)
    return v


def _rw_negative_dims(draw, case):
    """Boundary layouts of [B, S, D] values with negative dims: Shard(1) -> Shard(-2),
    Shard(-1) -> Shard(2), sequence_parallel(dim=-2).  (Every module boundary here is 3-D,
    except the positions [S, D], left alone.)"""
    idx = [i for i, e in enumerate(case.entries) if e.pattern != "pos_embed"
           and (e.style == "sequence_parallel" or any(getattr(e, f) is not None for f in _BOUNDARY_FIELDS))]
    if not idx:
        return None
    e = case.entries[draw(st.sampled_from(idx))]
    flip = {"S1": "S-2", "S-2": "S1", "S-1": "S2", "S2": "S-1"}
    for f in _BOUNDARY_FIELDS:
        setattr(e, f, _map_layouts(getattr(e, f), lambda p: flip.get(p, p)))
    if e.style == "sequence_parallel" and e.dim in (None, 1):
        e.dim = -2
    return f"negative dims {e.pattern}"


def _rw_bare(draw, case):
    """On a 1-D mesh, layouts of hand-written specs as bare placements (also under
    forward-argument names: ``{"x": Replicate()}``)."""
    if len(case.mesh_shape) != 1:
        return None
    (axis,) = case.mesh_shape
    idx = [i for i, e in enumerate(case.entries) if e.style == "spec"]
    if not idx:
        return None
    e = case.entries[draw(st.sampled_from(idx))]

    def bare(v):
        if isinstance(v, dict) and set(v) == {axis} and isinstance(v[axis], str):
            return v[axis]
        if isinstance(v, dict):
            return {k: bare(x) for k, x in v.items()}
        return v

    for f in _BOUNDARY_FIELDS + ("params",):
        setattr(e, f, bare(getattr(e, f)))
    return f"bare placements {e.pattern}"


def _rw_positional(draw, case):
    """``inputs``/``in_src`` by forward-argument name written as a tuple by position
    (the blocks' forwards take ``x`` first)."""
    idx = [i for i, e in enumerate(case.entries) if e.style == "spec" and isinstance(e.inputs, dict)
           and list(e.inputs) == ["x"] and (e.in_src is None or (isinstance(e.in_src, dict) and list(e.in_src) == ["x"]))]
    if not idx:
        return None
    e = case.entries[draw(st.sampled_from(idx))]
    e.inputs = (e.inputs["x"],)
    if e.in_src is not None:
        e.in_src = (e.in_src["x"],)
    return f"inputs by position {e.pattern}"


REWRITES = {"desugar": _rw_desugar, "char_class": _rw_char_class, "redundant": _rw_redundant,
            "negative_dims": _rw_negative_dims, "bare": _rw_bare, "positional": _rw_positional}


MUTATIONS = {
    "drop": _mut_drop, "swap": _mut_swap, "out": _mut_out, "inputs": _mut_inputs, "axis": _mut_axis,
    "mix_axes": _mut_mix_axes, "pattern": _mut_pattern, "splits": _mut_splits, "seq_dim": _mut_seq_dim,
    "spec": _mut_spec, "plan_inputs": _mut_plan_inputs, "arg_keyed": _mut_arg_keyed, "extra": _mut_extra,
}


# ============================================================================ the case strategy


@st.composite
def fuzz_cases(draw, models=None):
    """A :class:`FuzzCase`: a random model, mesh and right plan, with 0..3 mistakes."""
    mesh = dict(draw(st.sampled_from(MESHES)))
    m = draw(models if models is not None else model_configs(mesh["tp"], mesh.get("dp", 1)))
    styles = ["tp", "tp", "tp", "sp", "sp"] + (["dp"] if m.loss == "none" else []) + (["2d", "2d"] if "dp" in mesh else [])
    style = draw(st.sampled_from(styles))
    embed = draw(st.sampled_from(("vocab", "vocab", "colwise", "none")))
    if m.head == "tied" and embed == "colwise":
        embed = "vocab"
    head_out = draw(st.sampled_from(("R", "R", "S-1")))
    sp_gather = draw(st.sampled_from(("module", "linear")))
    entries, inputs = right_plan(m, mesh, style, sp_gather=sp_gather, embed=embed, head_out=head_out)
    label = style + (f"/{sp_gather}" if style == "sp" else "") + (f" embed={embed}" if m.uses_ids and style in ("tp", "sp") else "") + \
        (f" head={head_out}" if m.head in ("linear", "tied") and style in ("tp", "sp") else "")
    case = FuzzCase(model=m, mesh=tuple(mesh.items()), entries=entries, inputs=inputs, style=label)
    expect = _divides(m, mesh, style, embed, head_out, inputs)
    rewrites = []
    for _ in range(draw(st.sampled_from((0, 0, 1, 2, 3)))):
        what = REWRITES[draw(st.sampled_from(sorted(REWRITES)))](draw, case)
        if what is not None:
            rewrites.append(what)
    n_mut = draw(st.sampled_from((0, 0, 1, 1, 2, 3)))
    applied = []
    for _ in range(n_mut):
        name = draw(st.sampled_from(sorted(MUTATIONS)))
        what = MUTATIONS[name](draw, case)
        if what is not None:
            applied.append(what)
    case.entries = tuple(case.entries)
    case.mutations = tuple(applied)
    case.expect_equal = expect and not applied
    if rewrites:
        case.style += " (" + "; ".join(rewrites) + ")"
    if len(mesh) == 1 and all(e.torch_style("tp") is not None for e in case.entries) and draw(st.integers(0, 2)) == 0:
        case.frontend = "torch"
    if draw(st.integers(0, 15)) == 7:  # (torch.export is slow: ~0.7 s a case)
        case.capture = "export"
    elif m.example != "distinct" and draw(st.integers(0, 2)) == 0:  # aliased example inputs: the capture that dedups them
        case.capture = "export"
    # torch.export (Dim.AUTO) may specialize a dim to the example's size (S == 8 when the model slices an
    # [8, 8] mask by S): that program runs at that size only, as plain torch.export's does; not run elsewhere
    if draw(st.integers(0, 3)) == 0 and case.capture != "export":  # run at another batch / sequence length
        B, S = m.batch, m.seq
        step = 4 if S % 4 == 0 else 2 if S % 2 == 0 else 1
        seqs = [s for s in range(2, m.max_seq + 1) if s % step == 0 and s != S] or [S]
        case.run_shape = (2 * B, draw(st.sampled_from(seqs)))
    return case
