"""The entries of a plan: what one module's tensors look like on the mesh (``ModuleSpec``
and its constructors ``colwise``, ``rowwise``, ...), and the FQN patterns that pick modules.

Example::

    >>> colwise().params
    {'weight': {'tp': Shard(dim=0)}, 'bias': {'tp': Shard(dim=0)}}
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxshard.errors import PlanError

LayoutLike = Any  # {axis: Placement} or a bare Placement on a 1-D mesh


@dataclass
class ModuleSpec:
    """What the plan says about one module (matched by FQN pattern).

    Fields:
      params:   ``{relative_param_name: layout}``; parameters not listed are Replicate.
      inputs:   layout each forward argument must have on entry: a bare layout for a
                single-input module, ``{arg_name: layout}``, or a tuple by position;
                ``{0: layout, "mask": layout}`` mixes positions (int keys) and names.
                fxshard redistributes whatever arrives into it.
      in_src:   layout the inputs are expected to arrive in (same forms as ``inputs``);
                checked against propagation, like ``input_layouts`` of torch's styles.
      out_src:  layout the module produces (checked against propagation).
      out_dst:  layout the output must have on exit (redistributed from out_src).
      out_names: names of tuple outputs; ``out_src``/``out_dst`` may then be dicts by name.
      local / compute: opaque region run on local tensors (expert parallelism).
      optional_params: names in ``params`` that a module may lack (a Linear without bias).
      splits:   sizes of the parts a fused weight's sharded dim is made of (``[q, k, v]``);
                each part is sharded on its own, so every rank holds its slice of every part.
      context_parallel: a :class:`ContextParallel`: the attention inside this module runs
                on a sequence sharded over its axis (:func:`context_parallel`).
      distributed_norm: a mesh axis: the norm statistics this module reduces over a dim
                sharded on that axis are all-reduced (:func:`distributed_norm`).
      heads:    the number of heads a projection's output is made of (its K/V heads); on an
                axis with more ranks than that, each head is held by the ``size // heads``
                consecutive ranks whose query heads use it (:func:`colwise`).
      style:    name of the preset that built the spec (for printing).

    Example::

        ModuleSpec(params={"weight": {"tp": Shard(0)}}, inputs={"tp": Replicate()},
                   out_src={"tp": Shard(-1)}, out_dst={"tp": Replicate()})
    """

    params: dict[str, LayoutLike] = field(default_factory=dict)
    inputs: Any = None
    in_src: Any = None
    out_src: Any = None
    out_dst: Any = None
    out_names: tuple[str, ...] | None = None
    local: bool = False
    compute: Callable | None = None
    optional_params: tuple[str, ...] = ()
    splits: tuple[int, ...] | None = None
    context_parallel: "ContextParallel | None" = None
    distributed_norm: str | None = None
    heads: int | None = None
    style: str | None = field(default=None, compare=False)  # a name for printing: a preset equals its spelled-out spec

    def __post_init__(self):
        self.params = dict(self.params or {})
        if self.splits is not None:
            self.splits = tuple(int(s) for s in self.splits)
        if self.out_names is not None:
            self.out_names = tuple(self.out_names)

    def declares_boundary(self) -> bool:
        return any(x is not None for x in (self.inputs, self.in_src, self.out_src, self.out_dst))

    def __repr__(self) -> str:
        parts = []
        if self.style:
            parts.append(f"style={self.style!r}")
        if self.params:
            parts.append("params={" + ", ".join(f"{k!r}: {fmt_entry_value(v)}" for k, v in self.params.items()) + "}")
        for name in ("inputs", "in_src", "out_src", "out_dst"):
            v = getattr(self, name)
            if v is not None:
                parts.append(f"{name}={fmt_entry_value(v)}")
        if self.out_names:
            parts.append(f"out_names={self.out_names}")
        if self.splits:
            parts.append(f"splits={list(self.splits)}")
        if self.context_parallel is not None:
            parts.append(f"context_parallel={self.context_parallel!r}")
        if self.distributed_norm is not None:
            parts.append(f"distributed_norm={self.distributed_norm!r}")
        if self.heads is not None:
            parts.append(f"heads={self.heads}")
        if self.local:
            parts.append("local=True")
        if self.compute is not None:
            parts.append(f"compute={getattr(self.compute, '__name__', self.compute)}")
        return "ModuleSpec(" + ", ".join(parts) + ")"


def fmt_entry_value(v) -> str:
    """A plan field as it reads in a message: a placement, a layout ``{axis: placement}``, or as is."""
    if isinstance(v, Placement):
        return repr(v)
    if isinstance(v, Mapping) and all(isinstance(p, Placement) for p in v.values()):
        return "{" + ", ".join(f"{a}: {p!r}" for a, p in v.items()) + "}"
    return repr(v)


# ----------------------------------------------------------------------------- presets


def colwise(axis: str = "tp", *, inputs: Placement = Replicate(), out: Placement = Shard(-1),
            splits: list[int] | None = None, heads: int | None = None) -> ModuleSpec:
    """Column-parallel ``nn.Linear``: weight and bias ``Shard(0)``, output ``Shard(-1)``.

    ``inputs`` is the layout the input arrives in (``Shard(1)`` under sequence
    parallelism: it is all-gathered on entry, the backward reduce-scatters); the linear
    itself needs a replicated input.  ``out`` is the layout on exit. On an
    ``nn.Embedding`` the weight is sharded on the embedding dim instead (``Shard(1)``).
    ``splits``: for a fused projection, the sizes of its parts (``[q, k, v]`` for a
    ``wqkv``, ``[ffn, ffn]`` for a ``w13``); each part is sharded separately and the
    ``split``/``chunk`` that follows in the graph is localized.
    ``heads``: the number of heads the output is made of, for K/V projections with fewer
    heads than the axis has ranks (2 KV heads at ``tp=4``): each rank then holds the KV
    head its query heads use, replicated over the ``tp // heads`` consecutive ranks that
    share it, and their gradients are summed over exactly those ranks (Megatron's and
    vLLM's layout).  The axis size must divide ``heads`` or be a multiple of it.

    Example: ``{"layers.*.attention.wq": colwise()}``,
    ``{"layers.*.attention.wqkv": colwise(splits=[512, 128, 128])}``,
    ``{"layers.*.self_attn.k_proj": colwise(heads=config.num_key_value_heads)}``
    """
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise PlanError(f"colwise(heads={heads!r}): heads is the number of heads of the projection, a positive int")
    if heads is not None and splits is not None:
        raise PlanError("colwise(splits=..., heads=...): heads of a fused projection are not supported; "
                        "plan its K and V projections apart, or leave the fused projection replicated")
    return ModuleSpec(
        params={"weight": {axis: Shard(0)}, "bias": {axis: Shard(0)}},
        inputs={axis: Replicate()},
        in_src={axis: inputs},
        out_src={axis: Shard(-1)},
        out_dst={axis: out},
        optional_params=("bias",),
        splits=splits,
        heads=heads,
        style="colwise",
    )


def rowwise(axis: str = "tp", *, inputs: Placement = Shard(-1), out: Placement = Replicate()) -> ModuleSpec:
    """Row-parallel ``nn.Linear``: weight ``Shard(1)``, bias replicated and added once
    after the reduction; the output is produced ``Partial`` and redistributed to ``out``
    (``Replicate()``: all-reduce; ``Shard(1)``: reduce-scatter for sequence parallel).

    ``inputs`` is the layout the input arrives in; a ``Replicate()`` input is chunked
    locally.  On an ``nn.Embedding`` this is the vocab-parallel embedding.

    Example: ``{"layers.*.feed_forward.w2": rowwise()}``
    """
    return ModuleSpec(
        params={"weight": {axis: Shard(1)}},
        inputs={axis: Shard(-1)},
        in_src={axis: inputs},
        out_src={axis: Partial()},
        out_dst={axis: out},
        style="rowwise",
    )


def sequence_parallel(axis: str = "tp", dim: int = 1) -> ModuleSpec:
    """A norm or other token-wise module run on a sequence-sharded input.

    Its input must be ``Shard(dim)`` on entry and it produces ``Shard(dim)``; its
    replicated weights get their gradient summed over ``axis`` by the grad-sync rule.

    Example: ``{"layers.*.attention_norm": sequence_parallel()}``
    """
    return ModuleSpec(inputs={axis: Shard(dim)}, out_src={axis: Shard(dim)}, style="sequence_parallel")


def distributed_norm(axis: str = "tp", dim: int = -1) -> ModuleSpec:
    """A norm over a dim that stays sharded on ``axis``: OLMo2's q/k norms over the whole
    projected width, right after a colwise ``q_proj``.

    The input must arrive ``Shard(dim)`` (a colwise output) and the output leaves
    ``Shard(dim)``; the weight and bias are ``Shard(0)``, each rank holding the part
    that scales its columns.  Every mean or sum this module takes over the sharded dim
    (``F.rms_norm``/``F.layer_norm`` are written out as means first) is all-reduced:
    one all-reduce of a ``[..., 1]`` tensor for an RMS norm, two (mean, variance) for
    a layer norm, and as many in backward; no activation is gathered.

    Example: ``{"model.layers.*.self_attn.q_proj": colwise(), "model.layers.*.self_attn.q_norm": distributed_norm()}``
    """
    return ModuleSpec(
        params={"weight": {axis: Shard(0)}, "bias": {axis: Shard(0)}},
        inputs={axis: Shard(dim)},
        in_src={axis: Shard(dim)},
        out_src={axis: Shard(dim)},
        optional_params=("weight", "bias"),
        distributed_norm=axis,
        style="distributed_norm",
    )


def vocab_parallel(axis: str = "tp", *, out: Placement = Replicate()) -> ModuleSpec:
    """Vocab-parallel ``nn.Embedding``: weight ``Shard(0)``; ids outside this rank's
    vocab range are masked and their rows zeroed, the output is ``Partial`` and then
    all-reduced (``out=Replicate()``) or reduce-scattered (``out=Shard(1)``).

    Example: ``{"tok_embeddings": vocab_parallel(out=Shard(1))}``
    """
    return ModuleSpec(
        params={"weight": {axis: Shard(0)}},
        inputs={axis: Replicate()},
        out_src={axis: Partial()},
        out_dst={axis: out},
        style="vocab_parallel",
    )


CP_METHODS = ("allgather", "ring")


@dataclass(frozen=True)
class ContextParallel:
    """Attention on a sequence sharded over ``axis`` (see :func:`context_parallel`).

    ``method``: ``"allgather"`` (K and V gathered, local queries attend to the whole
    sequence) or ``"ring"`` (K/V blocks passed around the ring, online-softmax merge).
    ``load_balance``: rank ``i`` holds chunks ``i`` and ``2n-1-i`` of the sequence (the
    causal work is then the same on every rank) instead of chunk ``i`` of ``n``.
    """

    axis: str = "cp"
    method: str = "allgather"
    load_balance: bool = True


def context_parallel(axis: str = "cp", *, method: str = "allgather", load_balance: bool = True) -> ModuleSpec:
    """Context parallelism for the attention inside a module (``"layers.*.attention"``).

    The plan shards the token inputs on the sequence dim over ``axis``
    (``inputs={"tokens": {"cp": Shard(1)}}``); every value derived from them stays
    sequence-sharded, and the ``scaled_dot_product_attention`` inside this module is
    replaced by one on the whole sequence: ``method="allgather"`` gathers K and V
    (backward: reduce-scatter of dK/dV) and masks with the rank's global positions;
    ``method="ring"`` passes K/V blocks around the ring and merges with an online
    softmax (blocks wholly above the causal diagonal are skipped).  Positions
    (``torch.arange``, rotary tables, learned position embeddings) read each rank's
    global positions, and a mean cross-entropy is the mean over all tokens.

    ``load_balance=True``: rank ``i`` holds chunks ``i`` and ``2n-1-i`` of ``2n``, so
    causal attention costs the same on every rank; pass inputs split with
    :func:`fxshard.split_sequence`.  ``False``: rank ``i`` holds the contiguous slice
    ``i*T/n : (i+1)*T/n``.

    Example::

        plan = fxshard.Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp")},
                            inputs={"tokens": {"cp": Shard(1)}})
        local_ids = fxshard.split_sequence(ids, "cp")     # after transform binds the mesh
    """
    if method not in CP_METHODS:
        raise PlanError(f"context_parallel(method={method!r}): use one of {list(CP_METHODS)}")
    return ModuleSpec(context_parallel=ContextParallel(axis, method, bool(load_balance)), style="context_parallel")


def for_module_type(spec: ModuleSpec, module_type: type | None) -> ModuleSpec:
    """Presets follow torch's styles: on an ``nn.Embedding`` colwise shards the
    embedding dim and rowwise is the vocab-parallel embedding.  On transformers'
    ``Conv1D`` (GPT-2's linear: weight ``[in, out]``, ``addmm(bias, x, weight)``) the
    weight's dims are swapped, so colwise shards weight dim 1 (and the bias) and rowwise
    weight dim 0; inputs and outputs stay as for ``nn.Linear``."""
    import torch.nn as nn

    if module_type is None:
        return spec
    if is_conv1d(module_type):
        return _for_conv1d(spec)
    if not issubclass(module_type, nn.Embedding):
        return spec
    if spec.style == "colwise":
        (axis,) = spec.params["weight"]
        return replace(spec, params={"weight": {axis: Shard(1)}}, optional_params=(), style="colwise")
    if spec.style == "rowwise":
        (axis,) = spec.params["weight"]
        return vocab_parallel(axis, out=spec.out_dst[axis])
    return spec


def is_conv1d(module_type: type) -> bool:
    """transformers.pytorch_utils.Conv1D (or a subclass), known by name so that fxshard
    never imports transformers; torch's ``nn.Conv1d`` is a convolution, not this."""
    return any(c.__name__ == "Conv1D" for c in getattr(module_type, "__mro__", ()))


def _for_conv1d(spec: ModuleSpec) -> ModuleSpec:
    if spec.style == "colwise":
        (axis,) = spec.params["weight"]
        return replace(spec, params={"weight": {axis: Shard(1)}, "bias": {axis: Shard(0)}})
    if spec.style == "rowwise":
        (axis,) = spec.params["weight"]
        return replace(spec, params={"weight": {axis: Shard(0)}})  # bias replicated, added after the reduction
    return spec


# ----------------------------------------------------------------------------- the plan


def pattern_regex(pattern: str) -> re.Pattern:
    """A module FQN pattern: shell-style per dotted name (``*``, ``?``, ``[qkv]``);
    wildcards never cross a ``.``."""
    parts = []
    for part in pattern.split("."):
        rx = fnmatch.translate(part)  # '(?s:...)\\Z'
        parts.append(rx[len("(?s:"):-len(")\\Z")].replace(".*", "[^.]*").replace("(?s:", "("))
    return re.compile("^" + r"\.".join(parts) + "$")


class PlanEntries(NamedTuple):
    """What an importer (``fxshard.plan.importers.hf_plan`` and its siblings) reads off a model or a
    foreign plan: the entries ``{fqn_pattern: ModuleSpec}`` and the input layouts, plain
    data that :class:`fxshard.Plan` is built from."""

    specs: dict
    inputs: Mapping | None = None
