"""Small but real transformer families: the demo, the tests and the benchmarks use them.

Every model here:

* is a plain ``nn.Module`` (dropout 0, fp32, no biases unless stated);
* traces with plain ``torch.fx.symbolic_trace(model)`` -- sizes read at run time come
  from fixed-count shape unpacking (``bsz, seqlen, _ = x.shape``), head counts and
  head sizes are literal Python ints stored on ``self``, so the traced graph holds e.g.
  ``view(bsz, seqlen, 4, 16)``;
* runs at any batch size and any sequence length ``<= max_seq_len`` (positional tables
  are sliced by the run-time ``seqlen``);
* is initialised deterministically from a ``seed`` (the global RNG is left untouched),
  with non-trivial norm weights (``1 + 0.1 * randn``) and non-zero biases so that
  gradient / bias bugs in a sharding pass show up numerically.

Families: :class:`Llama` (:class:`LlamaArgs`), :class:`GPT2` (:class:`GPT2Args`),
:class:`MLP`, and the :class:`WithLoss` wrapper.  Factories: :func:`llama`,
:func:`gpt2`, :func:`mlp`; inputs: :func:`tokens`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaArgs",
    "Llama",
    "RMSNorm",
    "GPT2Args",
    "GPT2",
    "MLP",
    "WithLoss",
    "llama",
    "gpt2",
    "mlp",
    "tokens",
    "init_params",
    "fuse_llama_state_dict",
    "complex_to_real_rope_state_dict",
]


# --------------------------------------------------------------------------- init


def init_params(model: nn.Module, seed: int = 0) -> nn.Module:
    """Overwrite every parameter of ``model`` deterministically from ``seed``.

    Parameters are visited in ``named_parameters()`` order (tied parameters once):

    * norm weights (``LayerNorm``/``RMSNorm``/:class:`RMSNorm`): ``1 + 0.1 * randn``;
    * biases (incl. norm biases): ``0.1 * randn``;
    * ``nn.Embedding`` weights: ``0.5 * randn``;
    * other weights (Linear): ``randn / sqrt(fan_in)`` so activations stay O(1) and
      attention is far from uniform.
    """
    g = torch.Generator().manual_seed(seed)
    norm_types = (nn.LayerNorm, nn.RMSNorm, RMSNorm)
    owner: dict[int, nn.Module] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod = owner[id(p)]
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(mod, norm_types):
                val = 1.0 + 0.1 * noise if leaf == "weight" else 0.1 * noise
            elif leaf == "bias":
                val = 0.1 * noise
            elif isinstance(mod, nn.Embedding):
                val = 0.5 * noise
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else p.shape[0]
                val = noise / math.sqrt(fan_in)
            p.copy_(val.to(p.dtype))
    return model


def _build(ctor, seed: int):
    """Construct under a forked RNG (default inits don't disturb the caller) and init."""
    with torch.random.fork_rng(devices=[]):
        model = ctor()
    return init_params(model, seed).eval()


def tokens(batch: int, seqlen: int, vocab: int, seed: int = 0) -> torch.LongTensor:
    """Deterministic random token ids of shape ``[batch, seqlen]`` in ``[0, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seqlen), generator=g, dtype=torch.long)


# --------------------------------------------------------------------------- Llama


@dataclass
class LlamaArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 128
    ffn_hidden: int = 128
    norm_eps: float = 1e-5
    max_seq_len: int = 32
    rope: Literal["complex", "real"] = "complex"
    fused_qkv: bool = False
    fused_w13: bool = False
    norm: Literal["module", "written"] = "module"
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.rope not in ("complex", "real"):
            raise ValueError(f"rope must be 'complex' or 'real', got {self.rope!r}")
        if self.norm not in ("module", "written"):
            raise ValueError(f"norm must be 'module' or 'written', got {self.norm!r}")
        if self.dim % self.n_heads:
            raise ValueError("dim must be divisible by n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be divisible by n_kv_heads")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Hand-written RMSNorm (traced as plain ops, unlike the ``nn.RMSNorm`` leaf)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _make_norm(args: LlamaArgs) -> nn.Module:
    if args.norm == "module":
        return nn.RMSNorm(args.dim, eps=args.norm_eps)
    return RMSNorm(args.dim, eps=args.norm_eps)


def _rope_freqs(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Angles ``[max_seq_len, head_dim // 2]`` (float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float32)
    return torch.outer(t, inv)


def _rotate_half(x, half: int):
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.half_dim = args.head_dim // 2
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.rope = args.rope
        self.fused_qkv = args.fused_qkv
        if args.fused_qkv:
            self.wqkv = nn.Linear(args.dim, self.q_size + 2 * self.kv_size, bias=False)
        else:
            self.wq = nn.Linear(args.dim, self.q_size, bias=False)
            self.wk = nn.Linear(args.dim, self.kv_size, bias=False)
            self.wv = nn.Linear(args.dim, self.kv_size, bias=False)
        self.wo = nn.Linear(self.q_size, args.dim, bias=False)

    def _rope_complex(self, x, freqs_cis, bsz, seqlen, n):
        x_ = torch.view_as_complex(x.float().reshape(bsz, seqlen, n, -1, 2))
        f = freqs_cis.view(1, seqlen, 1, self.half_dim)
        out = torch.view_as_real(x_ * f).flatten(3)
        return out.type_as(x)

    def _rope_real(self, x, cos, sin, seqlen):
        c = cos.view(1, seqlen, 1, self.head_dim)
        s = sin.view(1, seqlen, 1, self.head_dim)
        return x * c + _rotate_half(x, self.half_dim) * s

    def forward(self, x, rope_a, rope_b):
        # rope_a/rope_b: (freqs_cis[:seqlen], None) for complex, (cos, sin) for real.
        bsz, seqlen, _ = x.shape
        if self.fused_qkv:
            qkv = self.wqkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)

        if self.rope == "complex":
            q = self._rope_complex(q, rope_a, bsz, seqlen, self.n_heads)
            k = self._rope_complex(k, rope_a, bsz, seqlen, self.n_kv_heads)
        else:
            q = self._rope_real(q, rope_a, rope_b, seqlen)
            k = self._rope_real(k, rope_a, rope_b, seqlen)

        if self.n_rep > 1:
            k = torch.repeat_interleave(k, self.n_rep, dim=2)
            v = torch.repeat_interleave(v, self.n_rep, dim=2)

        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.q_size)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.fused_w13 = args.fused_w13
        if args.fused_w13:
            self.w13 = nn.Linear(args.dim, 2 * args.ffn_hidden, bias=False)
        else:
            self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
            self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x):
        if self.fused_w13:
            a, b = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(a) * b)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = _make_norm(args)
        self.attention = Attention(args)
        self.ffn_norm = _make_norm(args)
        self.feed_forward = FeedForward(args)

    def forward(self, x, rope_a, rope_b):
        h = x + self.attention(self.attention_norm(x), rope_a, rope_b)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Meta-style Llama: ``tok_embeddings``, ``layers.{i}.*``, ``norm``, ``output``."""

    def __init__(self, args: LlamaArgs | None = None, seed: int | None = None):
        super().__init__()
        args = args if args is not None else LlamaArgs()
        self.args = args
        self.vocab_size = args.vocab_size
        self.rope = args.rope
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = _make_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        ang = _rope_freqs(args.head_dim, args.max_seq_len, args.rope_theta)
        if args.rope == "complex":
            self.register_buffer(
                "freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False
            )  # complex64 [max_seq_len, head_dim // 2]
        else:
            emb = torch.cat((ang, ang), dim=-1)  # [max_seq_len, head_dim]
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)
        if seed is not None:
            init_params(self, seed)

    def forward(self, tokens):
        bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        # == self.freqs_cis[:seqlen].  plain symbolic_trace does not proxy buffers
        # (Tracer.proxy_buffer_attributes is False), so `buf[:seqlen]` would slice a
        # real tensor with a Proxy and fail; `buf.narrow(0, 0, seqlen)` is dispatched
        # through Proxy.__torch_function__ and traces as get_attr + call_method narrow.
        if self.rope == "complex":
            rope_a = self.freqs_cis.narrow(0, 0, seqlen)
            rope_b = None
        else:
            rope_a = self.cos.narrow(0, 0, seqlen)
            rope_b = self.sin.narrow(0, 0, seqlen)
        for layer in self.layers:
            h = layer(h, rope_a, rope_b)
        h = self.norm(h)
        return self.output(h)


def llama(seed: int = 0, args: LlamaArgs | None = None, **overrides) -> Llama:
    """``Llama(replace(args or LlamaArgs(), **overrides))`` initialised from ``seed``."""
    a = replace(args if args is not None else LlamaArgs(), **overrides)
    return _build(lambda: Llama(a), seed)


def fuse_llama_state_dict(sd: dict, args: LlamaArgs) -> dict:
    """Map an unfused Llama state dict onto the fused layout given by ``args``.

    ``wq/wk/wv -> wqkv`` (rows ``[q | k | v]``) when ``args.fused_qkv``;
    ``w1/w3 -> w13`` (rows ``[w1 | w3]``) when ``args.fused_w13``.
    """
    out = dict(sd)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        if args.fused_qkv and p + "attention.wq.weight" in out:
            out[p + "attention.wqkv.weight"] = torch.cat(
                [out.pop(p + f"attention.{n}.weight") for n in ("wq", "wk", "wv")], dim=0
            )
        if args.fused_w13 and p + "feed_forward.w1.weight" in out:
            out[p + "feed_forward.w13.weight"] = torch.cat(
                [out.pop(p + f"feed_forward.{n}.weight") for n in ("w1", "w3")], dim=0
            )
    return out


def complex_to_real_rope_state_dict(sd: dict, args: LlamaArgs) -> dict:
    """Permute ``wq``/``wk`` rows so a rope="real" (rotate-half) model equals a
    rope="complex" (interleaved pairs) one.  Unfused q/k only."""
    hd = args.head_dim
    perm_head = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    out = dict(sd)
    for i in range(args.n_layers):
        for name, nh in (("wq", args.n_heads), ("wk", args.n_kv_heads)):
            key = f"layers.{i}.attention.{name}.weight"
            perm = (perm_head[None, :] + hd * torch.arange(nh)[:, None]).reshape(-1)
            out[key] = out[key][perm]
    return out


# --------------------------------------------------------------------------- GPT-2


@dataclass
class GPT2Args:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 128
    n_positions: int = 32
    tied: bool = False
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError("dim must be divisible by n_heads")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def max_seq_len(self) -> int:
        return self.n_positions


class GPT2Attention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.dim = args.dim
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.c_attn = nn.Linear(args.dim, 3 * args.dim, bias=True)
        self.c_proj = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q, k, v = self.c_attn(x).split(self.dim, dim=-1)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.dim)
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = nn.Linear(args.dim, 4 * args.dim, bias=True)
        self.c_proj = nn.Linear(4 * args.dim, args.dim, bias=True)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.layer_norm_eps)
        self.attn = GPT2Attention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.layer_norm_eps)
        self.mlp = GPT2MLP(args)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2: ``wte``, ``wpe``, ``h.{i}.*``, ``ln_f``, ``lm_head`` (tied to wte if asked)."""

    def __init__(self, args: GPT2Args | None = None, seed: int | None = None):
        super().__init__()
        args = args if args is not None else GPT2Args()
        self.args = args
        self.vocab_size = args.vocab_size
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.n_positions, args.dim)
        self.h = nn.ModuleList(GPT2Block(args) for _ in range(args.n_layers))
        self.ln_f = nn.LayerNorm(args.dim, eps=args.layer_norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tied:
            self.lm_head.weight = self.wte.weight
        if seed is not None:
            init_params(self, seed)

    def forward(self, ids):
        bsz, seqlen = ids.shape
        pos = torch.arange(seqlen, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2(seed: int = 0, args: GPT2Args | None = None, **overrides) -> GPT2:
    """``GPT2(replace(args or GPT2Args(), **overrides))`` initialised from ``seed``."""
    a = replace(args if args is not None else GPT2Args(), **overrides)
    return _build(lambda: GPT2(a), seed)


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """``fc2(act(fc1(x)))`` for ``x`` of shape ``[..., dim]``; act is GELU or ReLU."""

    def __init__(self, dim: int = 32, hidden: int = 64, bias: bool = True,
                 act: Literal["gelu", "relu"] = "gelu"):
        super().__init__()
        if act not in ("gelu", "relu"):
            raise ValueError(f"act must be 'gelu' or 'relu', got {act!r}")
        self.dim = dim
        self.hidden = hidden
        self.act = act
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h) if self.act == "gelu" else F.relu(h)
        return self.fc2(h)


def mlp(seed: int = 0, **kw) -> MLP:
    """``MLP(**kw)`` initialised from ``seed``."""
    return _build(lambda: MLP(**kw), seed)


# --------------------------------------------------------------------------- loss


class WithLoss(nn.Module):
    """``model`` followed by token-level cross entropy.

    ``forward(tokens, targets) -> F.cross_entropy(logits.view(-1, V), targets.view(-1))``
    with ``V`` a literal int taken from ``model.args.vocab_size`` (or ``model.vocab_size``).
    Submodule names gain a ``model.`` prefix.
    """

    def __init__(self, model: nn.Module, reduction: str = "mean"):
        super().__init__()
        self.model = model
        args = getattr(model, "args", None)
        vocab = getattr(args, "vocab_size", None) or getattr(model, "vocab_size")
        self.vocab_size = int(vocab)
        self.reduction = reduction

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return F.cross_entropy(
            logits.view(-1, self.vocab_size), targets.view(-1), reduction=self.reduction
        )


# --------------------------------------------------------------------------- plans
# Plans are plain data: {fqn pattern: ModuleSpec}.  Wrap them in fxshard.Plan(mesh, ...).


def _gather_input(axis: str, arg: str = "x"):
    """A module whose ``arg`` arrives sequence-sharded and is all-gathered once on entry
    (torch's ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())``)."""
    from torch.distributed.tensor import Replicate, Shard

    from fxshard.plan.specs import ModuleSpec

    return ModuleSpec(inputs={arg: {axis: Replicate()}}, in_src={arg: {axis: Shard(1)}}, style="prepare_input")


def llama_plan(axis: str = "tp", *, fused: bool = False, sequence_parallel: bool = False,
               loss_parallel: bool = False, args: LlamaArgs | None = None) -> dict:
    """Megatron tensor parallelism for :class:`Llama`: q/k/v and w1/w3 column-parallel,
    o and w2 row-parallel (2 all-reduces forward and 2 backward per layer).

    ``sequence_parallel``: norms run on sequence shards; each attention/MLP block
    all-gathers its input once and its row-parallel output reduce-scatters (2
    all-gathers + 2 reduce-scatters per layer); the embedding is vocab-parallel with a
    reduce-scatter.  ``loss_parallel``: the LM head keeps its output vocab-sharded for
    a loss-parallel cross-entropy.  ``fused`` (with ``args``) shards ``wqkv``/``w13``
    part by part.
    """
    from torch.distributed.tensor import Replicate, Shard

    from fxshard.plan.specs import colwise, rowwise, sequence_parallel as seq_norm, vocab_parallel

    seq = Shard(1) if sequence_parallel else Replicate()
    if fused:
        a = args or LlamaArgs()
        hd = a.dim // a.n_heads
        attn = {"layers.*.attention.wqkv": colwise(axis, splits=[a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd])}
        ffn = {"layers.*.feed_forward.w13": colwise(axis, splits=[a.ffn_hidden, a.ffn_hidden])}
    else:
        attn = {f"layers.*.attention.{w}": colwise(axis) for w in ("wq", "wk", "wv")}
        ffn = {f"layers.*.feed_forward.{w}": colwise(axis) for w in ("w1", "w3")}
    plan = {**attn, "layers.*.attention.wo": rowwise(axis, out=seq),
            **ffn, "layers.*.feed_forward.w2": rowwise(axis, out=seq)}
    if sequence_parallel:
        plan.update({
            "tok_embeddings": vocab_parallel(axis, out=Shard(1)),
            "layers.*.attention_norm": seq_norm(axis), "layers.*.ffn_norm": seq_norm(axis), "norm": seq_norm(axis),
            "layers.*.attention": _gather_input(axis), "layers.*.feed_forward": _gather_input(axis),
        })
    if sequence_parallel or loss_parallel:
        plan["output"] = colwise(axis, inputs=seq, out=Shard(-1) if loss_parallel else Replicate())
    return plan


def gpt2_plan(axis: str = "tp", *, sequence_parallel: bool = False, loss_parallel: bool = False,
              args: GPT2Args | None = None) -> dict:
    """Megatron tensor parallelism for :class:`GPT2` (biases on every linear).

    The fused ``c_attn`` is sharded part by part (q | k | v); the row-parallel biases
    are added once after the reduction; the token embedding is vocab-parallel (so a
    tied LM head is sharded the same way).  ``sequence_parallel``: the token embedding
    reduce-scatters onto the sequence and the positions are sliced to match, so the
    residual stream is sequence-sharded from the start; norms run on shards,
    attention/MLP gather once on entry and reduce-scatter on exit.  ``loss_parallel``: vocab-sharded logits for a
    loss-parallel cross-entropy.
    """
    from torch.distributed.tensor import Replicate, Shard

    from fxshard.plan.specs import ModuleSpec, colwise, rowwise, sequence_parallel as seq_norm, vocab_parallel

    a = args or GPT2Args()
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": vocab_parallel(axis, out=seq),
        "h.*.attn.c_attn": colwise(axis, splits=[a.dim, a.dim, a.dim]),
        "h.*.attn.c_proj": rowwise(axis, out=seq),
        "h.*.mlp.c_fc": colwise(axis),
        "h.*.mlp.c_proj": rowwise(axis, out=seq),
        "lm_head": colwise(axis, inputs=seq, out=Shard(-1) if loss_parallel else Replicate()),
    }
    if sequence_parallel:
        plan.update({
            # positions [S, D] sliced like the token embeddings [B, S, D] (no communication)
            "wpe": ModuleSpec(out_dst={axis: Shard(0)}, style="sequence_shard"),
            "h.*.ln_1": seq_norm(axis), "h.*.ln_2": seq_norm(axis), "ln_f": seq_norm(axis),
            "h.*.attn": _gather_input(axis), "h.*.mlp": _gather_input(axis),
        })
    return plan
