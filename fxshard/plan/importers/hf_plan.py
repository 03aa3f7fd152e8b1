"""Import the tensor-parallel plan a transformers model ships as an fxshard :class:`~fxshard.Plan`.

HF writes its plans as data: ``config.base_model_tp_plan`` (keys relative to the base
model, ``"layers.*.self_attn.q_proj": "colwise"``) and the head's ``_tp_plan``
(``{"lm_head": "colwise_gather_output"}``); ``PreTrainedModel.post_init`` merges them
into ``model.tp_plan`` with absolute keys, plus ``embed_tokens: embedding_rowwise``
when the base model has an ``embed_tokens`` embedding the plan does not name.  Each
style string names one of ``transformers.distributed.tensor_parallel``'s styles
(``ALL_PARALLEL_STYLES``).  They map by what the style *does* (its parameter
placements and its forward hooks), not by its name:

==================================  ==================================================
HF style                            fxshard spec
==================================  ==================================================
``colwise``                         ``colwise(axis)``
``colwise_gather_output``,          ``colwise(axis, out=Replicate())``
``colwise_rep``
``rowwise``                         ``rowwise(axis)``
``rowwise_split_input``,            ``rowwise(axis, inputs=Replicate())``
``rowwise_rep``
``packed_colwise`` (2-D weight)     ``colwise(axis, splits=[half, half])`` (gate | up on
                                    dim 0, each half sharded: HF's ``_StridedShard``)
``embedding_rowwise``               ``vocab_parallel(axis)``
``embedding_colwise``               colwise on an ``nn.Embedding``: weight ``Shard(1)``,
                                    output gathered (``out=Replicate()``, as HF does)
``sequence_parallel``               ``sequence_parallel(axis)``
``all_reduce``                      ``ModuleSpec(out_src=Partial(), out_dst=Replicate())``
``replicated_with_grad_allreduce``  ``ModuleSpec()``: fxshard's grad-sync rule sums the
                                    gradients of replicated params used on sharded values
``local_params``, ``replicate``     ``ModuleSpec()``: fxshard always runs on local shards
``mla_kv_a_proj``                   ``ModuleSpec()``: the module is replicated; HF's
                                    all-reduce of the rope part's gradient is what layout
                                    propagation derives (a replicated value used with
                                    head-sharded ones; today's rules refuse that mix at
                                    MLA's ``cat``/``copy_`` with a PlanError)
``moe_tp_experts`` (tp plan)        ``routed_experts(tp=axis, tp_dims=...)``: each expert
                                    sharded like a SwiGLU MLP; its weights' entries
                                    (``packed_colwise`` / ``rowwise`` / ``packed_rowwise``
                                    / ``colwise`` on 3-D ``[E, out, in]`` weights) give
                                    the dims: colwise cuts dim 1, rowwise dim 2, packed
                                    ones part by part
``ep_dispatch_experts`` (ep plan),  ``routed_experts(ep=ep_axis)``: the experts split
``grouped_gemm`` on its weights     over ``ep`` (weights ``Shard(0)``); with both plans
                                    on the mesh, ``routed_experts(ep=..., tp=...)``
``moe_identity_expert``, ``ep_*``   ``PlanError``
other MoE styles, a style on a
3-D param outside an experts entry
==================================  ==================================================

The expert-parallel plan (``model.ep_plan``: ``config.base_model_ep_plan`` under the
base model's prefix) is read when the mesh has the axis ``ep_axis``; the tensor-parallel
plan when it has ``axis``.  On an ``("ep",)`` mesh only the experts are sharded; on
``("ep", "tp")`` both.  Tokens stay replicated over ``ep`` (HF's EP does the same): every
rank routes every token, its experts compute their share, and one all-reduce per MoE
layer sums the shares (see :mod:`fxshard.routed_experts`).

A key may also name a *parameter* (``"layers.*.self_attn.sinks": "colwise"``): HF then
applies only the style's parameter placement (``Shard(ndim - 2)`` for colwise,
``Shard(-1)`` for rowwise); it becomes ``params={"sinks": ...}`` of the owning module.

What the importer adds to HF's plan:

- Entries that match no module of this model are dropped (HF plans list modules that
  some configs lack; an fxshard pattern that matches nothing is an error).
- A tied LM head and input embedding (one tensor) get one layout: the side HF shards
  decides, the other side gets the matching spec (``lm_head`` colwise, weight
  ``Shard(0)`` <-> a vocab-parallel embedding).
- ``sequence_parallel=True`` (Megatron-style, beyond HF's plans): the residual stream
  is ``Shard(1)``.  The token embedding leaves ``Shard(1)`` (a reduce-scatter when it
  is vocab-parallel, a local slice when replicated); other embeddings that are direct
  children of the base model (GPT-2's learned positions ``wpe``, ``[1, S, D]``) are
  sliced on the sequence the same way, so that the add of tokens and positions sees
  two ``Shard(1)`` values (no communication); the norms that are direct children of
  a decoder layer and the base model's norms get :func:`~fxshard.sequence_parallel`
  (per-head norms inside attention, Qwen3's ``q_norm``, are not on the residual
  stream and keep their spec); colwise projections in the layers take a ``Shard(1)``
  input (one all-gather per value: q/k/v share it), rowwise ones reduce-scatter to
  ``Shard(1)``; the LM head gathers its input, or, with no planned head, the final
  norm gathers its output.  A child of the decoder layers that holds routed experts (a
  module whose class ends in ``Experts``: Mixtral's and Qwen3-MoE's MoE blocks flatten
  batch and sequence to route tokens) takes whole sequences: its input is all-gathered
  on entry, its output sliced back to ``Shard(1)``, and the entries inside it stay plain TP.
- ``loss_parallel=True``: the LM head keeps its logits vocab-sharded (``Shard(-1)``).
- GPT-2 (``model_type "gpt2"``), for which HF ships no plan, gets fxshard's
  (:data:`FXSHARD_PLANS`).

transformers is never imported: the model is read by duck typing (``config``,
``base_model_prefix``, ``tp_plan``/``_tp_plan``, ``get_input_embeddings``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxshard.errors import PlanError
from fxshard.plan.mesh import Mesh, mesh_shape
from fxshard.runtime.routed_experts import HF_TP_DIMS, RoutedExpertsSpec, routed_experts, sharding_error
from fxshard.plan.specs import PlanEntries, ModuleSpec, for_module_type, is_conv1d, pattern_regex, colwise, rowwise, sequence_parallel as seq_norm, vocab_parallel

# HF's style names, by family (transformers 5.23 registers these in ALL_PARALLEL_STYLES)
COLWISE = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep")
EMBEDDING = ("embedding_rowwise", "embedding_colwise")
UNSHARDED = ("replicated_with_grad_allreduce", "local_params", "replicate", "mla_kv_a_proj")
OTHER = ("sequence_parallel", "all_reduce")
MOE = ("moe_tp_experts", "moe_identity_expert", "packed_rowwise", "grouped_gemm", "ep_dispatch_experts")
EXPERTS_STYLES = ("moe_tp_experts", "ep_dispatch_experts")  # a routed-experts module (fxshard.routed_experts)
KNOWN_STYLES = COLWISE + ROWWISE + EMBEDDING + OTHER + UNSHARDED + MOE

# fxshard's plans for families HF ships none for: {model_type: (base model plan, head plan)}
# in HF's vocabulary; ("packed_colwise", n): a weight fused of n equal parts (GPT-2's q | k | v).
FXSHARD_PLANS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "gpt2": (
        {
            "wte": "embedding_rowwise",  # as HF does for embed_tokens; the tied lm_head needs it anyway
            "h.*.attn.c_attn": ("packed_colwise", 3),
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        {"lm_head": "colwise_gather_output"},
    ),
}


def specs_from_hf(mesh: Mesh, model: nn.Module, *, axis: str = "tp", ep_axis: str = "ep", sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> PlanEntries:
    """The parallel plans of transformers model ``model`` as an fxshard Plan on
    ``mesh``: HF's tensor-parallel plan on the mesh axis ``axis`` and its expert-parallel
    plan on ``ep_axis``, each where the mesh has that axis (module docstring: the mapping).

    Example::

        model = transformers.LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, ...))
        plan = specs_from_hf(fxshard.MeshSpec(("tp",), (2,)), model)
        plan.specs["model.layers.*.self_attn.q_proj"]   # ModuleSpec(style='colwise', ...)
        plan.specs["lm_head"].out_dst                   # {'tp': Replicate()}

        moe = transformers.MixtralForCausalLM(MixtralConfig(...))
        specs_from_hf(fxshard.MeshSpec(("ep", "tp"), (2, 2)), moe).specs["model.layers.*.mlp.experts"]
        # routed_experts(ep='ep', tp='tp', ...)
    """
    axes = mesh_shape(mesh)
    if axis not in axes and ep_axis not in axes:
        raise PlanError(f"Plan.from_hf: neither axis {axis!r} (HF's tp plan) nor {ep_axis!r} (its ep plan) is on the mesh "
                        f"{dict(axes)}; pass axis= / ep_axis= the mesh axes that play them")
    if (sequence_parallel or loss_parallel) and axis not in axes:
        raise PlanError(f"Plan.from_hf(sequence_parallel=/loss_parallel=True) shard on the tensor axis {axis!r}, which is "
                        f"not on the mesh {dict(axes)}; pass axis= the mesh axis for HF's tp")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    specs: dict[str, ModuleSpec] = {}
    if axis in axes:
        specs = _convert(hf_tp_plan(model), modules, params, axis)
        specs = _replicated_kv_heads(specs, model, modules, axes[axis])
        specs = _tie_embeddings(specs, model, modules, axis)
        if sequence_parallel:
            specs = _sequence_parallel(specs, model, modules, axis)
        if loss_parallel:
            specs = _loss_parallel(specs, model, modules, axis)
    if ep_axis in axes:
        ep_plan = hf_ep_plan(model)
        if not ep_plan:
            raise PlanError(f"Plan.from_hf: the mesh has the expert axis {ep_axis!r}, but {type(model).__name__} ships no "
                            f"expert-parallel plan (config.base_model_ep_plan is empty); use a mesh without {ep_axis!r}, "
                            f"or write the experts' entry: fxshard.routed_experts(ep={ep_axis!r})")
        specs = _merge_experts(specs, _convert(ep_plan, modules, params, ep_axis, experts_axis="ep"))
    return PlanEntries(_in_module_order(specs, list(modules)))


def _replicated_kv_heads(specs: dict[str, ModuleSpec], model: nn.Module, modules: dict, size: int) -> dict[str, ModuleSpec]:
    """HF's plans cut the K/V projections colwise like the queries; on an axis with more
    ranks than ``config.num_key_value_heads`` their heads cannot be cut, so each rank holds
    the KV head its query heads use: ``colwise(heads=num_key_value_heads)`` on the colwise
    linears of an attention module (its class is a ``...Attention``) whose width is the KV heads'.

    On a config whose attributes vary per layer (``per_layer_config``: Gemma 4's global
    layers with fewer KV heads, Dots-3's sliding layers) each projection reads its own
    layer's values; where layers differ the pattern is split into one entry per module."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        return specs
    layer_of = _layer_indexer(config, modules)
    out = dict(specs)
    for pattern, spec in specs.items():
        if not isinstance(spec, ModuleSpec) or spec.style != "colwise" or spec.splits:
            continue
        rx = pattern_regex(pattern)
        hits = [(fqn, m) for fqn, m in modules.items() if rx.match(fqn)]
        if not hits:
            continue
        heads = {fqn: _kv_heads(config, layer_of(fqn), fqn, m, modules, size, pattern) for fqn, m in hits}
        if all(h is None for h in heads.values()):
            continue
        if len(set(heads.values())) == 1:
            out[pattern] = replace(spec, heads=heads[hits[0][0]])  # a K/V projection of an attention module
            continue
        del out[pattern]  # layers differ: one entry per module, each with its layer's heads
        for fqn, h in heads.items():
            out[fqn] = spec if h is None else replace(spec, heads=h)
    return out


def _kv_heads(config, layer: int | None, fqn: str, module: nn.Module, modules: dict, size: int, pattern: str) -> int | None:
    """``heads=`` for the colwise linear ``fqn`` (None: its heads can be cut, or it is no
    K/V projection of an attention module)."""
    if not isinstance(module, nn.Linear) or "Attention" not in type(modules.get(fqn.rpartition(".")[0])).__name__:
        return None
    value = lambda name: _config_value(config, name, layer, fqn, pattern)
    n_kv, n_heads = value("num_key_value_heads"), value("num_attention_heads")
    if not isinstance(n_kv, int) or not isinstance(n_heads, int) or not 0 < n_kv < n_heads or size <= n_kv:
        return None
    head_dim = value("head_dim") or (value("hidden_size") or 0) // n_heads
    return n_kv if module.out_features == n_kv * head_dim else None


def _layer_indexer(config, modules: dict):
    """``fqn -> index of its decoder layer`` (None outside one): the layers are the items
    of the module lists with ``config.num_hidden_layers`` items."""
    n_layers = _config_value(config, "num_hidden_layers", None, "", "")
    lists = [name for name, m in modules.items() if isinstance(m, nn.ModuleList) and isinstance(n_layers, int) and len(m) == n_layers]

    def layer_of(fqn: str) -> int | None:
        for name in lists:
            prefix = f"{name}." if name else ""
            head = fqn[len(prefix):].split(".", 1)[0] if fqn.startswith(prefix) else ""
            if head.isdigit():
                return int(head)
        return None

    return layer_of


def _config_value(config, name: str, layer: int | None, fqn: str, pattern: str):
    """``config.<name>``, read from the layer's own config (``config.per_layer_config[layer]``)
    on a config whose attributes vary per layer; None when the config lacks it."""
    if layer is not None and getattr(config, "is_heterogeneous", False):
        return getattr(config.per_layer_config[layer], name, None)
    try:
        return getattr(config, name, None)
    except RuntimeError as e:  # transformers' AmbiguousGlobalPerLayerAttributeError: no layer to read it from
        if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        raise PlanError(f"Plan.from_hf: config.{name} varies per layer (config.per_layer_config) and module {fqn!r} "
                        f"(plan entry {pattern!r}) is not inside a decoder layer fxshard can find (an item of a module "
                        f"list of config.num_hidden_layers items), so there is no layer to read it from; write that "
                        f"entry yourself, e.g. plan.replace(specs={{**plan.specs, {fqn!r}: fxshard.colwise(heads=...)}}) "
                        f"with the heads of that module's layer") from None


def hf_ep_plan(model: nn.Module) -> dict[str, Any]:
    """HF's expert-parallel plan for ``model``: ``{absolute FQN pattern: style}``
    (``model.ep_plan`` when HF resolved it, else ``config.base_model_ep_plan`` under
    the base model's prefix).

    Example::

        hf_ep_plan(MixtralForCausalLM(config))["model.layers.*.mlp.experts"]   # 'ep_dispatch_experts'
    """
    resolved = getattr(model, "ep_plan", None)
    if isinstance(resolved, Mapping) and resolved:
        return dict(resolved)
    base_plan = dict(getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {})
    _, prefix = _base_model(model)
    return {prefix + k: v for k, v in base_plan.items()}


def _merge_experts(specs: dict[str, ModuleSpec], ep_specs: dict[str, ModuleSpec]) -> dict[str, ModuleSpec]:
    """The tp plan's entries with the ep plan's: routed experts named by both are split
    over ``ep`` and sharded on ``tp``; any other entry named by both is an error."""
    out = dict(specs)
    for pattern, spec in ep_specs.items():
        old = out.get(pattern)
        if old is None:
            out[pattern] = spec
        elif isinstance(old, RoutedExpertsSpec) and isinstance(spec, RoutedExpertsSpec):
            out[pattern] = routed_experts(ep=spec.ep, tp=old.tp, tp_dims=old.tp_dims)
        else:
            raise PlanError(f"Plan.from_hf: {pattern!r} is {old.style} in HF's tp plan and {spec.style} in its ep plan; "
                            f"fxshard can combine the two only on routed experts. Write this entry by hand")
    return out


# ----------------------------------------------------------------------------- HF's plan


def hf_tp_plan(model: nn.Module) -> dict[str, Any]:
    """HF's TP plan for ``model``: ``{absolute FQN pattern: style}``.

    ``model.tp_plan`` when HF resolved it (``post_init``: head plan, base plan under
    ``base_model_prefix``, default vocab-parallel ``embed_tokens``; a user's override
    too); else the same merge done here from ``config.base_model_tp_plan`` and
    ``_tp_plan``; else fxshard's own plan for the family (:data:`FXSHARD_PLANS`).

    Example::

        hf_tp_plan(LlamaForCausalLM(config))["model.layers.*.self_attn.o_proj"]   # 'rowwise'
    """
    resolved = getattr(model, "tp_plan", None)
    if isinstance(resolved, Mapping) and resolved:
        return dict(resolved)
    config = getattr(model, "config", None)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    head_plan = dict(getattr(model, "_tp_plan", None) or {})
    if not base_plan and not head_plan:
        base_plan, head_plan = _fxshard_plan(model)
    base, prefix = _base_model(model)
    if base_plan and "embed_tokens" not in base_plan and isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}  # HF's default (DistributedMixin.init_parallel_plans)
    return {**head_plan, **{prefix + k: v for k, v in base_plan.items()}}


def _fxshard_plan(model) -> tuple[dict, dict]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FXSHARD_PLANS:
        raise PlanError(
            f"Plan.from_hf: {type(model).__name__} (model_type {model_type!r}) ships no tensor-parallel plan "
            f"(config.base_model_tp_plan and _tp_plan are empty) and fxshard has none for it (it has one for "
            f"{sorted(FXSHARD_PLANS)}); write the plan: fxshard.Plan(mesh, {{'<fqn pattern>': fxshard.colwise(), ...}})")
    base_plan, head_plan = FXSHARD_PLANS[model_type]
    return dict(base_plan), dict(head_plan)


def _base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model and the prefix of its FQNs: ``model.model`` and ``"model."`` for
    LlamaForCausalLM (``base_model_prefix``), ``model`` and ``""`` for LlamaModel."""
    name = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, name, None) if name else None
    if isinstance(base, nn.Module) and base is not model:
        return base, name + "."
    return model, ""


# ----------------------------------------------------------------------------- styles


def style_spec(style: str, axis: str = "tp", *, module: nn.Module | None = None, pattern: str = "<pattern>",
               parts: int = 2) -> ModuleSpec:
    """The fxshard spec of HF's parallel style ``style`` on one module.

    ``module`` (one module the entry matches) adapts the spec to its type
    (``nn.Embedding``, transformers' ``Conv1D``), sizes the parts of a packed weight
    (``parts`` of them; HF packs 2, gate | up) and tells MoE expert weights (3-D) from
    linears; without it an ``nn.Linear`` is assumed.  MoE styles and unknown styles
    raise ``PlanError``.  The spec's ``style`` is HF's name.

    Example::

        >>> style_spec("colwise_gather_output").out_dst
        {'tp': Replicate()}
    """
    _check_known(style, pattern)
    if _is_moe_style(style):
        raise _moe_error(pattern, style)
    if module is not None and style in COLWISE + ROWWISE:
        _check_linear_like(module, style, pattern)
    spec = _build(style, axis, module, parts, f"HF plan entry {pattern!r} (style {style!r})")
    if module is not None:
        spec = for_module_type(spec, type(module))
    return replace(spec, style=style)


def _build(style: str, axis: str, module, parts: int, where: str) -> ModuleSpec:
    if style == "colwise":
        return colwise(axis)
    if style in ("colwise_gather_output", "colwise_rep"):
        return colwise(axis, out=Replicate())
    if style == "rowwise":
        return rowwise(axis)
    if style in ("rowwise_split_input", "rowwise_rep"):  # two names for one style in HF
        return rowwise(axis, inputs=Replicate())
    if style == "packed_colwise":
        return colwise(axis, splits=_packed_splits(module, parts, where))
    if style == "embedding_rowwise":
        return vocab_parallel(axis)
    if style == "embedding_colwise":
        # HF's EmbeddingParallel gathers the output of either sharding (torch's ColwiseParallel keeps Shard(-1))
        return for_module_type(colwise(axis, out=Replicate()), nn.Embedding)
    if style == "sequence_parallel":
        return seq_norm(axis)
    if style == "all_reduce":  # HF: the module's output is partial, all-reduce it
        return ModuleSpec(out_src={axis: Partial()}, out_dst={axis: Replicate()})
    return ModuleSpec()  # UNSHARDED: the layouts fxshard derives already do what HF's hooks patch in


def _packed_splits(module, parts: int, where: str) -> list[int]:
    """The part sizes of a weight packed along its output features (dim 0 of a Linear,
    dim 1 of a Conv1D)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.ndim != 2:
        raise PlanError(f"{where}: packed_colwise needs the module's 2-D weight to size its {parts} parts; "
                        f"got {type(module).__name__ if module is not None else 'no module'}")
    width = weight.shape[1] if is_conv1d(type(module)) else weight.shape[0]  # Conv1D: [in, out]
    if width % parts:
        raise PlanError(f"{where}: the packed weight's {width} output features are not {parts} equal parts")
    return [width // parts] * parts


def _check_linear_like(module: nn.Module, style: str, pattern: str) -> None:
    """colwise/rowwise shard 2-D weights; a module with 3-D weights holds MoE experts."""
    big = [n for n, p in module.named_parameters(recurse=False) if p.ndim >= 3]
    if big and not isinstance(module, nn.modules.conv._ConvNd):
        raise _moe_error(pattern, style, f"module {type(module).__name__} has expert weights {big} (3-D)")
    if big:
        raise PlanError(f"HF plan entry {pattern!r} (style {style!r}): {type(module).__name__} is a convolution; "
                        f"{style} shards linear layers. Write an fxshard.ModuleSpec for it by hand")


def _check_known(style, pattern: str) -> None:
    if not isinstance(style, str) or not (style in KNOWN_STYLES or _is_moe_style(style)):
        raise PlanError(f"HF plan entry {pattern!r}: unknown HF parallel style {style!r}; the known ones are "
                        f"{list(KNOWN_STYLES)}. Write an fxshard.ModuleSpec for {pattern!r} by hand")


def _is_moe_style(style: str) -> bool:
    return style in MOE or style.startswith(("ep_", "moe_"))


def _moe_error(pattern: str, style: str, why: str = "") -> PlanError:
    return PlanError(
        f"HF plan entry {pattern!r} (style {style!r}){': ' + why if why else ''}: fxshard imports MoE styles only as "
        f"routed experts (an experts module with moe_tp_experts / ep_dispatch_experts and its weights' entries); write "
        f"this entry by hand, e.g. fxshard.routed_experts(ep='ep') on the experts module")


def param_layout(style: str, param, name: str, pattern: str = "<pattern>") -> Placement:
    """The placement HF's ``style`` gives a parameter named directly by a plan key
    (only the style's ``shard_param`` runs there, no forward hook).

    Example: ``param_layout("colwise", sinks, "sinks", "layers.*.self_attn.sinks")`` is
    ``Shard(0)`` (HF: ``Shard(ndim - 2)``, dim 0 of a 1-D ``[heads]`` vector).
    """
    _check_known(style, pattern)
    if _is_moe_style(style) or param.ndim >= 3:
        raise _moe_error(pattern, style, f"parameter {name!r} is {param.ndim}-D" if param.ndim >= 3 else "")
    if style == "packed_colwise":
        raise PlanError(f"HF plan entry {pattern!r} (style {style!r}) names parameter {name!r}: a packed parameter "
                        f"on its own has no fxshard equivalent; give its module the entry")
    if style in COLWISE:
        return Shard(max(param.ndim - 2, 0))
    if style in ROWWISE:
        return Replicate() if name == "bias" else Shard(param.ndim - 1)
    if style == "embedding_rowwise":
        return Shard(0)
    if style == "embedding_colwise":
        return Shard(1)
    return Replicate()  # the other styles' shard_param is HF's no-op


# ----------------------------------------------------------------------------- conversion


def _convert(entries: Mapping[str, Any], modules: dict[str, nn.Module], params: dict, axis: str,
             experts_axis: str = "tp") -> dict[str, ModuleSpec]:
    """One spec per HF entry that matches modules of this model; entries naming
    parameters go into their module's ``params``; entries matching nothing are dropped.
    Routed experts (``moe_tp_experts`` / ``ep_dispatch_experts``) take their weights'
    entries along; ``experts_axis`` says which of their axes ``axis`` plays."""
    specs: dict[str, ModuleSpec] = {}
    param_entries: dict[str, dict[str, tuple[str, Placement]]] = {}
    entries = dict(entries)
    for pattern in [p for p, e in entries.items() if e in EXPERTS_STYLES]:
        weights = {p[len(pattern) + 1:]: entries.pop(p) for p in list(entries)
                   if p.startswith(pattern + ".") and "." not in p[len(pattern) + 1:]}
        rx = pattern_regex(pattern)
        hits = [m for fqn, m in modules.items() if rx.match(fqn)]
        if hits:
            specs[pattern] = _routed_experts(pattern, entries.pop(pattern), weights, hits, axis, experts_axis)
        else:
            entries.pop(pattern)
    for pattern, entry in entries.items():
        style, parts = (entry, 2) if isinstance(entry, str) else entry
        _check_known(style, pattern)  # also for entries this model has no module for: a typo is an error
        rx = pattern_regex(pattern)
        hits = [m for fqn, m in modules.items() if rx.match(fqn)]
        if hits:
            specs[pattern] = _one_spec(pattern, [style_spec(style, axis, module=m, pattern=pattern, parts=parts) for m in hits])
            continue
        owned = [(fqn, p) for fqn, p in params.items() if rx.match(fqn)]
        if owned:
            owner, _, name = pattern.rpartition(".")
            layouts = {repr(lay): lay for lay in (param_layout(style, p, name, pattern) for _, p in owned)}
            if len(layouts) > 1:
                raise PlanError(f"HF plan entry {pattern!r} (style {style!r}) gives its parameters different layouts "
                                f"{list(layouts)}; split the entry per layer")
            param_entries.setdefault(owner, {})[name] = (style, next(iter(layouts.values())))
        # else: this model lacks the module (HF plans name modules that some configs do not build)
    for owner, named in param_entries.items():
        layouts = {name: {axis: p} for name, (_, p) in named.items() if p != Replicate()}
        spec = specs.get(owner) or ModuleSpec(style=next(iter(named.values()))[0])
        specs[owner] = replace(spec, params={**spec.params, **layouts})
    return specs


def _routed_experts(pattern: str, style: str, weights: dict[str, str], hits: list[nn.Module], axis: str,
                    experts_axis: str) -> ModuleSpec:
    """``routed_experts`` for an HF experts entry and the entries of its weights."""
    where = f"HF plan entry {pattern!r} (style {style!r})"
    if style == "ep_dispatch_experts" and not any(p.ndim >= 2 for p in hits[0].parameters(recurse=False)):
        raise PlanError(f"{where}: {type(hits[0]).__name__} has no stacked expert weights ([num_experts, ...]); "
                        f"ep_dispatch_experts splits routed experts. Fix the entry, or write this module's spec by hand")
    if style == "ep_dispatch_experts":
        bad = {n: w for n, w in weights.items() if w != "grouped_gemm"}
        if bad:
            raise PlanError(f"{where}: its weights' entries {bad} are not grouped_gemm (Shard(0) of the experts); write "
                            f"fxshard.routed_experts(ep={axis!r}) for it by hand")
        return routed_experts(ep=axis)
    if experts_axis != "tp":
        raise PlanError(f"{where}: an expert-parallel plan names moe_tp_experts; use ep_dispatch_experts there")
    module = hits[0]
    if not any(p.ndim >= 3 for p in module.parameters(recurse=False)):
        raise PlanError(f"{where}: {type(module).__name__} has no stacked expert weights ([num_experts, ...]); "
                        f"moe_tp_experts shards routed experts. Fix the entry, or write this module's spec by hand")
    dims = {}
    for name, w in weights.items():
        t = getattr(module, name, None)
        if not isinstance(t, torch.Tensor) or t.ndim != 3:
            raise PlanError(f"{where}: entry {pattern}.{name} ({w!r}) names no 3-D expert weight of "
                            f"{type(module).__name__}; fix the entry, or write fxshard.routed_experts(tp={axis!r}, "
                            f"tp_dims=...) by hand")
        family = w.removeprefix("packed_")
        if family not in ("colwise", "rowwise"):
            raise PlanError(f"{where}: expert weight {name!r} has style {w!r}; fxshard knows colwise, rowwise and their "
                            f"packed forms there")
        dims[name] = (1 if family == "colwise" else 2, 2 if w.startswith("packed_") else 1)
    spec = routed_experts(tp=axis, tp_dims=dims or None)
    return _checked_experts(spec, module, axis, pattern)


def _checked_experts(spec: RoutedExpertsSpec, module: nn.Module, axis: str, pattern: str) -> RoutedExpertsSpec:
    """HF's plan as written when it shards the experts right; else the packed reading of
    a fused ``gate_up`` weight that HF's plan names plain ``colwise`` (Inkling-2: a
    contiguous split would give one rank all of gate and the other all of up), if that
    one is right.  Checked by running the module (``routed_experts.sharding_error``)."""
    hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None)
    if not isinstance(hidden, int):
        return spec  # transform checks it on the graph's shapes
    axes = {axis: 2}
    example = [torch.zeros(8, hidden), torch.zeros(8, 2, dtype=torch.long), torch.zeros(8, 2)]  # the routed call's shapes
    try:
        if sharding_error(module, spec, axes, example) is None:
            return spec
    except PlanError:  # a width 2 does not divide: transform checks it at the mesh's size
        return spec
    dims = dict(spec.tp_dims or HF_TP_DIMS)
    packed = {n: (d, 2) for n, (d, parts) in dims.items() if parts == 1 and "gate_up" in n}
    if packed:
        fixed = routed_experts(tp=axis, tp_dims={**dims, **packed})
        if sharding_error(module, fixed, axes, example) is None:
            return replace(fixed, style=f"moe_tp_experts ({', '.join(packed)} packed gate | up: HF's colwise would "
                                        f"split gate from up)")
    return spec  # wrong as HF wrote it: transform refuses it with the check's finding


def _one_spec(pattern: str, built: list[ModuleSpec]) -> ModuleSpec:
    """An fxshard pattern has one spec: every module an HF entry matches must get the same."""
    distinct = {repr(s): s for s in built}
    if len(distinct) > 1:
        raise PlanError(f"HF plan entry {pattern!r} matches modules that need different specs ({list(distinct)}); "
                        f"give them separate entries")
    return built[0]


def _in_module_order(specs: dict[str, ModuleSpec], fqns: list[str]) -> dict[str, ModuleSpec]:
    """Entries in the order of the model's modules (embedding, layers, head), so the plan reads top-down."""
    def first(pattern: str) -> int:
        rx = pattern_regex(pattern)
        return next((i for i, f in enumerate(fqns) if rx.match(f)), len(fqns))

    return dict(sorted(specs.items(), key=lambda kv: first(kv[0])))


def _fqn(modules: dict[str, nn.Module], module) -> str | None:
    return next((f for f, m in modules.items() if m is module), None)


def _spec_of(specs: dict[str, ModuleSpec], fqn: str) -> tuple[str, ModuleSpec | None]:
    """The plan key that matches module ``fqn`` (``fqn`` itself when none does) and its spec."""
    for pattern, spec in specs.items():
        if pattern_regex(pattern).match(fqn):
            return pattern, spec
    return fqn, None


def _family(spec: ModuleSpec | None) -> str | None:
    """``"colwise"`` / ``"rowwise"`` for HF's linear styles (also when marked ``(tied ...)``)."""
    style = (spec.style or "").split(" ")[0] if spec is not None else ""
    return "colwise" if style in COLWISE else "rowwise" if style in ROWWISE else None


def _embeddings(model) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the output embedding (LM head) of an HF model, or None."""
    def get(name):
        try:
            return getattr(model, name)()
        except (AttributeError, NotImplementedError):
            return None

    return get("get_input_embeddings"), get("get_output_embeddings")


# ----------------------------------------------------------------------------- tied embeddings


def _tie_embeddings(specs: dict[str, ModuleSpec], model, modules, axis: str) -> dict[str, ModuleSpec]:
    """A head tied to the input embedding (one ``[vocab, dim]`` tensor) gets one layout:
    the side the plan shards decides, the other side gets the spec that shards the same
    dim (``Shard(0)``: vocab-parallel embedding <-> colwise head; ``Shard(1)``: colwise
    embedding <-> rowwise head)."""
    emb, head = _embeddings(model)
    if emb is None or head is None or getattr(emb, "weight", None) is None or getattr(head, "weight", None) is not emb.weight:
        return specs
    emb_fqn, head_fqn = _fqn(modules, emb), _fqn(modules, head)
    (emb_key, emb_spec), (head_key, head_spec) = _spec_of(specs, emb_fqn), _spec_of(specs, head_fqn)
    emb_w, head_w = _weight_placement(emb_spec, axis), _weight_placement(head_spec, axis)
    if emb_w == head_w:
        return specs
    specs = dict(specs)
    if emb_w == Replicate():
        fix = vocab_parallel(axis) if head_w == Shard(0) else for_module_type(colwise(axis, out=Replicate()), nn.Embedding)
        name = "embedding_rowwise" if head_w == Shard(0) else "embedding_colwise"
        specs[emb_key] = replace(fix, style=f"{name} (tied to {head_fqn})")
    elif head_w == Replicate():
        fix = colwise(axis, out=Replicate()) if emb_w == Shard(0) else rowwise(axis, inputs=Replicate())
        name = "colwise_gather_output" if emb_w == Shard(0) else "rowwise_split_input"
        specs[head_key] = replace(fix, style=f"{name} (tied to {emb_fqn})")
    else:
        raise PlanError(f"Plan.from_hf: {head_fqn!r} is tied to {emb_fqn!r} (one weight), but HF's plan gives it {head_w} "
                        f"in {head_fqn!r} ({head_spec.style}) and {emb_w} in {emb_fqn!r} ({emb_spec.style}); give both "
                        f"the same layout: a colwise head with a vocab-parallel embedding (embedding_rowwise)")
    return specs


def _weight_placement(spec: ModuleSpec | None, axis: str) -> Placement:
    layout = (spec.params.get("weight") if spec is not None else None) or {}
    return layout.get(axis, Replicate()) if isinstance(layout, Mapping) else layout


# ----------------------------------------------------------------------------- sequence / loss parallel


def _sequence_parallel(specs: dict[str, ModuleSpec], model, modules, axis: str) -> dict[str, ModuleSpec]:
    """Megatron sequence parallelism on top of HF's plan: the residual stream is ``Shard(1)``."""
    seq = {axis: Shard(1)}
    base, prefix = _base_model(model)
    lists = [(prefix + n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise PlanError(f"Plan.from_hf(sequence_parallel=True): {type(base).__name__} has no list of decoder layers "
                        f"(an nn.ModuleList child); sequence parallelism needs the layers' norms and projections")
    specs = dict(specs)
    inside = tuple(f"{fqn}." for fqn, _ in lists)
    moe = [p for fqn, layers in lists for p in _routed_blocks(fqn, layers)]
    moe_fqns = [f for f in modules if any(pattern_regex(p).fullmatch(f) for p in moe)]
    for key in specs:
        if any(pattern_regex(key).fullmatch(f) for f in moe_fqns):
            raise PlanError(f"Plan.from_hf(sequence_parallel=True): the MoE block entry {key!r} is in HF's plan; "
                            f"sequence parallelism gathers the block's input itself")
    for pattern, spec in specs.items():  # projections in the layers
        if moe_fqns and _in_blocks(pattern, modules, moe_fqns):
            continue  # inside an MoE block: it runs on the gathered sequence, as plain TP
        if pattern.startswith(inside) and _family(spec) == "colwise":
            specs[pattern] = replace(spec, in_src=seq)  # all-gathered on entry (once per value)
        elif pattern.startswith(inside) and _family(spec) == "rowwise":
            specs[pattern] = replace(spec, out_dst=seq)  # reduce-scatter instead of all-reduce
    for fqn, layers in lists:
        _add(specs, _residual_norms(fqn, layers), seq_norm(axis))
    for pattern in moe:
        specs[pattern] = ModuleSpec(inputs={axis: Replicate()}, out_dst=seq, style="sequence_parallel (MoE block: gathered)")

    emb, head = _embeddings(model)
    head_key, head_spec = _spec_of(specs, _fqn(modules, head)) if head is not None else (None, None)
    if head_spec is not None and _family(head_spec) != "colwise":
        raise PlanError(f"Plan.from_hf(sequence_parallel=True): the LM head {head_key!r} is {head_spec.style}; "
                        f"sequence parallelism expects a colwise head that gathers the sequence on entry")
    if head_spec is not None:
        specs[head_key] = replace(head_spec, in_src=seq)
    children = list(base.named_children())
    first_layers = next(i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList))
    for i, (name, child) in enumerate(children):
        if _is_norm(child):  # embedding norms before the layers, the final norm after them
            final = i > first_layers and head_spec is None  # no planned head: gather the sequence here
            _add(specs, [prefix + name], replace(seq_norm(axis), out_dst={axis: Replicate()}) if final else seq_norm(axis))
    # token embedding and the embeddings added to it (learned positions): leave Shard(1)
    embeddings = [prefix + n for n, m in children if isinstance(m, nn.Embedding)]
    if emb is not None and _fqn(modules, emb) not in embeddings:
        embeddings.append(_fqn(modules, emb))
    for fqn in embeddings:
        key, spec = _spec_of(specs, fqn)
        specs[key] = replace(spec, out_dst=seq) if spec is not None else ModuleSpec(out_dst=seq, style="sequence_shard")
    return specs


def _residual_norms(list_fqn: str, layers: nn.ModuleList) -> list[str]:
    """Patterns of the norms that are direct children of the decoder layers:
    ``model.layers.*.input_layernorm``, or one FQN per layer where a name is a norm in
    some layers only."""
    return _layer_children(list_fqn, layers, _is_norm)


def _routed_blocks(list_fqn: str, layers: nn.ModuleList) -> list[str]:
    """Patterns of the children of the decoder layers that hold routed experts (a module
    whose class ends in ``Experts``: Mixtral's, Qwen3-MoE's): they flatten batch and sequence
    to route tokens, so under sequence parallelism they take whole sequences."""
    return _layer_children(list_fqn, layers, lambda child: any(type(m).__name__.endswith("Experts") for m in child.modules()))


def _layer_children(list_fqn: str, layers: nn.ModuleList, wanted) -> list[str]:
    """Patterns of the decoder layers' children for which ``wanted(child)`` holds: one
    ``list.*.name`` where it holds in every layer, else one FQN per layer where it does."""
    kinds: dict[str, list[tuple[str, bool]]] = {}
    for idx, layer in layers.named_children():
        for name, child in layer.named_children():
            kinds.setdefault(name, []).append((idx, bool(wanted(child))))
    out = []
    for name, flags in kinds.items():
        if all(hit for _, hit in flags):
            out.append(f"{list_fqn}.*.{name}")
        else:
            out += [f"{list_fqn}.{idx}.{name}" for idx, hit in flags if hit]
    return out


def _in_blocks(pattern: str, modules: dict, blocks: list[str]) -> bool:
    """Whether the modules plan entry ``pattern`` matches lie inside the modules ``blocks``
    (all of them; some only is a PlanError: the entry must be split per layer)."""
    hits = [f for f in modules if pattern_regex(pattern).fullmatch(f)]
    inside = [any(f.startswith(b + ".") for b in blocks) for f in hits]
    if any(inside) and not all(inside):
        raise PlanError(f"Plan.from_hf(sequence_parallel=True): entry {pattern!r} matches modules inside MoE blocks "
                        f"and outside them; sequence parallelism treats the two differently: split the entry per layer")
    return bool(hits) and all(inside)


def _is_norm(module: nn.Module) -> bool:
    """RMSNorm / LayerNorm classes of every family (LlamaRMSNorm, nn.LayerNorm ...)."""
    return type(module).__name__.endswith("Norm")


def _add(specs: dict[str, ModuleSpec], patterns: list[str], spec: ModuleSpec) -> None:
    for pattern in patterns:
        old = specs.get(pattern)
        if old is not None and old.style != "sequence_parallel":
            raise PlanError(f"Plan.from_hf(sequence_parallel=True): norm {pattern!r} already has {old!r} in HF's plan; "
                            f"sequence parallelism runs it on sequence shards")
        specs[pattern] = spec


def _loss_parallel(specs: dict[str, ModuleSpec], model, modules, axis: str) -> dict[str, ModuleSpec]:
    """Vocab-sharded logits: the colwise LM head keeps its output ``Shard(-1)``."""
    _, head = _embeddings(model)
    key, spec = _spec_of(specs, _fqn(modules, head)) if head is not None else (None, None)
    if _family(spec) != "colwise":
        what = "has no LM head (get_output_embeddings() is None)" if head is None else (
            f"has LM head {key!r} " + ("outside the plan" if spec is None else f"with style {spec.style!r}"))
        raise PlanError(f"Plan.from_hf(loss_parallel=True): {type(model).__name__} {what}; loss parallelism needs a "
                        f"colwise LM head whose vocab-sharded logits feed the cross-entropy")
    return {**specs, key: replace(spec, out_dst={axis: Shard(-1)}, style="colwise (loss parallel)")}
