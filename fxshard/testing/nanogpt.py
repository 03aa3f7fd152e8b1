"""nanoGPT (Karpathy's ``model.py``), written the way that file writes it, and its
tensor-parallel plan.

The model keeps nanoGPT's structure and FQNs, so a nanoGPT checkpoint's
``state_dict`` keys match: ``transformer.{wte, wpe, drop, h.{i}, ln_f}`` and a
``lm_head`` tied to ``transformer.wte``; fused ``c_attn`` split with
``.split(self.n_embd, dim=2)``; the manual (non-flash) attention with the causal
mask buffer ``bias`` and ``1.0 / math.sqrt(k.size(-1))``; ``LayerNorm`` with an
optional bias; learned positions from ``torch.arange(0, t, device=idx.device)``.

Differences from nanoGPT, for tracing and testing: ``forward(idx)`` returns the
logits of every position (nanoGPT returns ``(logits, loss)``, and only the last
position's logits when there are no targets); there is no ``assert t <= block_size``
(control flow on a traced size); dropout defaults to 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (b, t, vocab_size)


def nanogpt(seed: int = 0, config: GPTConfig | None = None, **overrides) -> GPT:
    """``GPT(replace(config or GPTConfig(), **overrides))`` with nanoGPT's init, from ``seed``."""
    cfg = replace(config if config is not None else GPTConfig(), **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def nanogpt_plan(axis: str = "tp", config: GPTConfig | None = None, *, loss_parallel: bool = False) -> dict:
    """Megatron tensor parallelism for :class:`GPT`, as data (wrap in ``fxshard.Plan``).

    ``c_attn`` is column-parallel part by part (``splits=[n_embd] * 3``: each rank holds
    its heads of q, k and v); ``attn.c_proj`` and ``mlp.c_proj`` are row-parallel (bias
    added once after the all-reduce); ``c_fc`` is column-parallel.  The tied
    ``wte``/``lm_head`` weight is sharded on the vocab, ``Shard(0)``, under both names:
    ``wte`` is a vocab-parallel embedding (masked lookup, all-reduced), ``lm_head`` is
    column-parallel with its logits all-gathered (``Replicate``), or left vocab-sharded
    for a loss-parallel cross-entropy (``loss_parallel``).
    """
    from torch.distributed.tensor import Replicate, Shard

    from fxshard.plan.specs import colwise, rowwise, vocab_parallel

    c = config or GPTConfig()
    return {
        "transformer.wte": vocab_parallel(axis),
        "transformer.h.*.attn.c_attn": colwise(axis, splits=[c.n_embd] * 3),
        "transformer.h.*.attn.c_proj": rowwise(axis),
        "transformer.h.*.mlp.c_fc": colwise(axis),
        "transformer.h.*.mlp.c_proj": rowwise(axis),
        "lm_head": colwise(axis, out=Shard(-1) if loss_parallel else Replicate()),
    }
