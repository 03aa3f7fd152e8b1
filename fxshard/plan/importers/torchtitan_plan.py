"""Import torchtitan's tensor/sequence-parallel plan as an fxshard :class:`~fxshard.Plan`.

torchtitan 0.3 does not call ``parallelize_module`` with torch's TP styles for its
decoders.  Its plan is data: every ``Module.Config`` carries a ``ShardingConfig``
(spmd_types layouts keyed by mesh axis) that the model config's
``update_from_config`` fills in (``set_llama3_sharding_config`` for Llama3) and that
``Module.parallelize`` applies.  Its fields are fxshard's :class:`~fxshard.ModuleSpec`
fields, so they are read one to one:

==========================================  =============================================
torchtitan ``ShardingConfig``                fxshard ``ModuleSpec``
==========================================  =============================================
``state_shardings``                          ``params`` (Replicate entries left out: default)
``in_src_shardings``                         ``in_src`` (checked on entry)
``in_dst_shardings``                         ``inputs`` (redistributed into on entry)
``out_src_shardings``                        ``out_src``
``out_dst_shardings``                        ``out_dst``
``local_map`` on an embedding / attention    dropped: fxshard rewrites the single-device
                                             code itself (vocab masking, local heads)
spmd ``R`` and ``I`` / ``P`` / ``S(d)``      ``Replicate()`` / ``Partial()`` / ``Shard(d)``
``V`` + ``partition_spec``                   ``Shard(d)``, d the tensor dim naming ``tp``
==========================================  =============================================

How the plan is obtained, with no mesh and no process group: ``model.config`` is
deep-copied and torchtitan's own ``update_from_config`` runs on it with a
``ParallelismConfig`` (tp degree from the mesh, sequence parallel on or off), the path
its trainer takes; the config is then built on the meta device, so each
``ShardingConfig`` is read at its module's real FQN (a config field is not always a
module: ``QKVLinear``'s ``wkv`` builds both ``wk`` and ``wv``).  Only the ``tp`` axis
is converted for dense modules: ``dp`` belongs to FSDP2, and torchtitan's
context-parallel layouts (sequence sharded over ``cp`` and ``tp`` together) are not
imported.

**MoE** (``MoE`` with ``RoutedExperts`` around ``GroupedExperts``, Qwen3-MoE and
DeepSeek-V3): on a mesh with an ``ep`` axis the plan is torchtitan's expert
parallelism, read from the configs it builds for ``expert_parallel_degree``: the
grouped experts' weights ``S(0)`` on ``EP`` make the MoE block an
:func:`fxshard.expert_parallel` region around ``routed_experts.inner_experts``
(counts exchanged, tokens dispatched and combined with uneven all-to-alls, as
torchtitan's ``AllToAllTokenDispatcher``), and the batch is sharded over ``ep``, as
torchtitan's data loader shards it over the ranks ``ep`` is carved from.  The router
and shared experts run inside the region on the rank's own tokens.  torchtitan's
``tokens_per_expert_E`` buffer (declared ``Partial`` there) counts the rank's tokens.
On a ``tp`` mesh (no ``ep``) torchtitan shards each expert on its hidden dim inside its
``RoutedExperts`` ``local_map`` region: that region becomes an fxshard local region
with the experts' shards as its ``params``, Replicate tokens in, a ``Partial`` output;
router, shared experts and attention follow torchtitan's TP plan.
"""
from __future__ import annotations

import copy
import inspect
import types
from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxshard.errors import PlanError
from fxshard.plan.mesh import Mesh, mesh_shape
from fxshard.plan.specs import PlanEntries, ModuleSpec, pattern_regex, colwise, rowwise, sequence_parallel as seq_norm, vocab_parallel

R = Replicate()


def specs_from_torchtitan(mesh: Mesh, model: nn.Module, *, axis: str = "tp", ep_axis: str = "ep", loss_parallel: bool = False,
                         sequence_parallel: bool = True, inputs: Mapping[str, Any] | None = None) -> PlanEntries:
    """torchtitan's TP plan for ``model`` (a torchtitan decoder such as ``Llama3Model``)
    as an fxshard Plan on ``mesh``, torchtitan's ``tp`` axis played by ``axis``.

    ``sequence_parallel`` is torchtitan's ``parallelism.enable_sequence_parallel``
    (default on, as there): norms on sequence shards, attention and feed-forward
    all-gather on entry, ``wo``/``w2`` reduce-scatter.  torchtitan always keeps the
    logits vocab-sharded for its loss-parallel cross-entropy; that is
    ``loss_parallel=True``.  The default ``False`` all-gathers them at ``lm_head`` so
    the sharded program returns the single-device logits.  ``inputs``: the graph
    inputs' layouts, as for :class:`~fxshard.Plan` (default with ``ep``: the tokens
    ``Shard(0)`` over it).  ``ep_axis``: the mesh axis that plays torchtitan's ``ep``
    for MoE models (see the module docstring); on a mesh with both, dense modules
    follow the ``tp`` plan and MoE blocks the ``ep`` one (replicated over ``tp``).

    Example::

        model = fxshard.testing.torchtitan_models.tiny_llama3()
        plan = specs_from_torchtitan(fxshard.MeshSpec(("tp",), (2,)), model)
        plan.specs["layers.*.attention.qkv_linear.wqkv"]   # colwise

        moe = fxshard.testing.torchtitan_models.tiny_qwen3_moe()
        plan = specs_from_torchtitan(fxshard.MeshSpec(("ep",), (2,)), moe)
        plan.specs["layers.*.moe"]   # expert_parallel('ep', experts='routed_experts.inner_experts')
    """
    axes = mesh_shape(mesh)
    if axis not in axes and ep_axis not in axes:
        raise PlanError(f"Plan.from_torchtitan: neither axis {axis!r} nor ep_axis {ep_axis!r} is on the mesh {dict(axes)}; "
                        f"pass axis= the mesh axis that plays torchtitan's 'tp' (or ep_axis= its 'ep', for MoE models)")
    _check_modules(model)
    modules = dict(model.named_modules())
    specs: dict[str, ModuleSpec] = {}
    ep_regions = _expert_parallel_specs(model, ep_axis, axes[ep_axis]) if ep_axis in axes else {}
    if ep_axis in axes and not ep_regions:
        raise PlanError(f"Plan.from_torchtitan: the mesh has an {ep_axis!r} axis but torchtitan shards no experts of "
                        f"{type(model).__name__} over 'ep' (it has no MoE layers); drop the axis or pass ep_axis= another name")
    if axis in axes:
        for fqn, config in torchtitan_sharding_configs(model, tp_degree=axes[axis], sequence_parallel=sequence_parallel).items():
            if any(fqn == r or fqn.startswith(r + ".") for r in ep_regions):
                continue  # inside an expert-parallel region: it runs as is, on the rank's tokens
            spec = spec_from_sharding_config(config, modules[fqn], axis, fqn)
            if spec is not None:
                specs[fqn] = spec
        if not loss_parallel:
            specs = _gather_logits(specs, axis)
        specs = _states_into_regions(specs)
    specs.update(ep_regions)
    if ep_regions and inputs is None:
        inputs = {_forward_args(model)[0]: {ep_axis: Shard(0)}}
    return PlanEntries(_fold_layers(specs, list(modules)), inputs)


def _expert_parallel_specs(model: nn.Module, ep_axis: str, ep_degree: int) -> dict[str, ModuleSpec]:
    """``{moe_fqn: expert_parallel(...)}`` for every MoE block whose grouped experts
    torchtitan shards ``S(0)`` on ``EP`` at ``expert_parallel_degree=ep_degree``."""
    from torchtitan.models.common.moe import MoE, RoutedExperts

    from fxshard.runtime.moe import expert_parallel

    configs = torchtitan_sharding_configs(model, tp_degree=1, ep_degree=ep_degree)
    modules = dict(model.named_modules())
    out = {}
    for fqn, config in configs.items():
        sharded = {name: _placement_on(layout, "ep") for name, layout in config.state_shardings.items()}
        if not any(p == Shard(0) for p in sharded.values()):
            continue
        where = f"torchtitan sharding_config of {fqn!r} ({type(modules[fqn]).__name__})"
        wrong = {n: p for n, p in sharded.items() if p != Shard(0)}
        if wrong:
            raise PlanError(f"{where}: experts are sharded over 'ep' on the expert dim, but {sorted(wrong)} are {wrong}; "
                            f"fxshard's expert parallelism shards every stacked expert weight Shard(0)")
        moe = next((m for m in _ancestors(fqn) if isinstance(modules.get(m), MoE)), None)
        routed = next((m for m in _ancestors(fqn) if isinstance(modules.get(m), RoutedExperts)), None)
        if moe is None or routed is None:
            raise PlanError(f"{where}: expert weights sharded over 'ep' outside a torchtitan MoE / RoutedExperts block; "
                            f"fxshard converts torchtitan's MoE layers only: write an fxshard.expert_parallel spec for it")
        _check_grouped_convention(modules[fqn], fqn)
        out[moe] = expert_parallel(ep_axis, experts=fqn[len(moe) + 1:])
    return out


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _check_grouped_convention(experts: nn.Module, fqn: str) -> None:
    """fxshard dispatches around ``experts(x, num_tokens_per_expert)``: torchtitan's
    ``GroupedExperts`` (and subclasses such as gpt-oss's) are called that way."""
    args = _forward_args(experts)
    if len(args) != 2:
        raise PlanError(f"module {fqn!r} ({type(experts).__name__}) holds the experts torchtitan shards over 'ep', but its "
                        f"forward takes {args}; fxshard's all-to-all dispatch wraps experts called as "
                        f"experts(x, num_tokens_per_expert)")


def torchtitan_sharding_configs(model: nn.Module, *, tp_degree: int, sequence_parallel: bool = True, ep_degree: int = 1) -> dict:
    """``{module_fqn: ShardingConfig}``: what torchtitan's trainer would attach to
    ``model``'s modules for tensor parallelism of degree ``tp_degree`` (and expert
    parallelism of degree ``ep_degree``).

    Example::

        configs = torchtitan_sharding_configs(model, tp_degree=2)
        configs["layers.0.attention.wo"].out_dst_shardings    # sequence-sharded (SP)
    """
    from torchtitan.config import ParallelismConfig
    from torchtitan.protocols.module import Module

    config = getattr(model, "config", None)
    if not isinstance(model, Module) or not hasattr(config, "update_from_config"):
        raise PlanError(f"Plan.from_torchtitan: expected a torchtitan model built from its config (a Decoder such as "
                        f"Llama3Model, with .config), got {type(model).__name__}")
    config = copy.deepcopy(config)  # torchtitan fills sharding_config in place: leave the model's config alone
    parallelism = ParallelismConfig(tensor_parallel_degree=tp_degree, enable_sequence_parallel=sequence_parallel,
                                    expert_parallel_degree=ep_degree)
    try:
        # The entry point torchtitan's trainer calls; it also checks that tp divides the heads.
        config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    except (ValueError, NotImplementedError) as e:
        raise PlanError(f"torchtitan rejects tensor parallelism of degree {tp_degree} (expert parallelism {ep_degree}) "
                        f"for {type(model).__name__}: {e}") from e
    with torch.device("meta"):
        shadow = config.build()
    found = {fqn: m._sharding_config for fqn, m in shadow.named_modules() if getattr(m, "_sharding_config", None) is not None}
    names = dict(model.named_modules())
    stray = [f for f in found if f not in names]
    if stray:
        raise PlanError(f"Plan.from_torchtitan: {type(model).__name__}.config builds modules the model does not have "
                        f"({stray[:3]}); was the model changed after it was built?")
    return found


def spec_from_sharding_config(config, module: nn.Module, axis: str, fqn: str) -> ModuleSpec | None:
    """One torchtitan ``ShardingConfig`` as a ModuleSpec on ``axis`` (a preset where it
    is one); ``None`` when it declares nothing but Replicate, fxshard's default.

    Example::

        wo = torchtitan_sharding_configs(model, tp_degree=2)["layers.0.attention.wo"]
        spec_from_sharding_config(wo, model.layers["0"].attention.wo, "tp", "layers.0.attention.wo")
        # rowwise("tp", out=Shard(1))
    """
    where = f"torchtitan sharding_config of {fqn!r} ({type(module).__name__})"
    if config.local_map is not None and _is_routed_experts(module):
        return _routed_experts_region(config, module, axis, where)
    if config.local_map is not None and not _local_map_has_equivalent(module):
        raise PlanError(f"{where}: local_map (the module's own code computes on local shards) has no fxshard "
                        f"equivalent for {type(module).__name__}: fxshard rewrites the single-device code and knows how "
                        f"for vocab-parallel embeddings and attention on local heads only. Write an fxshard.ModuleSpec "
                        f"for {fqn!r} (an opaque region: local=True, compute=...)")
    params, optional = {}, []
    for name, layout in config.state_shardings.items():
        p = _tp(layout, f"{where} state_shardings[{name!r}]")
        if p is None or p == R:
            continue
        params[name] = {axis: p}
        if name not in dict(module.named_parameters(recurse=False)) and name not in dict(module.named_buffers(recurse=False)):
            optional.append(name)  # torchtitan declares "bias" for linears built without one
    spec = ModuleSpec(
        params=params, optional_params=tuple(optional),
        inputs=_args(config.in_dst_shardings, module, axis, f"{where} in_dst_shardings"),
        in_src=_args(config.in_src_shardings, module, axis, f"{where} in_src_shardings"),
        out_src=_outs(config.out_src_shardings, axis, f"{where} out_src_shardings"),
        out_dst=_outs(config.out_dst_shardings, axis, f"{where} out_dst_shardings"),
    )
    preset = _as_preset(spec, module, axis)
    if preset is not None:
        return preset
    if not spec.params and all(p == R for p in _placements(spec)):
        return None
    only_inputs = spec.out_src is None and spec.out_dst is None and not spec.params
    return replace(spec, style="prepare_input" if only_inputs else "torchtitan")


# ----------------------------------------------------------------------------- layouts


def _tp(layout, where: str) -> Placement | None:
    """The DTensor placement of ``layout`` on torchtitan's ``tp`` axis, resolved as its
    ``resolve_placements`` does (``partition_spec`` folded into ``S(dim)``)."""
    return _placement_on(layout, "tp", where)


def _placement_on(layout, name: str, where: str = "") -> Placement | None:
    """The DTensor placement of ``layout`` on torchtitan's mesh axis ``name``."""
    if layout is None:
        return None
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName

    t = layout.per_axis_spmd_types().get(MeshAxisName(name))
    if t is None:
        return None
    try:
        return spmd.spmd_type_to_dtensor_placement(t)
    except ValueError as e:
        raise PlanError(f"{where}: {t} on {name!r} has no DTensor placement ({e}); give the layout a partition_spec") from e


def _args(layouts: Mapping[str, Any] | None, module: nn.Module, axis: str, where: str) -> dict | None:
    """``{forward_arg: layout}``.  torchtitan names a norm's input ``"input"`` while
    ``RMSNorm.forward`` calls it ``x`` (torchtitan then skips it silently); for a
    single-argument module the one declared name can only mean that argument."""
    if not layouts:
        return None
    params = _forward_args(module)
    out = {}
    for name, layout in layouts.items():
        p = _tp(layout, f"{where}[{name!r}]")
        if p is None:
            continue
        if name not in params:
            if len(params) != 1 or len(layouts) != 1:
                raise PlanError(f"{where}: {type(module).__name__}.forward has no argument {name!r} (it has {params})")
            name = params[0]
        out[name] = {axis: p}
    return out or None


def _outs(layouts, axis: str, where: str):
    if layouts is None:
        return None
    if isinstance(layouts, tuple):
        return tuple(None if (p := _tp(l, f"{where}[{i}]")) is None else {axis: p} for i, l in enumerate(layouts))
    p = _tp(layouts, where)
    return None if p is None else {axis: p}


def _forward_args(module: nn.Module) -> list[str]:
    sig = inspect.signature(type(module).forward)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in sig.parameters.items() if p.kind in kinds and n != "self"]


def _one(v, axis: str):
    """The placement of a single-argument layout (``{arg: {axis: p}}`` or ``{axis: p}``);
    ``None`` when absent, ``...`` when there are several arguments."""
    if v is None:
        return None
    if isinstance(v, tuple) or len(v) != 1:
        return ...
    (inner,) = v.values()
    return inner if isinstance(inner, Placement) else inner.get(axis)


def _placements(spec: ModuleSpec):
    for v in (spec.inputs, spec.in_src, spec.out_src, spec.out_dst):
        items = v if isinstance(v, tuple) else () if v is None else (v,)
        for layout in items:
            for p in (layout or {}).values():
                yield from (p.values() if isinstance(p, Mapping) else (p,))


# ----------------------------------------------------------------------------- presets


def _as_preset(spec: ModuleSpec, module: nn.Module, axis: str) -> ModuleSpec | None:
    """The fxshard preset that states the same contract, if any.  Presets also check a
    module's input where torchtitan leaves it undeclared (a colwise linear needs a
    replicated input, a rowwise one a feature-sharded input)."""
    weight = spec.params.get("weight", {}).get(axis)
    bias = spec.params.get("bias", {}).get(axis)
    names = set(spec.params)
    src, dst, out_src, out_dst = (_one(v, axis) for v in (spec.in_src, spec.inputs, spec.out_src, spec.out_dst))
    if ... in (src, dst, out_src, out_dst):
        return None
    if isinstance(module, nn.Linear) and names <= {"weight", "bias"} and dst in (None, R):
        if weight == Shard(0) and bias in (None, Shard(0)) and out_src == Shard(-1):
            return colwise(axis, inputs=src or R, out=out_dst or Shard(-1))
        if weight == Shard(1) and bias is None and out_src == Partial():
            return rowwise(axis, inputs=src or Shard(-1), out=out_dst or Partial())
    if isinstance(module, nn.Embedding) and names == {"weight"} and weight == Shard(0) and out_src == Partial() and dst in (None, R):
        return vocab_parallel(axis, out=out_dst or Partial())
    if not names and isinstance(src, Shard) and dst is None and out_src == src:
        spec = seq_norm(axis, dim=src.dim)
        return spec if out_dst in (None, out_src) else replace(spec, out_dst={axis: out_dst})
    return None


def _states_into_regions(specs: dict[str, ModuleSpec]) -> dict[str, ModuleSpec]:
    """A local region is opaque: the states torchtitan declares on a module inside one
    (the grouped experts' shards) become the region's own ``params``, by relative name."""
    out = dict(specs)
    for region, spec in specs.items():
        if not spec.local:
            continue
        params = dict(spec.params)
        for fqn, inner in specs.items():
            if fqn.startswith(region + "."):
                if inner.inputs or inner.in_src or inner.out_src or inner.out_dst:
                    raise PlanError(f"torchtitan sharding_config of {fqn!r}: it declares activations inside the local_map "
                                    f"region {region!r}, which fxshard runs as one opaque call")
                params.update({f"{fqn[len(region) + 1:]}.{name}": layout for name, layout in inner.params.items()})
                del out[fqn]
        out[region] = replace(spec, params=params)
    return out


def _is_routed_experts(module: nn.Module) -> bool:
    from torchtitan.models.common.moe import RoutedExperts

    return isinstance(module, RoutedExperts)


def _routed_experts_region(config, module: nn.Module, axis: str, where: str) -> ModuleSpec:
    """torchtitan's TP-only MoE: ``RoutedExperts`` is a ``local_map`` region on the
    tokens as they arrive (Replicate over ``tp``) whose grouped experts hold their
    hidden-dim shard (``inner_experts`` states ``S(1)``/``S(2)``, a plan entry of their
    own); its output is each rank's partial sum (``Partial``).  The same in fxshard: an
    opaque local region with those layouts declared -- ``GroupedExperts`` sizes its
    grouped matmuls by its weights, so the local code is the single-device code.  The
    tokens' and routing weights' gradients (Partial) are summed by ``grad_sync``."""
    spec = ModuleSpec(
        inputs=_args(config.in_dst_shardings, module, axis, f"{where} in_dst_shardings"),
        in_src=_args(config.in_src_shardings, module, axis, f"{where} in_src_shardings"),
        out_src=_outs(config.out_src_shardings, axis, f"{where} out_src_shardings"),
        out_dst=_outs(config.out_dst_shardings, axis, f"{where} out_dst_shardings"),
        local=True, style="torchtitan local_map",
    )
    if spec.out_src != {axis: Partial()} or any(p != R for p in _placements(replace(spec, out_src=None, out_dst=None))):
        raise PlanError(f"{where}: fxshard converts torchtitan's routed experts under TP with Replicate tokens in and a "
                        f"Partial output (experts sharded on their hidden dim); this config declares {spec}")
    return spec


def _local_map_has_equivalent(module: nn.Module) -> bool:
    """torchtitan runs these on local tensors; fxshard's rewrite of their single-device
    code is the same computation: the vocab-parallel embedding masks out-of-shard ids,
    attention runs on this rank's heads."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    return isinstance(module, (nn.Embedding, FlexAttention, ScaledDotProductAttention, VarlenAttention))


def _gather_logits(specs: dict, axis: str) -> dict:
    """torchtitan's ``lm_head`` keeps the logits vocab-sharded (``Shard(-1)``) for its
    loss-parallel cross-entropy; without loss parallelism they are all-gathered."""
    head = specs.get("lm_head")
    if head is not None and head.out_dst == {axis: Shard(-1)}:
        specs = {**specs, "lm_head": replace(head, out_dst={axis: R})}
    return specs


# ----------------------------------------------------------------------------- modules and patterns


def _check_modules(model: nn.Module) -> None:
    """Modules whose forward does torchtitan's TP work itself, or computes in a
    quantized format, have no single-device code for fxshard to rewrite."""
    from torchtitan.models.common.dist_gemm import AllGatherFusedFeedForward, AllGatherFusedQKVLinear, RowParallelLinear

    for fqn, m in model.named_modules():
        if isinstance(m, (RowParallelLinear, AllGatherFusedQKVLinear, AllGatherFusedFeedForward)):
            raise PlanError(f"module {fqn!r} is torchtitan's {type(m).__name__} (tp_gemm_backend='dist_gemm'): its forward "
                            f"runs the TP all-gather/reduce-scatter inside a symmetric-memory GEMM, which has no fxshard "
                            f"equivalent (fxshard places the collectives in the graph itself). Build the model with "
                            f"tp_gemm_backend='default'")
        if any(c.__module__.startswith("torchao") for c in type(m).__mro__):
            raise PlanError(f"module {fqn!r} is {type(m).__name__}, a torchao quantized module (torchtitan's float8/mx/nvfp4 "
                            f"converters): fxshard's colwise/rowwise rewrites act on F.linear and have no quantized "
                            f"equivalent. Convert the plan from the model without the quantization converter")


def _fold_layers(specs: dict[str, ModuleSpec], fqns: list[str]) -> dict[str, ModuleSpec]:
    """``layers.0.x``, ``layers.1.x`` ... -> ``layers.*.x`` where every module the
    pattern matches has the same spec (fxshard's ``*`` is one dotted name)."""
    out: dict[str, ModuleSpec] = {}
    done: set[str] = set()
    for fqn, spec in specs.items():
        if fqn in done:
            continue
        pattern = ".".join("*" if part.isdigit() else part for part in fqn.split("."))
        rx = pattern_regex(pattern)
        group = [f for f in fqns if rx.match(f)]
        if pattern != fqn and all(specs.get(f) == spec for f in group):
            out[pattern] = spec
            done.update(group)
        else:
            out[fqn] = spec
            done.add(fqn)
    return out
