"""Sharding plans as plain data: which module's tensors live where on the mesh.

Example::

    >>> from torch.distributed.tensor import Shard, Replicate
    >>> plan = Plan(MeshSpec(("tp",), (2,)), {
    ...     "layers.*.attention.wq": colwise(),
    ...     "layers.*.attention.wo": rowwise(),
    ... })
    >>> plan.specs["layers.*.attention.wq"].params
    {'weight': {'tp': Shard(dim=0)}, 'bias': {'tp': Shard(dim=0)}}
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .errors import PlanError
from .layout import complete, fmt_layout
from .mesh import Mesh, mesh_shape

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
            parts.append("params={" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in self.params.items()) + "}")
        for name in ("inputs", "in_src", "out_src", "out_dst"):
            v = getattr(self, name)
            if v is not None:
                parts.append(f"{name}={_fmt(v)}")
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


def _fmt(v) -> str:
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


def _for_module_type(spec: ModuleSpec, module_type: type | None) -> ModuleSpec:
    """Presets follow torch's styles: on an ``nn.Embedding`` colwise shards the
    embedding dim and rowwise is the vocab-parallel embedding.  On transformers'
    ``Conv1D`` (GPT-2's linear: weight ``[in, out]``, ``addmm(bias, x, weight)``) the
    weight's dims are swapped, so colwise shards weight dim 1 (and the bias) and rowwise
    weight dim 0; inputs and outputs stay as for ``nn.Linear``."""
    import torch.nn as nn

    if module_type is None:
        return spec
    if _is_conv1d(module_type):
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


def _is_conv1d(module_type: type) -> bool:
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


def _pattern_regex(pattern: str) -> re.Pattern:
    """A module FQN pattern: shell-style per dotted name (``*``, ``?``, ``[qkv]``);
    wildcards never cross a ``.``."""
    parts = []
    for part in pattern.split("."):
        rx = fnmatch.translate(part)  # '(?s:...)\\Z'
        parts.append(rx[len("(?s:"):-len(")\\Z")].replace(".*", "[^.]*").replace("(?s:", "("))
    return re.compile("^" + r"\.".join(parts) + "$")


class Plan:
    """A sharding plan: a mesh, ``{fqn_pattern: ModuleSpec}`` and the layouts of the
    graph inputs by placeholder name (default: all ``Replicate``).

    Example::

        plan = fxshard.Plan(mesh, {
            "layers.*.attention.wq": fxshard.colwise(),
            "layers.*.attention.wo": fxshard.rowwise(),
        }, inputs={"tokens": {"dp": Shard(0)}})

    ``fsdp="dp"`` gives that axis to FSDP2 (:func:`fxshard.fully_shard`): fxshard adds
    no gradient sync on it, its gradients follow FSDP2's convention (the mean over the
    axis of each rank's gradient, so a per-rank mean loss trains on the global mean),
    and the transformed module calls one submodule per transformer block.

    Validated on construction against the mesh (unknown axes, malformed layouts);
    patterns, parameter names and divisibility are checked against the model by
    ``fxshard.transform``.
    """

    def __init__(self, mesh: Mesh, specs: Mapping[str, ModuleSpec] | None = None, inputs: Mapping[str, LayoutLike] | None = None,
                 *, fsdp: str | None = None):
        self.mesh = mesh
        self.axes = mesh_shape(mesh)
        if fsdp is not None and fsdp not in self.axes:
            raise PlanError(f"Plan(fsdp={fsdp!r}): {fsdp!r} is not an axis of the mesh, whose axes are {list(self.axes)}; "
                            f"name the data-parallel axis that FSDP2 shards over")
        self.fsdp = fsdp
        self.specs: dict[str, ModuleSpec] = dict(specs or {})
        self.inputs: dict[str, dict] = {}
        for name, layout in (inputs or {}).items():
            self.inputs[name] = complete(layout, self.axes, f"Plan inputs[{name!r}]")
        for pattern, spec in self.specs.items():
            if not isinstance(spec, ModuleSpec):
                raise PlanError(
                    f"plan entry {pattern!r}: expected an fxshard.ModuleSpec (colwise(), rowwise(), ...), got "
                    f"{type(spec).__name__}; for torch.distributed.tensor.parallel styles use Plan.from_torch(mesh, plan)"
                )
            self._check_spec(pattern, spec)
        self._regex = {p: _pattern_regex(p) for p in self.specs}
        self.context_parallel_axes()  # one load_balance per axis

    def context_parallel_axes(self) -> dict[str, ContextParallel]:
        """``{axis: ContextParallel}`` of the axes the plan's attention is context-parallel
        on.  Every entry of one axis must agree on ``load_balance`` (it fixes which
        positions each rank holds, for the whole sequence)."""
        out: dict[str, ContextParallel] = {}
        for pattern, spec in self.specs.items():
            cp = spec.context_parallel
            if cp is None:
                continue
            if cp.axis in out and out[cp.axis].load_balance != cp.load_balance:
                raise PlanError(f"plan entry {pattern!r}: context_parallel(load_balance={cp.load_balance}) on {cp.axis!r}, but "
                                f"another entry says load_balance={out[cp.axis].load_balance}; the sequence has one layout per "
                                f"axis: give every context_parallel entry of {cp.axis!r} the same load_balance")
            out.setdefault(cp.axis, cp)
        return out

    def _check_spec(self, pattern: str, spec: ModuleSpec) -> None:
        if spec.distributed_norm is not None and spec.distributed_norm not in self.axes:
            raise PlanError(f"plan entry {pattern!r}: distributed_norm axis {spec.distributed_norm!r} is not an axis of the mesh, "
                            f"whose axes are {list(self.axes)}; name the axis the normalized dim is sharded on")
        cp = spec.context_parallel
        if cp is not None:
            if cp.axis not in self.axes:
                raise PlanError(f"plan entry {pattern!r}: context_parallel axis {cp.axis!r} is not an axis of the mesh, whose axes "
                                f"are {list(self.axes)}; name the axis the sequence is sharded on")
            if cp.method not in CP_METHODS:
                raise PlanError(f"plan entry {pattern!r}: context_parallel method {cp.method!r}; use one of {list(CP_METHODS)}")
            if cp.axis == self.fsdp:
                raise PlanError(f"plan entry {pattern!r}: axis {cp.axis!r} is given to FSDP2 (fsdp=) and to context parallelism; "
                                f"use one axis for the batch (FSDP2) and another for the sequence")
        for name, layout in spec.params.items():
            complete(layout, self.axes, f"plan entry {pattern!r} params[{name!r}]")
        for field_name in ("inputs", "in_src", "out_src", "out_dst"):
            v = getattr(spec, field_name)
            if v is None:
                continue
            if isinstance(v, Mapping) and any(k in self.axes for k in v) and not _is_layout(v, self.axes):
                raise PlanError(f"plan entry {pattern!r} {field_name}={_fmt(v)} mixes mesh axes and argument/output names; "
                                f"write one layout {{axis: Placement}}, or layouts by name {{name: {{axis: Placement}}}}")
            items = v.items() if isinstance(v, Mapping) and not _is_layout(v, self.axes) else (
                enumerate(v) if isinstance(v, (tuple, list)) else [(None, v)])
            for key, layout in items:
                if layout is not None:
                    where = f"plan entry {pattern!r} {field_name}" + (f"[{key!r}]" if key is not None else "")
                    complete(layout, self.axes, where)

    # -- matching ---------------------------------------------------------------------
    def match(self, fqn: str) -> tuple[str, ModuleSpec] | None:
        """The (pattern, spec) that applies to module ``fqn``; PlanError if two differ."""
        hits = [(p, s) for p, s in self.specs.items() if self._regex[p].match(fqn)]
        if len(hits) > 1 and any(s != hits[0][1] for _, s in hits[1:]):
            raise PlanError(
                f"module {fqn!r} is matched by several plan entries with different specs: "
                f"{[p for p, _ in hits]}; make the patterns disjoint"
            )
        return hits[0] if hits else None

    def check_patterns(self, fqns: list[str]) -> None:
        """Every pattern must match at least one module; suggest the closest FQN."""
        for pattern, rx in self._regex.items():
            if not any(rx.match(f) for f in fqns):
                close = difflib.get_close_matches(pattern.replace("*", "0"), fqns, n=3, cutoff=0.3)
                hint = f"; closest module FQNs: {close}" if close else ""
                raise PlanError(f"plan entry {pattern!r} matches no module of the model{hint}. Fix the pattern (FQNs use '.' and '*' matches one name)")

    # -- data-like behaviour -------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return (isinstance(other, Plan) and self.axes == other.axes and self.specs == other.specs and self.inputs == other.inputs
                and self.fsdp == other.fsdp)

    def replace(self, *, specs: Mapping[str, ModuleSpec] | None = None, inputs: Mapping[str, LayoutLike] | None = None,
                fsdp: str | None = None) -> "Plan":
        """A copy with the given fields replaced (the others kept).

        Example: ``Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)}}, fsdp="dp")``
        """
        return type(self)(self.mesh, self.specs if specs is None else specs, self.inputs if inputs is None else inputs,
                          fsdp=self.fsdp if fsdp is None else fsdp)

    def __repr__(self) -> str:
        mesh = ", ".join(f"{a}={n}" for a, n in self.axes.items())
        lines = [f"Plan(mesh({mesh}), {{"]
        lines += [f"    {p!r}: {s!r}," for p, s in self.specs.items()]
        lines.append("}" + (f", inputs={{{', '.join(f'{k!r}: {fmt_layout(v)}' for k, v in self.inputs.items())}}}" if self.inputs else "")
                     + (f", fsdp={self.fsdp!r}" if self.fsdp else "") + ")")
        return "\n".join(lines)

    # -- conversion from transformers' plans ------------------------------------------------
    @classmethod
    def from_hf(cls, mesh: Mesh, model, *, axis: str = "tp", ep_axis: str = "ep", sequence_parallel: bool = False,
                loss_parallel: bool = False) -> "Plan":
        """The parallel plans a transformers model ships, as an fxshard Plan.

        Reads ``config.base_model_tp_plan`` and the head's ``_tp_plan`` (HF's style
        strings, ``"colwise"``, ``"rowwise"``, ...; see :mod:`fxshard.frontend.hf_plan`
        for the mapping) when the mesh has ``axis``, and ``config.base_model_ep_plan``
        (the routed experts split over the experts) when it has ``ep_axis``; entries for
        modules this model lacks are dropped, a tied LM head and embedding get one
        layout.  GPT-2, for which HF ships no plan, gets fxshard's.
        ``sequence_parallel``: Megatron-style sequence-sharded residual stream;
        ``loss_parallel``: vocab-sharded logits.  Unknown styles raise ``PlanError``.

        Example::

            model = transformers.LlamaForCausalLM(config)
            plan = fxshard.Plan.from_hf(mesh, model, sequence_parallel=True)
            print(plan)   # 'model.layers.*.self_attn.q_proj': ModuleSpec(style='colwise', ...)
            plan = fxshard.Plan.from_hf(ep_tp_mesh, mixtral)   # experts: routed_experts(ep='ep', tp='tp')
        """
        from .frontend.hf_plan import plan_from_hf  # duck-typed on the model: transformers is never imported

        plan = plan_from_hf(mesh, model, axis=axis, ep_axis=ep_axis, sequence_parallel=sequence_parallel,
                            loss_parallel=loss_parallel)
        return plan if cls is Plan else cls(plan.mesh, plan.specs, inputs=plan.inputs, fsdp=plan.fsdp)

    # -- conversion from torch.distributed.tensor.parallel ---------------------------------
    @classmethod
    def from_torch(cls, mesh: Mesh, parallelize_plan: Mapping[str, Any], *, axis: str | None = None, inputs=None) -> "Plan":
        """Convert a ``parallelize_module`` plan (style *instances*) into an fxshard Plan.

        Every field of every style is translated or refused with a PlanError that names
        the entry and the fix (see :mod:`fxshard.frontend.torch_plan` for the table):
        ``ColwiseParallel``/``RowwiseParallel`` keep their ``input_layouts`` and
        ``output_layouts``; ``SequenceParallel`` becomes :func:`sequence_parallel`;
        ``PrepareModuleInput``/``PrepareModuleOutput``/``PrepareModuleInputOutput``
        redistribute inputs (by position, by keyword or both) and outputs; torchtitan's
        ``NoParallel`` replicates.  ``use_local_output`` may take either value.  A
        subclass is read as its base only if it changes no behaviour; otherwise the
        error names it and what it overrides or adds.  An ``fxshard.ModuleSpec`` among
        the styles is taken as it is.

        Example::

            Plan.from_torch(mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        """
        from .frontend.torch_plan import plan_from_torch

        plan = plan_from_torch(mesh, parallelize_plan, axis=axis, inputs=inputs)
        return plan if cls is Plan else cls(plan.mesh, plan.specs, inputs=plan.inputs, fsdp=plan.fsdp)

    @classmethod
    def from_torchtitan(cls, mesh: Mesh, model, **kw) -> "Plan":
        """torchtitan's own tensor/sequence-parallel plan for ``model`` (a torchtitan
        decoder such as ``Llama3Model``, built from its config), converted.

        Keywords (see :func:`fxshard.frontend.torchtitan_plan.plan_from_torchtitan`):
        ``axis="tp"``, ``loss_parallel=False``, ``sequence_parallel=True``, ``inputs``.

        Example::

            plan = Plan.from_torchtitan(MeshSpec(("tp",), (2,)), model, loss_parallel=True)
            plan.specs["lm_head"].out_dst        # {'tp': Shard(dim=-1)}
        """
        from .frontend.torchtitan_plan import plan_from_torchtitan  # torchtitan is optional: import it on use

        plan = plan_from_torchtitan(mesh, model, **kw)
        return plan if cls is Plan else cls(plan.mesh, plan.specs, inputs=plan.inputs, fsdp=plan.fsdp)


def _is_layout(v, axes: Mapping[str, int]) -> bool:
    """Is ``v`` one layout (``{axis: Placement}``) rather than layouts by argument or
    output name?  ``{"input": Replicate()}`` on a ``("tp",)`` mesh is by name: its key
    is not a mesh axis."""
    return isinstance(v, Mapping) and all(isinstance(p, Placement) for p in v.values()) and all(k in axes for k in v)
