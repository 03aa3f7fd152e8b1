"""Every hand-written layout rule (``fxshard/layout/op_rules/``) checked against DTensor.

For each op sample in ``SAMPLES`` and each combination of input layouts (Replicate,
Shard(d) of every evenly divisible dim, Partial(sum), Partial(avg); parameters and
index tensors are never Partial), under simulated ranks:

* **fxshard**: the sample is traced once; per combination the placeholders and
  parameters are declared with the layouts, ``propagate`` runs (the rule's answer:
  an output layout, or a PlanError), then the per-rank program is made as
  ``fxshard.transform`` makes it (``localize``, ``vocab_parallel_embedding``,
  ``loss_parallel``; ``defer_bias`` emulated by adding the bias after the reduction)
  and run on each rank's local inputs.  Its outputs, read with the layout the rule
  claims, must be the single-device result (every rank checked, local shapes too).
* **DTensor** (the oracle): the same sample runs on DTensors with the same
  placements; every implicit redistribution DTensor makes is recorded
  (``ExplicitRedistributionContext.observe_redistribution``, and
  ``CommDebugMode``), with its output placements.  Attention runs on the math
  backend (DTensor's CPU flash-attention strategy takes seconds per layout).

Verdicts per combination (see ``_verdict``): ``agree`` (same layout, no
redistribution), ``both refuse`` (fxshard refuses, DTensor redistributes or has no
strategy), ``gap`` (fxshard refuses, DTensor runs without redistributing),
``accepts, DTensor redistributes``, ``different layout``, ``wrong numbers``,
``fxshard internal error``, ``DTensor error``.  Every verdict but the first two
fails unless ``ALLOWLIST`` explains it (deliberate differences and DTensor's own
limits, one line each) or ``DEFECTS`` lists it (known open rule defects, checked
by ``test_known_defect`` as strict xfails so they flip when fixed).  Wrong numbers
and internal errors are never allowlisted.  ``FIXED`` keeps the defects this check
found, each a regression test (``test_fixed_defect``).

A new entry in ``RULES``/``METHOD_RULES`` that takes tensors needs a sample
(``test_every_rule_has_a_sample``).
Run one op: ``pytest tests/test_rules_vs_dtensor.py -k softmax``; print every case:
``FXSHARD_RULES_VERBOSE=1 pytest -s ...``.
"""
from __future__ import annotations

import builtins
import contextlib
import itertools
import math
import operator
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import ExplicitRedistributionContext
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten

import fxshard
from fxshard import InternalError, PlanError
from fxshard.layout import op_rules as rules
from fxshard.meta import KEY, PassContext, TensorInfo, info
from fxshard.passes.localize import localize
from fxshard.passes.loss_parallel import loss_parallel
from fxshard.passes.propagate import propagate
from fxshard.passes.vocab_parallel_embedding import vocab_parallel_embedding
from harness import plain, rank_map, rank_value, ranks_of, simulated

R = Replicate()
P, PA = Partial(), Partial("avg")
VERBOSE = bool(os.environ.get("FXSHARD_RULES_VERBOSE"))


# ----------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class T:
    """One tensor argument of a sample.

    kind: ``float`` (randn), ``pos`` (positive), ``f64``, ``complex``, ``bool``,
    ``int:N`` (ids in [0, N)), ``target:N`` (class ids), ``target:N:ignore`` (the
    first three are ignore_index: rank 0 of a batch shard holds most of them).
    ``param``: a module parameter (``get_attr``, as after ``normalize``), never Partial.
    ``opts``: placements per mesh axis to try (default: all).  ``splits``: a fused
    parameter's parts (``colwise(splits=...)``) along the dim it is sharded on.
    """

    shape: tuple
    kind: str = "float"
    param: bool = False
    opts: dict | None = None
    splits: tuple | None = None


@dataclass
class Sample:
    id: str
    fn: Callable
    inputs: tuple
    mesh: dict = field(default_factory=lambda: {"tp": 2})
    retarget: tuple | None = None  # ((op, target), (op, target)): a node as other captures write it
    edit: Callable | None = None  # edit(gm) after tracing: arguments as other captures pass them
    keep: Callable | None = None  # trims the layout combinations: keep(layouts) -> bool
    slow: bool = False


def _s(id, fn, *inputs, **kw) -> Sample:
    return Sample(id, fn, tuple(T(i) if isinstance(i, tuple) else i for i in inputs), **kw)


X = (2, 4, 8)
POS = T(X, "pos")
IDX = T((4,), "int:4")
BOOL = T(X, "bool")
DP2 = {"dp": 2, "tp": 2}


def _assembled(a, b):
    """HF's MLA keys: a new buffer, the per-head part copied in, the shared part broadcast."""
    buf = a.new_empty(2, 4, 8)
    buf[..., :4].copy_(a)
    buf[..., 4:].copy_(b.expand(-1, 4, -1))
    return buf


_aten = torch.ops.aten
_LIKE = [("ones_like", lambda x: torch.ones_like(x), _aten.ones_like.default),
         ("zeros_like", lambda x: torch.zeros_like(x), _aten.zeros_like.default),
         ("empty_like", lambda x: torch.empty_like(x).fill_(2.0), _aten.empty_like.default),
         ("full_like", lambda x: torch.full_like(x, 3.0), _aten.full_like.default),
         ("rand_like", lambda x: torch.rand_like(x) < 2, _aten.rand_like.default),
         ("randn_like", lambda x: torch.randn_like(x) * 0, _aten.randn_like.default),
         ("randint_like", lambda x: torch.randint_like(x, 5) < 5, _aten.randint_like.default),
         ("randint_like/low", lambda x: torch.randint_like(x, 1, 5) > 0, _aten.randint_like.low_dtype)]


def _same_qkv(lays):
    """k and v alike, and either Replicate or laid out like q."""
    return lays[1] == lays[2] and all(isinstance(p, Replicate) for p in lays[1].values()) or lays[0] == lays[1] == lays[2]


def _positional(gm: fx.GraphModule, fn, names) -> None:
    """``fn``'s keyword arguments ``names`` made positional, as ``normalize`` writes the call
    (fx records ``F.layer_norm(x, shape, weight=w, bias=b, eps=...)``)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is fn:
            n.args = (*n.args, *(n.kwargs[k] for k in names))
            n.kwargs = {k: v for k, v in n.kwargs.items() if k not in names}


SAMPLES: list[Sample] = [
    # -- pointwise: operators
    _s("operator.add", lambda x, y: x + y, X, X),
    _s("operator.add/broadcast", lambda x, y: x + y, X, (8,)),
    _s("operator.add/broadcast-1", lambda x, y: x + y, X, (4, 1)),
    _s("operator.add/scalar", lambda x: x + 1.0, X),
    _s("operator.add/zero", lambda x: x + 0, X),
    _s("operator.sub", lambda x, y: x - y, X, X),
    _s("operator.mul", lambda x, y: x * y, X, X),
    _s("operator.mul/broadcast", lambda x, y: x * y, X, (4, 1)),
    _s("operator.mul/scalar", lambda x: x * 2.0, X),
    _s("operator.truediv", lambda x, y: x / y, X, POS),
    _s("operator.truediv/scalar", lambda x: x / 2.0, X),
    _s("operator.truediv/rscalar", lambda x: 2.0 / x, POS),
    _s("operator.neg", lambda x: -x, X),
    _s("operator.pow", lambda x: x ** 2, X),
    _s("operator.pow/tensor", lambda x, y: x ** y, POS, X),
    _s("operator.mul/traced-scalar", lambda x: x * x.size(-1), X),
    _s("operator.add/traced-scalar", lambda x: x + x.size(0), X),
    _s("operator.mod", lambda x: x % 1.5, X),
    _s("builtins.abs", lambda x: abs(x), X, retarget=(("call_function", operator.abs), ("call_function", builtins.abs))),
    # -- pointwise: torch functions
    _s("torch.add", lambda x, y: torch.add(x, y), X, X),
    _s("torch.add/alpha", lambda x, y: torch.add(x, y, alpha=2), X, X),
    _s("torch.sub", lambda x, y: torch.sub(x, y), X, (8,)),
    _s("torch.mul", lambda x, y: torch.mul(x, y), X, X),
    _s("torch.div", lambda x, y: torch.div(x, y), X, POS),
    _s("torch.neg", lambda x: torch.neg(x), X),
    _s("torch.rsqrt", lambda x: torch.rsqrt(x), POS),
    _s("torch.sqrt", lambda x: torch.sqrt(x), POS),
    _s("torch.exp", lambda x: torch.exp(x), X),
    _s("torch.log", lambda x: torch.log(x), POS),
    _s("torch.tanh", lambda x: torch.tanh(x), X),
    _s("torch.sigmoid", lambda x: torch.sigmoid(x), X),
    _s("torch.sin", lambda x: torch.sin(x), X),
    _s("torch.cos", lambda x: torch.cos(x), X),
    _s("torch.pow", lambda x, y: torch.pow(x, y), POS, X),
    _s("torch.pow/scalar", lambda x: torch.pow(x, 2), X),
    _s("torch.where", lambda c, x, y: torch.where(c, x, y), BOOL, X, X, keep=lambda l: l[0]["tp"] in (R, l[1]["tp"])),
    _s("torch.where/scalar", lambda c, x: torch.where(c, x, 0.0), BOOL, X),
    _s("torch.abs", lambda x: torch.abs(x), X),
    _s("torch.clamp", lambda x: torch.clamp(x, min=-0.5, max=0.5), X),
    _s("torch.square", lambda x: torch.square(x), X),
    _s("torch.polar", lambda a, b: torch.polar(a, b), POS, X),
    _s("torch.outer", lambda a, b: torch.outer(a, b), (4,), (8,)),
    _s("torch.relu", lambda x: torch.relu(x), X),
    _s("F.silu", lambda x: F.silu(x), X),
    _s("F.gelu", lambda x: F.gelu(x), X),
    _s("F.relu", lambda x: F.relu(x), X),
    _s("F.tanh", lambda x: F.tanh(x), X, retarget=(("call_method", "tanh"), ("call_function", F.tanh))),
    _s("F.sigmoid", lambda x: F.sigmoid(x), X, retarget=(("call_method", "sigmoid"), ("call_function", F.sigmoid))),
    _s("F.dropout", lambda x: F.dropout(x, 0.1, training=False), X),
    # -- pointwise: methods
    _s("add", lambda x, y: x.add(y), X, X),
    _s("sub", lambda x, y: x.sub(y), X, X),
    _s("mul", lambda x, y: x.mul(y), X, X),
    _s("div", lambda x, y: x.div(y), X, POS),
    _s("neg", lambda x: x.neg(), X),
    _s("__add__", lambda x, y: x.__add__(y), X, X, retarget=(("call_function", operator.add), ("call_method", "__add__"))),
    _s("float", lambda x: x.float(), T(X, "f64")),
    _s("half", lambda x: x.half(), X),
    _s("bfloat16", lambda x: x.bfloat16(), X),
    _s("double", lambda x: x.double(), X),
    _s("to/dtype", lambda x: x.to(torch.float64), X),
    _s("to/other", lambda x, y: x.to(y), X, T(X, "f64")),
    _s("type_as", lambda x, y: x.type_as(y), X, T((8,), "f64")),
    _s("contiguous", lambda x: x.contiguous(), X),
    _s("clone", lambda x: x.clone(), X),
    _s("detach", lambda x: x.detach(), X),
    _s("pow", lambda x: x.pow(2), X),
    _s("rsqrt", lambda x: x.rsqrt(), POS),
    _s("sqrt", lambda x: x.sqrt(), POS),
    _s("exp", lambda x: x.exp(), X),
    _s("log", lambda x: x.log(), POS),
    _s("tanh", lambda x: x.tanh(), X),
    _s("sigmoid", lambda x: x.sigmoid(), X),
    _s("relu", lambda x: x.relu(), X),
    _s("abs", lambda x: x.abs(), X),
    _s("sin", lambda x: x.sin(), X),
    _s("cos", lambda x: x.cos(), X),
    _s("masked_fill", lambda x, m: x.masked_fill(m, 0.0), X, BOOL),
    _s("masked_fill/broadcast", lambda x, m: x.masked_fill(m, 0.0), X, T((4, 8), "bool")),
    _s("square", lambda x: x.square(), X),
    _s("clamp", lambda x: x.clamp(min=0.0), X),
    # -- linear algebra
    _s("operator.matmul", lambda x, w: x @ w, X, (8, 4)),
    _s("torch.matmul", lambda x, w: torch.matmul(x, w), X, (8, 4)),
    _s("torch.matmul/batched", lambda q, k: torch.matmul(q, k), X, (2, 8, 4)),
    _s("torch.matmul/broadcast", lambda q, k: torch.matmul(q, k), (2, 2, 4, 8), (2, 1, 8, 4)),
    _s("torch.matmul/1d", lambda x, v: torch.matmul(x, v), (4, 8), (8,)),
    _s("torch.bmm", lambda a, b: torch.bmm(a, b), X, (2, 8, 4)),
    _s("matmul", lambda a, b: a.matmul(b), X, (8, 4)),
    _s("F.linear", lambda x, w, b: F.linear(x, w, b), X, T((4, 8), param=True), T((4,), param=True)),
    _s("F.linear/nobias", lambda x, w: F.linear(x, w), X, T((4, 8), param=True)),
    _s("F.linear/fused-split", lambda x, w: F.linear(x, w).split([4, 12], -1), T(X, opts={"tp": [R]}),
       T((16, 8), param=True, splits=(4, 12), opts={"tp": [Shard(0)]})),
    _s("F.linear/fused-chunk", lambda x, w: F.linear(x, w).chunk(2, -1), T(X, opts={"tp": [R]}),
       T((16, 8), param=True, splits=(8, 8), opts={"tp": [Shard(0)]})),
    _s("F.linear/fused-view", lambda x, w: F.linear(x, w).view(2, 4, 2, 8), T(X, opts={"tp": [R]}),
       T((16, 8), param=True, splits=(8, 8), opts={"tp": [Shard(0)]})),
    _s("F.linear/fused-grouped-view", lambda x, w: F.linear(x, w).view(2, 4, 4, 4), T(X, opts={"tp": [R]}),
       T((16, 8), param=True, splits=(8, 8), opts={"tp": [Shard(0)]})),
    _s("F.scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
       (2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 4, 8), keep=_same_qkv),
    _s("F.scaled_dot_product_attention/causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
       (2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 4, 8), keep=lambda l: l[0] == l[1] == l[2]),
    _s("F.scaled_dot_product_attention/mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
       (2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 4, 8), T((2, 1, 4, 4), "bool"), keep=lambda l: l[0] == l[1] == l[2]),
    # -- softmax, norms, embedding, losses
    _s("torch.softmax", lambda x: torch.softmax(x, -1), X),
    _s("F.softmax", lambda x: F.softmax(x, dim=1), X),
    _s("F.log_softmax", lambda x: F.log_softmax(x, -1), X),
    _s("torch.log_softmax", lambda x: torch.log_softmax(x, 1), X),
    _s("softmax", lambda x: x.softmax(-1), X),
    _s("softmax/traced-dim", lambda x: x.softmax(x.ndim - 1), X),
    _s("log_softmax", lambda x: x.log_softmax(dim=-1), X),
    _s("F.layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), X, T((8,), param=True), T((8,), param=True)),
    _s("F.layer_norm/positional", lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5), X, T((8,), param=True),
       T((8,), param=True), edit=lambda gm: _positional(gm, F.layer_norm, ("weight", "bias", "eps"))),
    _s("F.layer_norm/2dims", lambda x, w: F.layer_norm(x, (4, 8), w), X, T((4, 8), param=True)),
    _s("F.layer_norm/noaffine", lambda x: F.layer_norm(x, (8,)), X),
    _s("F.rms_norm", lambda x, w: F.rms_norm(x, (8,), w), X, T((8,), param=True)),
    _s("F.rms_norm/positional", lambda x, w: F.rms_norm(x, (8,), w, 1e-5), X, T((8,), param=True),
       edit=lambda gm: _positional(gm, F.rms_norm, ("weight", "eps"))),
    _s("F.embedding", lambda i, w: F.embedding(i, w), T((2, 4), "int:16"), T((16, 8), param=True)),
    _s("F.embedding/padding_idx", lambda i, w: F.embedding(i, w, padding_idx=0), T((2, 4), "int:16"), T((16, 8), param=True)),
    _s("F.cross_entropy", lambda x, t: F.cross_entropy(x, t), (8, 6), T((8,), "target:6")),
    _s("F.cross_entropy/sum", lambda x, t: F.cross_entropy(x, t, reduction="sum"), (8, 6), T((8,), "target:6")),
    _s("F.cross_entropy/none", lambda x, t: F.cross_entropy(x, t, reduction="none"), (8, 6), T((8,), "target:6")),
    _s("F.cross_entropy/ignore_index", lambda x, t: F.cross_entropy(x, t), (8, 6), T((8,), "target:6:ignore")),
    _s("F.cross_entropy/3d", lambda x, t: F.cross_entropy(x, t), (2, 6, 4), T((2, 4), "target:6")),
    _s("F.nll_loss", lambda x, t: F.nll_loss(x, t), (8, 6), T((8,), "target:6")),
    # -- views
    _s("view/split", lambda x: x.view(2, 4, 2, 4), X),
    _s("view/merge", lambda x: x.view(2, 4, 8), (2, 4, 2, 4)),
    _s("view/merge-leading", lambda x: x.view(8, 8), X),
    _s("view/infer", lambda x: x.view(2, -1), X),
    _s("view/sizes", lambda x: x.view(x.size(0), x.size(1), 2, 4), X),
    _s("view/shape", lambda x: x.view(x.shape[0], x.shape[1], 2, -1), X),
    _s("reshape", lambda x: x.reshape(2, 4, 2, 4), X),
    _s("torch.reshape", lambda x: torch.reshape(x, (2, 2, 2, 8)), X),
    _s("flatten", lambda x: x.flatten(0, 1), X),
    _s("torch.flatten", lambda x: torch.flatten(x, 1), X),
    _s("unflatten", lambda x: x.unflatten(1, (2, 2)), X),
    _s("torch.unflatten", lambda x: torch.unflatten(x, -1, (2, 4)), X),
    _s("squeeze", lambda x: x.squeeze(1), (2, 1, 8)),
    _s("torch.squeeze", lambda x: torch.squeeze(x, 1), (2, 1, 8)),
    _s("unsqueeze", lambda x: x.unsqueeze(-1), X),
    _s("torch.unsqueeze", lambda x: torch.unsqueeze(x, 1), X),
    _s("view_as", lambda x, y: x.view_as(y), X, (2, 4, 2, 4)),
    _s("reshape_as", lambda x, y: x.reshape_as(y), (2, 4, 2, 4), X),
    _s("torch.view_as_complex", lambda x: torch.view_as_complex(x), (2, 4, 4, 2)),
    _s("torch.view_as_real", lambda x: torch.view_as_real(x), T((2, 4, 4), "complex")),
    _s("transpose", lambda x: x.transpose(1, 2), X),
    _s("torch.transpose", lambda x: torch.transpose(x, 0, -1), X),
    _s("permute", lambda x: x.permute(0, 2, 1), X),
    _s("permute/list", lambda x: x.permute([2, 0, 1]), X),
    _s("torch.permute", lambda x: torch.permute(x, (1, 2, 0)), X),
    _s("t", lambda x: x.t(), (4, 8)),
    _s("torch.t", lambda x: torch.t(x), (4, 8)),
    _s("expand", lambda x: x.expand(2, 4, 8), (1, 4, 8)),
    _s("expand/new-dim", lambda x: x.expand(2, 4, 8), (4, 8)),
    _s("expand/infer", lambda x: x.expand(2, -1, -1), (1, 4, 8)),
    _s("expand_as", lambda x, y: x.expand_as(y), (1, 4, 8), X),
    _s("repeat_interleave", lambda x: x.repeat_interleave(2, dim=1), X),
    _s("repeat_interleave/flat", lambda x: x.repeat_interleave(2), X),
    _s("torch.repeat_interleave", lambda x: torch.repeat_interleave(x, 2, dim=-1), X),
    _s("split", lambda x: x.split(2, -1), X),
    _s("split/sizes", lambda x: x.split([2, 2], dim=1), X),
    _s("torch.split", lambda x: torch.split(x, [2, 6], dim=-1), X),
    _s("chunk", lambda x: x.chunk(2, dim=1), X),
    _s("torch.chunk", lambda x: torch.chunk(x, 4, -1), X),
    _s("narrow", lambda x: x.narrow(1, 0, 2), X),
    _s("torch.narrow", lambda x: torch.narrow(x, -1, 2, 4), X),
    _s("narrow/traced-length", lambda x: torch.narrow(x, 1, 0, x.size(0)), X),
    _s("torch.cat", lambda a, b: torch.cat([a, b], dim=1), X, X),
    _s("torch.cat/last", lambda a, b: torch.cat([a, b], -1), X, X),
    _s("torch.concat", lambda a, b: torch.concat([a, b]), X, X),
    _s("torch.stack", lambda a, b: torch.stack([a, b], 1), X, X),
    _s("torch.stack/0", lambda a, b: torch.stack([a, b]), X, X),
    _s("copy_", lambda d, s: d.clone().copy_(s), X, X),
    _s("copy_/broadcast", lambda d, s: d.clone().copy_(s), X, (8,)),
    _s("aten.copy_", lambda d, s: torch.ops.aten.copy_.default(d.clone(), s), X, X),
    # -- a replicated broadcast meeting sharded parts (MLA keys: the shared rope key per head)
    _s("expand/run-time-size", lambda x, y: y.expand(-1, x.shape[1], -1), X, (2, 1, 8)),
    _s("torch.cat/broadcast-expand", lambda a, b: torch.cat([a, b.expand(-1, 4, -1)], -1), (2, 4, 4), (2, 1, 4)),
    _s("operator.mul/broadcast-expand", lambda a, b: a * b.expand(-1, 4, -1), (2, 4, 4), (2, 1, 4)),
    _s("new_empty/assembled", lambda a, b: _assembled(a, b), (2, 4, 4), (2, 1, 4)),
    _s("new_zeros", lambda x: x.new_zeros(2, 4, 8), X),
    _s("new_ones", lambda x: x.new_ones((2, 4)), X),
    _s("new_full", lambda x: x.new_full((2, 4), 1.5), X),
    # -- new tensors of their input's local shape (rules.fill_like); random ones read so that only the shape shows
    *[_s(f"{ns}.{name}", fn, X, retarget=None if ns == "torch" else (("call_function", getattr(torch, name.split("/")[0])), ("call_function", op)))
      for name, fn, op in _LIKE for ns in ("torch", "aten")],
    # -- masks by position over the last two dims (rules.triangle)
    _s("torch.tril", lambda x: torch.tril(x), X), _s("torch.triu", lambda x: torch.triu(x, 1), X),
    _s("tril", lambda x: x.tril(-1), X), _s("triu", lambda x: x.triu(), X),
    _s("aten.tril", lambda x: torch.tril(x), X, retarget=(("call_function", torch.tril), ("call_function", torch.ops.aten.tril.default))),
    _s("aten.triu", lambda x: torch.triu(x), X, retarget=(("call_function", torch.triu), ("call_function", torch.ops.aten.triu.default))),
    # -- indexing, sizes
    _s("getitem/int", lambda x: x[:, 1], X),
    _s("getitem/slice", lambda x: x[..., 2:6], X),
    _s("getitem/step", lambda x: x[:, ::2], X),
    _s("getitem/none", lambda x: x[:, None], X),
    _s("getitem/first", lambda x: x[0], X),
    _s("getitem/advanced", lambda x, i: x[i], (8, 4), IDX),
    _s("getitem/advanced-dim1", lambda x, i: x[:, i], (4, 8), IDX),
    _s("getattr/shape", lambda x: x.view(x.shape[0], -1), X),
    _s("getattr/ndim", lambda x: x.sum(x.ndim - 1), X),
    _s("getattr/T", lambda x: x.T, (4, 8)),
    _s("size", lambda x: x.view(x.size(0) * x.size(1), x.size(-1)), X),
    _s("dim", lambda x: x.sum(x.dim() - 1), X),
    # -- reductions
    _s("torch.sum", lambda x: torch.sum(x, dim=-1), X),
    _s("torch.sum/keepdim", lambda x: torch.sum(x, dim=1, keepdim=True), X),
    _s("torch.sum/all", lambda x: torch.sum(x), X),
    _s("torch.sum/dims", lambda x: torch.sum(x, (0, 1)), X),
    _s("torch.mean", lambda x: torch.mean(x, 1), X),
    _s("torch.mean/keepdim", lambda x: torch.mean(x, -1, keepdim=True), X),
    _s("torch.amax", lambda x: torch.amax(x, -1), X),
    _s("sum", lambda x: x.sum(1), X),
    _s("sum/keepdim", lambda x: x.sum(-1, keepdim=True), X),
    _s("mean", lambda x: x.mean(), X),
    _s("mean/dims", lambda x: x.mean((1, 2), True), X),
    _s("amax", lambda x: x.amax(dim=0), X),
    _s("max", lambda x: x.max(), X),
    _s("max/dim", lambda x: x.max(dim=-1)[0], X),
    # -- factories (no tensor inputs: Replicate, sized by literals or unsharded sizes)
    # (fx records a factory only when a traced size feeds it; a literal one is a constant)
    _s("torch.arange", lambda x: x + torch.arange(x.size(-1)), X),
    _s("torch.zeros", lambda x: x + torch.zeros((x.size(1), 1)), X),
    _s("torch.ones", lambda x: x * torch.ones(x.size(-1)), X),
    _s("torch.full", lambda x: x + torch.full((x.size(1), x.size(2)), 2.0), X),
    _s("torch.empty", lambda x: x + torch.empty((x.size(0), 1, 1)).fill_(1.0), X),
    # -- 2-D mesh ("dp", "tp"): a few layouts per axis by default, the wider sweep is slow
    _s("F.linear/2d", lambda x, w, b: F.linear(x, w, b), T((4, 4, 8), opts={"dp": [R, Shard(0), P], "tp": [R, Shard(2), P]}),
       T((8, 8), param=True, opts={"dp": [R]}), T((8,), param=True, opts={"dp": [R]}), mesh=DP2),
    _s("F.linear/2d-wide", lambda x, w, b: F.linear(x, w, b), T((4, 4, 8), opts={"dp": [R, Shard(0), Shard(1), P]}),
       T((8, 8), param=True, opts={"dp": [R]}), T((8,), param=True, opts={"dp": [R]}), mesh=DP2, slow=True),
    _s("torch.matmul/2d", lambda x, w: torch.matmul(x, w), T((4, 4, 8), opts={"dp": [R, Shard(0), PA], "tp": [R, Shard(2), P]}),
       T((8, 8), opts={"dp": [R], "tp": [R, Shard(0), PA]}), mesh=DP2),
    _s("torch.matmul/2d-wide", lambda x, w: torch.matmul(x, w), T((4, 4, 8), opts={"dp": [R, Shard(0), P]}),
       T((8, 8), opts={"dp": [R, Shard(1)]}), mesh=DP2, slow=True),
    _s("operator.add/2d", lambda x, y: x + y, T((4, 4, 8), opts={"dp": [R, Shard(0), P], "tp": [R, Shard(2), PA]}),
       T((4, 4, 8), opts={"dp": [R, Shard(0), PA], "tp": [R, Shard(2), P]}), mesh=DP2),
    _s("operator.add/2d-wide", lambda x, y: x + y, T((4, 4, 8), opts={"dp": [R, Shard(0), P, PA]}),
       T((4, 4, 8), opts={"dp": [R, Shard(0), P, PA]}), mesh=DP2, slow=True),
    _s("view/split/2d", lambda x: x.view(4, 4, 2, 4), (4, 4, 8), mesh=DP2),
    _s("view/merge/2d", lambda x: x.view(16, 8), (4, 4, 8), mesh=DP2),
    _s("view/merge-inner/2d", lambda x: x.view(4, 4, 8), (4, 4, 2, 4), mesh=DP2),
]

# entries that take no tensor: Python-number arithmetic (math.*, builtins), covered by the propagate tests
SCALAR_ONLY = {f for f, r in rules.RULES.items() if getattr(r, "__name__", "") == "number arithmetic"}
# fxshard's own ops, which DTensor has no strategy for: their rules are tested where they are used
NOT_SAMPLED = {
    torch.ops.fxshard.sliding_window_mask.default: "a mask built from a length under context parallelism "
                                                   "(tests/test_context_parallel_equivalence.py: HF sliding-window layers)",
}


# ----------------------------------------------------------------------------- allowlist and defects

def fmt_p(p) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return {"sum": "P", "avg": "Pa"}.get(p.reduce_op, f"P({p.reduce_op})")
    return repr(p)


def fmt_layouts(lays, names) -> str:
    def one(l):
        return ",".join(fmt_p(l[a]) for a in names)
    return " ".join(one(l) for l in lays)


@dataclass
class Entry:
    """A pattern of cases with its reason.  ``samples``: sample ids (an id ending in ``*``
    is a prefix); ``when(c)``: a predicate on the :class:`Case` (``c.lay(i)``: the
    placement of input ``i`` on the first mesh axis, as ``"R"``, ``"S1"``, ``"P"``,
    ``"Pa"``).  An allowlist entry covers the cases with one of its ``verdicts``; a
    defect covers its cases whatever their verdict (the fixed rule must make them agree)."""

    id: str
    samples: tuple
    reason: str
    when: Callable = lambda c: True
    verdicts: tuple = ()

    def has_sample(self, sample_id: str) -> bool:
        return any(sample_id == s or (s.endswith("*") and sample_id.startswith(s[:-1])) for s in self.samples)

    def matches(self, c: "Case") -> bool:
        return self.has_sample(c.sample.id) and (not self.verdicts or c.verdict in self.verdicts) and self.when(c)


GAP, ACC_REDIST, DIFF, WRONG, DT_ERR = "gap", "accepts, DTensor redistributes", "different layout", "wrong numbers", "DTensor error"
INTERNAL = "fxshard internal error"
OK_VERDICTS = ("agree", "both refuse")


def _on_axes(c) -> list[list[str]]:
    """Per mesh axis, the placements of the inputs (``"R"``, ``"S1"``, ``"P"``, ``"Pa"``)."""
    return [[fmt_p(l[a]) for l in c.layouts] for a in c.names]


def _partial_avg(c) -> bool:
    return any("Pa" in ps for ps in _on_axes(c))


def _redist_all(c, pred) -> bool:
    return bool(c.dt_redist) and all(pred(r) for r in c.dt_redist)


def _to_partial(r: str) -> bool:
    """Does redistribution ``"op: src->dst"`` only turn Replicate axes into Partial (no communication)?"""
    src, dst = (side.split(",") for side in r.rsplit(": ", 1)[1].split("->"))
    return all(a == b or (a == "R" and b.startswith("P")) for a, b in zip(src, dst))


def _dt_out(c) -> str:
    return " ".join(c.dt) if isinstance(c.dt, list) else c.dt


def _no_shard(p: str) -> str:
    return "R" if p.startswith("P") else p


_ADD_FAMILY = ("operator.add", "operator.add/broadcast", "operator.add/broadcast-1", "operator.sub", "torch.add",
               "torch.sub", "add", "sub", "__add__", "operator.add/2d*")
_MATMUL_FAMILY = ("operator.matmul", "torch.matmul", "torch.matmul/batched", "torch.matmul/broadcast", "torch.bmm",
                  "matmul", "torch.matmul/2d*")

# Deliberate differences from DTensor, and DTensor's own limits (one line of reason each).
ALLOWLIST: list[Entry] = [
    # fxshard accepts, DTensor would redistribute (numbers verified: a wrong number is never allowlisted)
    Entry("add-zero", ("operator.add/zero",), "x + 0 keeps a Partial: adding the literal 0 is the identity (rules.pointwise "
          "ignores zero scalars); DTensor reduces first", verdicts=(ACC_REDIST,)),
    Entry("avg-plus-number", ("operator.add/scalar", "operator.add/traced-scalar"), "a Partial(avg) plus a number stays "
          "Partial(avg): the mean of (a_r + c) is A + c (rules.pointwise); DTensor reduces first", verdicts=(ACC_REDIST,),
          when=_partial_avg),
    Entry("dtensor-clone-partial", ("clone", "repeat_interleave*", "torch.repeat_interleave", "copy_*", "aten.copy_",
                                    "torch.matmul/broadcast"),
          "these local ops are linear, so a Partial stays Partial; DTensor's clone/copy_ strategies (also inside "
          "repeat_interleave's and broadcast matmul's decompositions) reduce Partial inputs first", verdicts=(ACC_REDIST,),
          when=lambda c: _redist_all(c, lambda r: r.startswith(("aten.clone.default", "aten.copy_.default")))),
    Entry("linear-sum-of-avg", ("torch.sum*", "sum*", "torch.mean*", "mean*", "getattr/ndim", "dim"),
          "sum/mean are linear: a Partial(sum|avg) input stays Partial of the same kind; DTensor keeps a Partial through "
          "sum only for sum and through mean only for avg", verdicts=(ACC_REDIST,),
          when=lambda c: _redist_all(c, lambda r: r.startswith(("aten.sum", "aten.mean")) and ": P" in r)),
    Entry("defer-bias", ("F.linear*",), "a Partial-output linear with a bias is rewritten by defer_bias (the bias is added once, "
          "after the reduction); DTensor instead redistributes the bias Replicate->Partial (no communication); numbers "
          "checked with the bias added after the reduction", verdicts=(ACC_REDIST,),
          when=lambda c: "defer_bias" in c.fx_rewrites and _redist_all(c, lambda r: "_StridedShard" in r or _to_partial(r))),
    Entry("loss-parallel", ("F.log_softmax", "torch.log_softmax", "log_softmax", "F.cross_entropy*", "F.nll_loss"),
          "loss parallel: log_softmax/cross_entropy/nll_loss over the sharded class dim are rewritten to "
          "fxshard.vocab_parallel_* (global max and sum of exponentials); DTensor gathers the logits", verdicts=(ACC_REDIST,),
          when=lambda c: "loss_parallel" in c.fx_rewrites),
    Entry("vocab-parallel-embedding", ("F.embedding*",), "a vocab-sharded (Shard(0)) embedding is rewritten to masked "
          "local lookups, Partial; DTensor does the same through _MaskPartial (recorded as an ids redistribution)",
          verdicts=(ACC_REDIST,), when=lambda c: "vocab_parallel_embedding" in c.fx_rewrites),
    Entry("fused-projection-blocks", ("F.linear/fused-*",), "a colwise(splits=...) weight is sharded part by part: each "
          "rank holds a slice of every part, so a split/chunk into the parts (or a view keeping the parts outermost) is "
          "local; DTensor only knows contiguous shards", verdicts=(ACC_REDIST, DIFF, GAP)),
    Entry("dtensor-strided-batch", ("torch.matmul/broadcast", "F.linear/2d*", "torch.matmul/2d*"),
          "DTensor flattens the batch dims of matmul/linear, turning a shard of an inner batch dim into _StridedShard, "
          "then gathers; the local op is exact (numbers verified)", verdicts=(ACC_REDIST,),
          when=lambda c: _redist_all(c, lambda r: "_StridedShard" in r)),
    Entry("dtensor-strided-error", ("F.linear/2d*",), "DTensor cannot unflatten a _StridedShard made from two axes sharding "
          "the same inner batch dim (its error); fxshard's result verified by the numbers", verdicts=(DT_ERR,),
          when=lambda c: "_StridedShard" in _dt_out(c)),
    Entry("arange-own-positions", ("torch.arange",), "arange(n) with n the size of a dim sharded on one axis builds this "
          "rank's own positions (Shard(0), plus the rank's offset: rules.factory, localize); DTensor builds the whole range "
          "Replicate and shards it where it meets the sharded operand (no communication either)", verdicts=(ACC_REDIST,)),
    Entry("broadcast-sharded-like-its-user", ("torch.cat/broadcast-expand", "operator.mul/broadcast-expand",
                                              "new_empty/assembled"),
          "a Replicate broadcast (expand of a size-1 dim) meeting a sharded operand is expanded to each rank's local size "
          "(rules.shard_broadcast), and a new buffer the sharded parts are copied into is built sharded like them "
          "(rules.fresh_like); DTensor chunks the broadcast or gathers the parts instead (its R->S is local, S->R is not)",
          verdicts=(ACC_REDIST,)),
    Entry("like-of-partial-replicate", ("torch.empty_like", "aten.empty_like"), "empty_like of a Partial value: fxshard "
          "builds a tensor of the whole shape, Replicate (rules.fill_like); DTensor keeps it Partial, so a fill counts once "
          "per rank", verdicts=(DIFF,)),
    Entry("triangle-keeps-batch-dims", ("torch.tril", "torch.triu", "tril", "triu", "aten.tril", "aten.triu"), "tril/triu "
          "mask the last two dims by position: a sharded leading dim or a Partial value is masked where it is "
          "(rules.triangle); DTensor's strategy replicates the input", verdicts=(ACC_REDIST,)),
    Entry("fresh-tensors-replicate", ("new_zeros", "new_ones"), "x.new_zeros(sizes) of a sharded x: fxshard builds the "
          "single-device tensor, Replicate (rules.fresh_like), where DTensor shards it like x; both exact", verdicts=(DIFF,)),
    # fxshard refuses where DTensor runs without redistributing ("gaps": a missed layout, never wrong numbers)
    Entry("gap-strided-shard", ("*",), "a merge of a sharded non-outermost dim is DTensor's _StridedShard, which fxshard does "
          "not represent (it refuses the view)", verdicts=(GAP,), when=lambda c: "_StridedShard" in _dt_out(c)),
    Entry("gap-partial-max", ("*",), "amax/max over a sharded dim is DTensor's Partial(max); fxshard represents only "
          "Partial sum/avg", verdicts=(GAP,), when=lambda c: "P(max)" in _dt_out(c)),
    Entry("gap-add-alpha", ("torch.add/alpha",), "torch.add(x, y, alpha=2) on Partials: alpha counts as a non-zero scalar "
          "operand, so fxshard refuses (improvement possible: alpha scales y, which is linear)", verdicts=(GAP,)),
    Entry("gap-traced-scalar", ("operator.mul/traced-scalar", "operator.add/traced-scalar"), "a number read from a sharded dim "
          "is the rank's local size at run time, not the global size DTensor sees: fxshard refuses to compute with it",
          verdicts=(GAP,)),
    Entry("gap-matmul-1d", ("torch.matmul/1d",), "matmul with a 1-D operand is refused on sharded inputs (rule limitation; "
          "DTensor handles it)", verdicts=(GAP,)),
    Entry("gap-outer", ("torch.outer",), "outer with one sharded or Partial operand is exact (DTensor runs it) but the "
          "pointwise rule refuses it (see defect outer-dims)", verdicts=(GAP,)),
    Entry("gap-sdpa-seq-query", ("F.scaled_dot_product_attention",), "queries sharded on the sequence with whole "
          "(Replicate) keys/values are exact without a causal mask; fxshard asks q, k, v to be laid out alike",
          verdicts=(GAP,)),
    Entry("gap-repeat-interleave-flat", ("repeat_interleave/flat",), "repeat_interleave without dim flattens; the result is "
          "a shard only when the sharded dim is outermost, and fxshard refuses all sharded inputs", verdicts=(GAP,)),
    Entry("gap-copy-broadcast", ("copy_/broadcast",), "a sharded broadcast source whose dim lines up with the destination's "
          "sharded dim is refused (see defect copy-broadcast-dims)", verdicts=(GAP,)),
    Entry("gap-advanced-index-sharded", ("getitem/advanced*",), "advanced indexing of a tensor sharded on a dim the index "
          "does not touch is exact, but rules.getitem refuses any sharded indexed tensor", verdicts=(GAP,),
          when=lambda c: c.lay(0).startswith("S")),
    # refusals a fixed rule may make (the defects' expected outcome where DTensor is not the right answer)
    Entry("ce-mean-over-batch-shards", ("F.cross_entropy", "F.cross_entropy/ignore_index", "F.cross_entropy/3d", "F.nll_loss"),
          "a mean loss over batch-sharded logits as Partial(avg) (DTensor's answer) is the mean of per-rank means, wrong "
          "with ignore_index or class weights; refusing it (or reducing sum and count) is right", verdicts=(GAP,),
          when=lambda c: c.lay(0).startswith("S") and c.lay(0) != "S1"),
    Entry("as-ops-other-layout", ("view_as", "reshape_as", "expand_as"), "the per-rank x.view_as(other) takes other's local "
          "shape, so other must be laid out like the result; DTensor reads only other's global shape", verdicts=(GAP,),
          when=lambda c: _no_shard(c.lay(0)) != _no_shard(c.lay(1))),
]

# Rule defects this check found (issue 15), fixed in fxshard/layout/op_rules/: each stays as a regression
# test (test_fixed_defect: its cases agree with DTensor or are refused where DTensor redistributes).
FIXED: list[Entry] = [
    Entry("D1-matmul-partial-avg", _MATMUL_FAMILY, "matmul of a Partial(avg) and a Replicate claims Partial(sum): wrong "
          "numbers (n times the result)", when=_partial_avg),
    Entry("D2-outer-dims", ("torch.outer",), "outer goes through the pointwise rule, which aligns both 1-D operands with "
          "the last result dim: a Shard(0) of both claims Shard(1) (each rank holds a diagonal block)",
          when=lambda c: c.lay(0) == c.lay(1) == "S0"),
    Entry("D3-sdpa-sharded-mask", ("F.scaled_dot_product_attention/mask",), "a sharded attn_mask is not checked against "
          "q/k/v's sharded dim: accepted, the per-rank program fails or computes with another rank's mask",
          when=lambda c: c.lay(0).startswith("S") and c.lay(3).startswith("S") and c.lay(3) != c.lay(0)),
    Entry("D4-norm-weight-kwargs", ("F.layer_norm", "F.layer_norm/2dims", "F.rms_norm"), "layer_norm/rms_norm weight and "
          "bias passed by keyword (as fx records F.layer_norm) are not checked: a sharded norm weight is accepted and the "
          "per-rank program fails", when=lambda c: any(c.lay(i) != "R" for i in range(1, len(c.layouts)))),
    Entry("D5-cross-entropy-mean-ignore-index", ("F.cross_entropy/ignore_index",), "mean cross-entropy on batch-sharded "
          "logits claims Partial(avg), which is the mean of per-rank means: wrong when ranks hold different numbers of "
          "non-ignored targets (DTensor makes the same mistake)", when=lambda c: c.lay(0) == c.lay(1) == "S0"),
    Entry("D6-as-ops-ignore-other", ("view_as", "reshape_as", "expand_as"), "view_as/reshape_as/expand_as derive the layout "
          "from the input only; the per-rank program takes the local shape of `other`, which is not the result's local "
          "shape when `other` is laid out differently", when=lambda c: _no_shard(c.lay(0)) != _no_shard(c.lay(1))),
    Entry("D7-copy-broadcast-dims", ("copy_/broadcast",), "copy_ compares the source and destination placements without "
          "aligning the broadcast source's dims: src [8] Shard(0) into dst [2, 4, 8] Shard(0) is accepted, the copy fails",
          when=lambda c: c.lay(1) == "S0"),
    Entry("D8-advanced-index-sharded-index", ("getitem/advanced*",), "x[idx] with a sharded index tensor keeps x's layout "
          "(Replicate/Partial): each rank holds the rows of its index shard, not the whole result",
          when=lambda c: c.lay(1).startswith("S") and not c.lay(0).startswith("S")),
    Entry("D9-traced-reduction-dim", ("getattr/ndim", "dim", "softmax/traced-dim"), "a reduction or softmax dim computed "
          "at trace time (x.ndim - 1, x.dim() - 1) is an fx.Node: the rule crashes (internal error), Replicate inputs "
          "included"),
    Entry("D10-max-dim-tuple", ("max/dim",), "x.max(dim) returns (values, indices); the reduction rule returns one layout, "
          "so every layout, Replicate included, fails with 'no global shape was recorded'"),
    Entry("D11-getattr-T", ("getattr/T",), "x.T is refused for every layout, Replicate included (a replicated model using "
          "w.T cannot be transformed); it is t()/permute(reversed dims)"),
]

# Known open rule defects: each checked by test_known_defect as a strict xfail (the main test skips
# their cases); fix the rule, then move the entry to FIXED.
DEFECTS: list[Entry] = []


# ----------------------------------------------------------------------------- building and running one case


class _Op(nn.Module):
    pass


def _module(sample: Sample, globals_):
    """A module whose forward calls ``sample.fn``: tensor inputs are arguments
    ``x<i>``, parameters ``p<i>`` attributes (``get_attr`` nodes)."""
    args, call = [], []
    for i, t in enumerate(sample.inputs):
        if t.param:
            call.append(f"self.p{i}")
        else:
            args.append(f"x{i}")
            call.append(f"x{i}")
    ns: dict = {}
    exec(f"def forward(self, {', '.join(args)}):\n    return self._fn({', '.join(call)})\n", ns)
    cls = type("Op_" + "".join(ch if ch.isalnum() else "_" for ch in sample.id), (nn.Module,), {"forward": ns["forward"]})
    m = cls()
    m._fn = sample.fn
    for i, (t, g) in enumerate(zip(sample.inputs, globals_)):
        if t.param:
            if g.is_floating_point():
                m.register_parameter(f"p{i}", nn.Parameter(g.clone()))
            else:
                m.register_buffer(f"p{i}", g.clone())
    return m


def _global(t: T, gen) -> torch.Tensor:
    kind, *rest = t.kind.split(":")
    if kind == "float":
        return torch.randn(t.shape, generator=gen)
    if kind == "pos":
        return torch.rand(t.shape, generator=gen) + 0.5
    if kind == "f64":
        return torch.randn(t.shape, generator=gen, dtype=torch.float64)
    if kind == "complex":
        return torch.randn(t.shape, generator=gen, dtype=torch.complex64)
    if kind == "bool":
        return torch.rand(t.shape, generator=gen) < 0.5
    if kind in ("int", "target"):
        x = torch.randint(0, int(rest[0]), t.shape, generator=gen)
        if "ignore" in rest:
            x.view(-1)[:3] = -100
        return x
    raise ValueError(kind)


def _options(t: T, axis: str, size: int):
    """Placements to try for ``t`` on ``axis``."""
    if t.opts is not None and axis in t.opts:
        return list(t.opts[axis])
    out = [R] + [Shard(d) for d in range(len(t.shape)) if t.shape[d] % size == 0 and t.shape[d] >= size]
    if not t.param and t.kind in ("float", "pos", "f64", "complex"):
        out += [P, PA]
    return out


def _even(t: T, lay: dict, mesh: dict) -> bool:
    for d in range(len(t.shape)):
        n = math.prod(mesh[a] for a, p in lay.items() if isinstance(p, Shard) and p.dim == d)
        if t.shape[d] % n:
            return False
    return True


def combos(sample: Sample) -> list[tuple[dict, ...]]:
    names = list(sample.mesh)
    per_input = []
    for t in sample.inputs:
        lays = [dict(zip(names, ps)) for ps in itertools.product(*(_options(t, a, sample.mesh[a]) for a in names))]
        per_input.append([l for l in lays if _even(t, l, sample.mesh)])
    out = list(itertools.product(*per_input))
    if sample.keep is not None:
        out = [c for c in out if sample.keep(c)]
    return out


def _fresh(gm0: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph()
    g.output(g.graph_copy(gm0.graph, {}))
    for n in g.nodes:
        n.meta.pop(KEY, None)
    return fx.GraphModule(gm0, g)


def _trace(sample: Sample, globals_) -> fx.GraphModule:
    model = _module(sample, globals_)
    example = tuple(g for t, g in zip(sample.inputs, globals_) if not t.param)
    gm = fxshard.trace(model, None, example, capture="fx")
    if sample.retarget is not None:
        (op0, t0), (op1, t1) = sample.retarget
        hits = [n for n in gm.graph.nodes if n.op == op0 and n.target == t0]
        assert hits, f"{sample.id}: no {op0} {t0} node to retarget"
        for n in hits:
            n.op, n.target = op1, t1
        gm.recompile()
    if sample.edit is not None:
        sample.edit(gm)
        gm.recompile()
    return gm


def _targets(gm: fx.GraphModule) -> set:
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.add(n.target)
        elif n.op == "call_method":
            out.add(n.target)
    return out


def _problem(err: str) -> str:
    """The ``problem:`` line of a PlanError (where the node and its rule are named)."""
    lines = err.splitlines()
    first = lines[0].split(" in module ")[0].replace("cannot shard node ", "")
    prob = next((l.strip()[len("problem: "):] for l in lines if l.strip().startswith("problem:")), "")
    return f"{first}: {prob[:150]}"


@dataclass
class Case:
    sample: Sample
    layouts: tuple
    names: list
    fx: Any = None  # list of output layouts, or the PlanError text
    fx_rewrites: tuple = ()
    fx_numbers: str | None = None  # None: right; text: what was wrong
    dt: Any = None  # list of output placements (per output), or the error text
    dt_redist: tuple = ()
    dt_numbers: str | None = None
    dt_outs: Any = field(default=None, repr=False)
    verdict: str = ""
    listed: Entry | None = None

    def lay(self, i: int, axis: int = 0) -> str:
        return fmt_p(self.layouts[i][self.names[axis]])

    @property
    def fx_refused(self) -> bool:
        return isinstance(self.fx, str)

    def describe(self) -> str:
        fxs = ("refused: " + _problem(self.fx)) if self.fx_refused else " | ".join(fmt_layouts([l], self.names) for l in self.fx)
        if self.fx_rewrites:
            fxs += f" (rewrite {','.join(self.fx_rewrites)})"
        dts = self.dt if isinstance(self.dt, str) else " | ".join(self.dt)
        red = "; ".join(self.dt_redist)
        s = f"[{self.sample.id}] in: {fmt_layouts(self.layouts, self.names)} -> fxshard {fxs}; DTensor {dts}"
        if red:
            s += f" (redistributes {red})"
        if self.fx_numbers:
            s += f"; fxshard numbers: {self.fx_numbers}"
        if self.dt_numbers:
            s += f"; DTensor numbers: {self.dt_numbers}"
        return s + f" => {self.verdict}"


def _coords(mesh_shape: dict) -> dict:
    """rank -> {axis: index} of a row-major mesh."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    return {r: dict(zip(names, idx)) for r, idx in enumerate(itertools.product(*(range(s) for s in sizes)))}


def _make_inputs(sample: Sample, layouts, globals_, mesh, gen):
    """(DTensor per input for the oracle, local tensor per input for fxshard)."""
    names = list(sample.mesh)
    coords = _coords(sample.mesh)
    dts, locs = [], []
    for t, lay, g in zip(sample.inputs, layouts, globals_):
        placements = [lay[a] for a in names]
        base = [R if isinstance(p, Partial) else p for p in placements]
        dt0 = distribute_tensor(g, mesh, base)
        local = dt0.to_local()
        partial_axes = [a for a, p in lay.items() if isinstance(p, Partial)]
        if partial_axes:
            with plain():
                lshape = rank_value(local, 0).shape
                noise = {}
                for a in partial_axes:
                    n = torch.randn((sample.mesh[a], *lshape), generator=gen, dtype=g.dtype)
                    noise[a] = n - n.mean(0, keepdim=True)
            scale = 1.0 / math.prod(sample.mesh[a] for a in partial_axes if lay[a].reduce_op == "sum")
            noise_lt = rank_map(lambda r: sum(noise[a][coords[r][a]] for a in partial_axes).clone())
            local = local * scale + noise_lt
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=g.shape, stride=g.stride())
        dts.append(dt)
        if t.splits is not None:  # a fused parameter: each rank holds its slice of every part
            (a, d), = [(a, p.dim) for a, p in lay.items() if isinstance(p, Shard)]
            n = sample.mesh[a]
            with plain():
                parts = [[pt.chunk(n, d)[c] for pt in g.split(list(t.splits), d)] for c in range(n)]
                blocked = [torch.cat(ps, d) for ps in parts]
            locs.append(rank_map(lambda r: blocked[coords[r][a]].clone()))
        else:
            locs.append(local.clone())
    return dts, locs


def _outputs(x) -> list:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _close(a, b, what) -> str | None:
    with plain():
        if a.dtype.is_complex or b.dtype.is_complex:
            a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
        if a.shape != b.shape:
            return f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        low = a.dtype in (torch.float16, torch.bfloat16) or b.dtype in (torch.float16, torch.bfloat16)
        try:
            torch.testing.assert_close(a.double(), b.double(), atol=3e-2 if low else 1e-4, rtol=3e-2 if low else 1e-4,
                                       equal_nan=True)
        except AssertionError as e:
            lines = [l for l in str(e).splitlines() if "Greatest absolute" in l or "Mismatched" in l]
            return f"{what}: {'; '.join(l.strip() for l in lines) or 'differs'}"
    return None


def _check_full(out, placements, ref, mesh, local_shape=None, what="output") -> str | None:
    """``out`` (per-rank locals) read with ``placements`` must be ``ref`` on every rank."""
    if local_shape is not None:
        for r in ranks_of(out) or [0]:
            s = tuple(rank_value(out, r).shape)
            if s != tuple(local_shape):
                return f"{what}: rank {r} local shape {s}, the rule says {tuple(local_shape)}"
    try:
        full = DTensor.from_local(out, mesh, placements, run_check=False, shape=ref.shape, stride=ref.stride()).full_tensor()
    except Exception as e:
        return f"{what}: cannot be read as {[fmt_p(p) for p in placements]}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    for r in ranks_of(full) or [0]:
        msg = _close(rank_value(full, r), ref, f"{what} rank {r}")
        if msg:
            return msg
    return None


def _run_fx(case: Case, gm0, locs, globals_, refs, mesh):
    sample, names = case.sample, case.names
    axes = dict(sample.mesh)
    gm = _fresh(gm0)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            i = int(n.target[1:])
            info(n).declared = dict(case.layouts[i])
            if sample.inputs[i].splits is not None:
                info(n).extra["splits"] = sample.inputs[i].splits
    try:
        propagate(gm, PassContext(axes=axes))
    except (PlanError, InternalError) as e:  # an InternalError is a crashed rule: its own verdict, never allowlisted
        case.fx = str(e)
        return
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_infos = [info(a).value for a in tree_flatten(out_node.args[0])[0] if isinstance(a, fx.Node)]
    flat = []
    for v in out_infos:
        flat.extend(v if isinstance(v, tuple) else [v])
    tinfos = [v for v in flat if isinstance(v, TensorInfo)]
    case.fx = [v.layout for v in tinfos]
    case.fx_rewrites = tuple(sorted({info(n).rewrite for n in gm.graph.nodes if info(n).rewrite}))
    # the per-rank program, as fxshard.transform makes it
    deferred = {}
    try:
        ctx = PassContext(axes=axes)
        localize(gm, ctx)
        vocab_parallel_embedding(gm, ctx)
        loss_parallel(gm, ctx)
    except PlanError as e:
        case.fx_numbers = f"a later pass refused: {str(e).splitlines()[0][:160]}"
        return
    for n in gm.graph.nodes:
        if info(n).rewrite == "defer_bias":  # defer_bias: the bias is added once, after the reduction
            deferred[n] = n.args[2] if len(n.args) > 2 else n.kwargs["bias"]
            n.args, n.kwargs = n.args[:2], {k: v for k, v in n.kwargs.items() if k != "bias"}
    gm.recompile()
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        if n.target.startswith("p") and n.target[1:].isdigit():
            local = locs[int(n.target[1:])]
        else:  # state a rewrite added (vocab_start)
            ti = info(n).value
            local = distribute_tensor(getattr(gm, n.target), mesh, [ti.layout[a] for a in names]).to_local()
        gm._parameters.pop(n.target, None)
        gm._buffers.pop(n.target, None)
        setattr(gm, n.target, local)
    try:
        out = gm(*[l for t, l in zip(sample.inputs, locs) if not t.param])
    except Exception as e:
        case.fx_numbers = f"the per-rank program fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return
    outs = _outputs(out)
    if len(outs) != len(tinfos) or len(outs) != len(refs):
        case.fx_numbers = f"{len(outs)} outputs, {len(tinfos)} layouts, {len(refs)} expected"
        return
    out_args = [a for a in tree_flatten(out_node.args[0])[0] if isinstance(a, fx.Node)]
    for k, (o, ti, ref) in enumerate(zip(outs, tinfos, refs)):
        if len(out_args) == len(outs) and out_args[k] in deferred:
            b = deferred[out_args[k]]
            bias = globals_[int(b.target[1:])]
            with plain():
                ref = ref - bias.to(ref.dtype)
        msg = _check_full(o, [ti.layout[a] for a in names], ref, mesh, ti.local_shape, f"output {k}")
        if msg:
            case.fx_numbers = msg
            return


@contextlib.contextmanager
def _record_redistributions(into: list):
    orig = ExplicitRedistributionContext.__dict__["observe_redistribution"]

    def observe(cls, src, dst, msg):
        if tuple(src.placements) != tuple(dst.placements):
            op = str(msg).split("(")[0].replace("Implicit redistribution occurred for ", "")
            into.append(f"{op}: {','.join(fmt_p(p) for p in src.placements)}->{','.join(fmt_p(p) for p in dst.placements)}")
        return orig.__func__(cls, src, dst, msg)

    ExplicitRedistributionContext.observe_redistribution = classmethod(observe)
    try:
        yield
    finally:
        ExplicitRedistributionContext.observe_redistribution = orig


def _canon(p):
    """DTensor's special Partials (_MaskPartial of an embedding, _NormPartial) read as what they reduce by."""
    if isinstance(p, Partial) and type(p) is not Partial:
        return Partial(p.reduce_op)
    return p


def _run_dtensor(case: Case, dts, refs, mesh):
    redist: list = []
    try:
        # the math attention backend: DTensor's strategy for CPU flash attention goes through
        # its decomposition-based propagation, seconds per layout
        with _record_redistributions(redist), CommDebugMode() as comm, implicit_replication(), \
                sdpa_kernel(SDPBackend.MATH):
            out = case.sample.fn(*dts)
    except Exception as e:
        case.dt = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        case.dt_redist = tuple(redist)
        return
    if comm.get_total_counts() and not redist:
        redist.append(f"{comm.get_total_counts()} collective(s)")
    case.dt_redist = tuple(redist)
    outs = _outputs(out)
    case.dt = [",".join(fmt_p(_canon(p)) for p in o.placements) if isinstance(o, DTensor) else "plain tensor" for o in outs]
    case.dt_outs = outs


def _check_dtensor_numbers(case: Case, refs, mesh) -> None:
    """The oracle's own numbers (a diagnostic, read where it and fxshard disagree)."""
    for k, (o, ref) in enumerate(zip(case.dt_outs or [], refs)):
        if isinstance(o, DTensor):
            msg = _check_full(o.to_local(), list(o.placements), ref, mesh, what=f"output {k}")
            if msg:
                case.dt_numbers = msg
                return


def _verdict(case: Case) -> str:
    dt_error = isinstance(case.dt, str)
    if case.fx_refused and "internal error" in case.fx:
        return INTERNAL
    if case.fx_refused:
        if dt_error or case.dt_redist:
            return "both refuse"
        return GAP
    if case.fx_numbers:
        return WRONG
    if dt_error:
        return DT_ERR
    if case.dt_redist:
        return ACC_REDIST
    fxl = [",".join(fmt_p(l[a]) for a in case.names) for l in case.fx]
    return "agree" if fxl == case.dt else DIFF


def _listed(case: Case) -> Entry | None:
    """The defect (whatever the verdict) or else the allowlist entry that covers ``case``."""
    return next((e for e in DEFECTS if e.matches(case)), None) or (
        None if case.verdict in OK_VERDICTS else next((e for e in ALLOWLIST if e.matches(case)), None))


_RESULTS: dict[str, list[Case]] = {}


def run_sample(sample: Sample) -> list[Case]:
    """Every layout combination of ``sample``, checked (cached per sample id)."""
    if sample.id in _RESULTS:
        return _RESULTS[sample.id]
    gen = torch.Generator().manual_seed(zlib.crc32(sample.id.encode()))
    globals_ = [_global(t, gen) for t in sample.inputs]
    with torch.no_grad():
        refs = _outputs(sample.fn(*globals_))
    gm0 = _trace(sample, globals_)
    names = list(sample.mesh)
    cases = []
    with simulated(sample.mesh) as mesh, torch.no_grad():
        fxshard.bind_mesh(mesh)
        for layouts in combos(sample):
            case = Case(sample, layouts, names)
            dts, locs = _make_inputs(sample, layouts, globals_, mesh, gen)
            _run_fx(case, gm0, locs, globals_, refs, mesh)
            _run_dtensor(case, dts, refs, mesh)
            case.verdict = _verdict(case)
            if case.verdict != "agree":
                _check_dtensor_numbers(case, refs, mesh)
            case.dt_outs = None
            case.listed = _listed(case)
            cases.append(case)
    _RESULTS[sample.id] = cases
    return cases


# ----------------------------------------------------------------------------- tests


def _covered() -> set:
    out = set()
    for s in SAMPLES:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            gm = _trace(s, [_global(t, gen) for t in s.inputs])
        out |= _targets(gm)
    return out


def test_every_rule_has_a_sample():
    """Every rule of an op on tensors is exercised by a sample (new rules need one)."""
    covered = _covered()
    want_fn = {f for f in rules.RULES if f not in SCALAR_ONLY and f not in NOT_SAMPLED}
    missing = [getattr(f, "__name__", str(f)) for f in want_fn if f not in covered]
    missing += [m for m in rules.METHOD_RULES if m not in covered]
    assert not missing, f"layout rules without a sample in SAMPLES: {sorted(missing)}"


def test_lists_name_samples():
    """Every allowlist and defect entry names samples that exist (a renamed sample must not silence it)."""
    ids = [s.id for s in SAMPLES]
    assert len(set(ids)) == len(ids), "duplicate sample ids"
    for e in ALLOWLIST + FIXED + DEFECTS:
        for pat in e.samples:
            assert any(Entry(e.id, (pat,), "").has_sample(i) for i in ids), f"{e.id}: no sample {pat!r}"


def _param(s: Sample):
    return pytest.param(s, id=s.id, marks=[pytest.mark.slow] if s.slow else [])


def _print(cases: list[Case]) -> None:
    if VERBOSE:
        for c in cases:
            print(c.describe() + (f" [{c.listed.id}]" if c.listed else ""))


@pytest.mark.parametrize("sample", [_param(s) for s in SAMPLES])
def test_rule_vs_dtensor(sample: Sample):
    """fxshard's layout for every input layout combination agrees with DTensor's, and
    the per-rank program computes the single-device numbers, or ALLOWLIST says why not.
    The cases of known DEFECTS are checked by test_known_defect."""
    cases = run_sample(sample)
    _print(cases)
    assert cases, f"{sample.id}: no layout combination to check"
    bad = [c for c in cases if c.verdict not in OK_VERDICTS and c.listed is None]
    assert not bad, f"{len(bad)} of {len(cases)} layout combinations disagree with DTensor:\n" + "\n".join(
        c.describe() for c in bad[:25])


def _defect_param(d: Entry):
    slow = all(s.slow for s in SAMPLES if d.has_sample(s.id))
    return pytest.param(d, id=d.id, marks=[pytest.mark.xfail(strict=True, reason=f"defect {d.id}: {d.reason}")]
                        + ([pytest.mark.slow] if slow else []))


def _defect_cases(defect: Entry) -> list[Case]:
    cases = [c for s in SAMPLES if defect.has_sample(s.id) and not s.slow for c in run_sample(s) if defect.when(c)]
    assert cases, f"{defect.id}: no case matches"
    _print(cases)
    return cases


@pytest.mark.parametrize("defect", [pytest.param(d, id=d.id) for d in FIXED])
def test_fixed_defect(defect: Entry):
    """The shrunk reproducer of a defect found here (FIXED) agrees with DTensor, or is
    refused where DTensor redistributes (or where ALLOWLIST says why)."""
    cases = _defect_cases(defect)
    bad = [c for c in cases if c.verdict not in OK_VERDICTS and next((e for e in ALLOWLIST if e.matches(c)), None) is None]
    assert not bad, f"{len(bad)} of {len(cases)} cases of {defect.id} disagree again:\n" + "\n".join(c.describe() for c in bad[:10])


@pytest.mark.parametrize("defect", [_defect_param(d) for d in DEFECTS])
def test_known_defect(defect: Entry):
    """A known defect's cases agree with DTensor (xfail until rules.py is fixed; then
    this XPASSes, strict: delete the DEFECTS entry)."""
    cases = [c for s in SAMPLES if defect.has_sample(s.id) and not s.slow for c in run_sample(s) if defect.when(c)]
    assert cases, f"{defect.id}: no case matches"
    _print(cases)
    bad = [c for c in cases if c.verdict not in OK_VERDICTS and next((e for e in ALLOWLIST if e.matches(c)), None) is None]
    assert not bad, f"{len(bad)} of {len(cases)} cases of {defect.id} still disagree:\n" + "\n".join(c.describe() for c in bad[:10])
