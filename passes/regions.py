"""regions: attach the plan to the graph.

Maps every plan pattern to module FQNs through ``nn_module_stack``, checks the plan
against the model (patterns that match nothing, parameters the module lacks, tied
parameters with conflicting layouts, graph inputs that do not exist) and records on
each node what the plan says about it, so that later passes never read the plan.

Reads:  ``nn_module_stack``; boundary markers; the plan.
Writes: ``node.meta["fxshard"].region`` (innermost planned module FQN) on every node;
        ``.declared`` = complete layout on ``get_attr`` and ``placeholder`` nodes,
        :class:`fxshard.meta.Boundary` on ``region_input``/``region_output`` markers,
        :class:`fxshard.meta.LocalRegion` on the ``call_module`` of a local region
        (its layouts hold only the axes the plan names); ``.extra["pattern"]``, the
        plan entry that applies to the node; ``.extra["context_parallel"]``, the
        :class:`fxshard.plan.specs.ContextParallel` of the innermost context-parallel module
        around the node, and ``.extra["context_parallel_module"]`` its FQN;
        ``.extra["distributed_norm"]``, the axis of a ``distributed_norm`` region's
        statistics, on the nodes inside it.
"""
from __future__ import annotations

import inspect
from typing import Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement

from fxshard.markers import region_input, region_output
from fxshard.errors import PlanError
from fxshard.layout.placements import complete
from fxshard.meta import Boundary, LocalRegion, info
from fxshard.plan.plan import is_layout
from fxshard.plan.specs import for_module_type
from fxshard.meta import PassContext


def module_types(gm: fx.GraphModule) -> dict[str, type]:
    """``{fqn: module type}`` for every module the graph was traced through or calls."""
    types: dict[str, type] = {}
    for node in gm.graph.nodes:
        for qualname, mtype in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(mtype, type):
                types.setdefault(qualname, mtype)
    for name, mod in gm.named_modules():
        if name and type(mod) is not torch.nn.Module:  # plain Modules are fx's path holders
            types.setdefault(name, type(mod))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "." in node.target:  # functional calls: fqn of the parameter owner
            types.setdefault(node.target.rsplit(".", 1)[0], torch.nn.Module)
    return types


def _pick(value, name: str, position: int | None, first: bool, axes):
    """Select the entry of a spec field (``inputs``/``out_src``...) for one argument."""
    if value is None:
        return None
    if isinstance(value, Placement) or is_layout(value, axes):
        return value if first else None
    if isinstance(value, Mapping):  # by name; int keys are positions (Plan.from_torch's mixed layouts)
        return value[name] if name in value else (value.get(position) if position is not None else None)
    if isinstance(value, (tuple, list)):
        return value[position] if position is not None and position < len(value) else None
    return None


def regions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Attach plan declarations and regions to ``node.meta`` (in place)."""
    plan = ctx.plan
    types = module_types(gm)
    plan.check_patterns(sorted(types))
    specs = {}
    for fqn, mtype in types.items():
        hit = plan.match(fqn)
        if hit:
            specs[fqn] = (hit[0], for_module_type(hit[1], mtype))
    axes = plan.axes

    # parameters and buffers --------------------------------------------------------
    declared_params: dict[str, dict] = {}
    declared_by: dict[str, str] = {}  # parameter FQN -> plan pattern (provenance for fxshard.explain)
    splits: dict[str, tuple[int, ...]] = {}
    heads: dict[str, int] = {}
    for fqn, (pattern, spec) in specs.items():
        for pname, layout in spec.params.items():
            full = f"{fqn}.{pname}"
            if not _has_attr(gm, full):
                if pname in spec.optional_params:
                    continue
                owned = sorted(n for n in _attr_names(gm, fqn))
                raise PlanError(f"plan entry {pattern!r}: module {fqn!r} has no parameter or buffer {pname!r} "
                                f"(it has {owned}); fix the name in params=")
            declared_params[full] = complete(layout, axes, f"plan entry {pattern!r} params[{pname!r}]")
            declared_by[full] = pattern
            if spec.splits:
                splits[full] = spec.splits
            if spec.heads is not None:
                heads[full] = spec.heads
    _check_tied(gm, declared_params, splits)
    _check_boundaries_marked(gm, specs)

    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    for name in plan.inputs:
        if name not in placeholders:
            raise PlanError(f"Plan inputs names {name!r}, but the graph inputs are {placeholders}; fix the name in inputs=")

    context_parallel = {fqn: spec.context_parallel for fqn, (_, spec) in specs.items() if spec.context_parallel is not None}
    for node in gm.graph.nodes:
        meta = info(node)
        meta.region = _innermost_planned(node, specs)
        fqn = _context_parallel_of(node, context_parallel) if context_parallel else None
        if fqn is not None:
            meta.extra["context_parallel"] = context_parallel[fqn]
            meta.extra["context_parallel_module"] = fqn
        pattern = declared_by.get(node.target) if node.op == "get_attr" else specs.get(meta.region, (None,))[0]
        if pattern is not None:
            meta.extra["pattern"] = pattern
        if meta.region in specs and specs[meta.region][1].distributed_norm is not None:
            meta.extra["distributed_norm"] = specs[meta.region][1].distributed_norm
        if node.op == "get_attr":
            meta.declared = declared_params.get(node.target, complete(None, axes))
            if node.target in splits:
                meta.extra["splits"] = splits[node.target]
            if node.target in heads:
                meta.extra["heads"] = heads[node.target]
        elif node.op == "placeholder":
            meta.declared = plan.inputs.get(node.target, complete(None, axes))
        elif node.op == "call_function" and node.target in (region_input, region_output):
            _, fqn, name = node.args
            meta.region = fqn
            if fqn in specs:
                meta.declared = _boundary(node, fqn, name, specs[fqn], types.get(fqn), axes)
        elif node.op == "call_module" and node.target in specs and specs[node.target][1].local:
            meta.declared = _local_region(gm, node, specs, declared_params, axes)
    return


def _local_region(gm, node, specs, declared_params, axes) -> LocalRegion:
    """What the plan says about an opaque region (a ``call_module``): its declared
    output layout(s) and the layout of every parameter and buffer it owns."""
    fqn = node.target
    pattern, spec = specs[fqn]
    where = f"plan entry {pattern!r} (local region {fqn!r})"
    inner = [f for f in specs if f.startswith(fqn + ".")]
    if inner:
        raise PlanError(f"{where}: plan entry {specs[inner[0]][0]!r} matches module {inner[0]!r} inside the region, but a "
                        f"local region is opaque; declare the layouts of its tensors in the region's own params=")
    if spec.out_src is None:
        raise PlanError(f"{where}: the output layout of a local region is declared, not derived; "
                        f"give its plan entry out_src= (e.g. the layout of its input)")
    module = gm.get_submodule(fqn)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    params = {f"{fqn}.{n}": declared_params.get(f"{fqn}.{n}", complete(None, axes)) for n, _ in tensors}
    owners, blocks = {}, {}
    if hasattr(spec, "region_layouts"):  # presets that read the module (expert_parallel, routed_experts)
        derived, owned = spec.region_layouts(module, fqn, axes)
        params.update({f"{fqn}.{n}": complete(lay, axes, where) for n, lay in derived.items()})
        owners = {f"{fqn}.{n}": o for n, o in owned.items()}
    if hasattr(spec, "region_blocks"):
        blocks = {f"{fqn}.{n}": b for n, b in spec.region_blocks(module, fqn, axes).items()}
    val = node.meta.get("val")
    names = spec.out_names or ("output",)
    if isinstance(val, (tuple, list)):
        outs = _region_outs(spec, val, where, axes)
    else:
        outs = _named_axes(_pick(spec.out_src, names[0], 0, True, axes), axes, f"{where} out_src")
    return LocalRegion(fqn, pattern, outs, params, owners, spec.compute, spec if hasattr(spec, "region_layouts") else None,
                       spec.style, blocks)


def _region_outs(spec, val, where: str, axes) -> tuple[dict, ...]:
    """The declared layout of every output of a local region returning a tuple.

    ``out_src`` is one layout for all its tensor outputs (a bare layout: they are laid
    out alike), a tuple by position, or a dict by ``out_names``.  A tensor output the
    declaration leaves out is a PlanError that names it: the layout of a local region's
    output is declared, never derived."""
    names = spec.out_names or tuple(str(i) for i in range(len(val)))
    if len(names) != len(val):
        raise PlanError(f"{where}: out_names {tuple(names)} name {len(names)} outputs, but the module returns {len(val)}; "
                        f"give one name per output")
    out_src = spec.out_src
    bare = isinstance(out_src, Placement) or is_layout(out_src, axes)
    if isinstance(out_src, (tuple, list)) and len(out_src) > len(val):
        raise PlanError(f"{where}: out_src has {len(out_src)} layouts, but the module returns {len(val)} outputs {list(names)}; "
                        f"give one layout per output")
    if isinstance(out_src, Mapping) and not bare:
        unknown = [k for k in out_src if k not in names]
        if unknown:
            raise PlanError(f"{where}: out_src names outputs {unknown}, but the module's outputs are {list(names)}; "
                            f"fix the names (or set out_names=)")
    outs = []
    for i, (n, v) in enumerate(zip(names, val)):
        layout = out_src if bare else _pick(out_src, n, i, i == 0, axes)
        if layout is None:
            if not isinstance(v, torch.Tensor):
                outs.append({})  # not a tensor: nothing to lay out
                continue
            by = "by position" if isinstance(out_src, (tuple, list)) else "by name"
            raise PlanError(
                f"{where}: out_src gives no layout for output {n!r} (output {i} of {len(val)}, a tensor); the layout of a "
                f"local region's output is declared, never derived. Fix: give every output a layout {by} "
                f"(e.g. out_src={_example_outs(out_src, names)}), or one layout for all of them (out_src={{...}})")
        outs.append(_named_axes(layout, axes, f"{where} out_src[{n!r}]"))
    return tuple(outs)


def _example_outs(out_src, names) -> str:
    if isinstance(out_src, Mapping):
        return "{" + ", ".join(f"{n!r}: {out_src[n]!r}" if out_src.get(n) is not None else f"{n!r}: {{...}}" for n in names) + "}"
    given = list(out_src) if isinstance(out_src, (tuple, list)) else []
    return "(" + ", ".join(repr(given[i]) if i < len(given) and given[i] is not None else "{...}" for i in range(len(names))) + ")"


def _boundary(node, fqn, name, pattern_spec, mtype, axes) -> Boundary:
    pattern, spec = pattern_spec
    where = f"plan entry {pattern!r} (module {fqn!r})"
    if node.target is region_input:
        params = _forward_params(mtype)
        _check_argument_names(spec, params, mtype, where, axes)
        position = params.index(name) if name in params else None
        first = position == 0 or (position is None and params == [])
        lay = lambda v, what: None if v is None else _named_axes(v, axes, f"{where} {what}[{name!r}]")
        return Boundary(fqn, name, "input",
                        required=lay(_pick(spec.inputs, name, position, first, axes), "inputs"),
                        expected=lay(_pick(spec.in_src, name, position, first, axes), "in_src"))
    position = int(name) if name.isdigit() else (spec.out_names.index(name) if spec.out_names and name in spec.out_names else 0)
    first = position == 0
    lay = lambda v, what: None if v is None else _named_axes(v, axes, f"{where} {what}[{name!r}]")
    return Boundary(fqn, name, "output",
                    src=lay(_pick(spec.out_src, name, position, first, axes), "out_src"),
                    dst=lay(_pick(spec.out_dst, name, position, first, axes), "out_dst"))


def _named_axes(layout, axes, where: str) -> dict:
    """Validate a boundary layout and keep only the axes it names: at a module
    boundary an axis the plan leaves out keeps the layout that arrives (a ``"tp"``
    preset on a dp x tp mesh leaves the batch sharding on ``"dp"`` alone)."""
    full = complete(layout, axes, where)
    named = set(axes) if isinstance(layout, Placement) else set(layout)
    return {a: p for a, p in full.items() if a in named}


def _check_argument_names(spec, params: list[str], mtype, where: str, axes) -> None:
    """Layouts by argument name must name arguments of the module's forward: a name
    that is neither an argument nor a mesh axis would be silently ignored."""
    if not params or _takes_any_keyword(mtype):
        return
    for field_name in ("inputs", "in_src"):
        v = getattr(spec, field_name)
        if isinstance(v, Mapping) and not is_layout(v, axes):
            unknown = [k for k in v if (k >= len(params) if isinstance(k, int) else k not in params)]
            if unknown:
                raise PlanError(f"{where}: {field_name} names {unknown}, which are neither arguments of "
                                f"{mtype.__name__}.forward {params} nor mesh axes {list(axes)}; fix the names "
                                f"(by argument: {{{params[0]!r}: Replicate()}}; one layout: {{{next(iter(axes))!r}: Replicate()}})")


def _takes_any_keyword(mtype) -> bool:
    try:
        sig = inspect.signature(mtype.forward)
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def _forward_params(mtype) -> list[str]:
    if mtype is None:
        return []
    try:
        params = list(inspect.signature(mtype.forward).parameters)
    except (TypeError, ValueError):
        return []
    static = any(isinstance(vars(c).get("forward"), staticmethod) for c in getattr(mtype, "__mro__", ()))
    return params if static else params[1:]  # the instance, whatever its name (``self``, ``s``, ``m``)


def _innermost_planned(node: fx.Node, specs) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    for qualname, _ in reversed(list(stack.values())):
        if qualname in specs:
            return qualname
    if node.op == "get_attr" and "." in node.target:
        owner = node.target.rsplit(".", 1)[0]
        while owner:
            if owner in specs:
                return owner
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
    return None


def _context_parallel_of(node: fx.Node, context_parallel: dict):
    """The FQN of the innermost context-parallel module around ``node``."""
    for qualname, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        if qualname in context_parallel:
            return qualname
    return None


def _has_attr(gm, target: str) -> bool:
    try:
        obj = gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return isinstance(obj, torch.Tensor)
    except AttributeError:
        return False


def _attr_names(gm, fqn: str):
    try:
        mod = gm.get_submodule(fqn)
    except AttributeError:
        return []
    return [n for n, _ in mod.named_parameters()] + [n for n, _ in mod.named_buffers()]


def _check_boundaries_marked(gm, specs) -> None:
    """A called module whose plan entry declares inputs/outputs needs boundary markers
    (``fxshard.trace`` adds them, plain ``torch.fx.symbolic_trace`` does not); without
    them the declaration would be silently ignored."""
    marked = {n.args[1] for n in gm.graph.nodes if n.op == "call_function" and n.target in (region_input, region_output)}
    called = {q for n in gm.graph.nodes for q, _ in (n.meta.get("nn_module_stack") or {}).values()}
    called |= {n.target for n in gm.graph.nodes if n.op == "call_module"}
    for fqn, (pattern, spec) in specs.items():
        users = sorted({u.name for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(fqn + ".")
                        for u in n.users})
        if spec.declares_boundary() and not spec.local and fqn not in called and fqn not in marked and users:
            raise PlanError(f"plan entry {pattern!r} declares the inputs/outputs of module {fqn!r}, but the model never "
                            f"calls it: its parameters are used directly (by {', '.join(f'`{u}`' for u in users)}), so "
                            f"those layouts would not apply. Declare only params= for it and give the layouts on the "
                            f"module that makes the call (ModuleSpec(params=..., out_dst=...)), or call the module")
        if spec.declares_boundary() and not spec.local and fqn in called and fqn not in marked:
            raise PlanError(f"plan entry {pattern!r} declares the inputs/outputs of module {fqn!r}, but the graph has no "
                            f"boundary for them (plain torch.fx.symbolic_trace does not mark module boundaries); trace the "
                            f"model with fxshard.trace(model, plan, example_inputs), or pass the nn.Module to fxshard.transform")


def _check_tied(gm, declared: dict[str, dict], splits: dict[str, tuple[int, ...]]) -> None:
    """Tied parameters (one tensor under several FQNs) must get one layout, and be fused
    the same way (``splits=``): the tensor is sliced once."""
    by_tensor: dict[int, list[str]] = {}
    for fqn, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        by_tensor.setdefault(id(t), []).append(fqn)
    for names in by_tensor.values():
        if len(names) < 2:
            continue
        layouts = {n: declared.get(n) for n in names}
        distinct = {repr(v) for v in layouts.values()}
        if len(distinct) > 1:
            desc = ", ".join(f"{n}: {v if v is not None else 'Replicate (not in plan)'}" for n, v in layouts.items())
            raise PlanError(f"tied parameters {names} get different layouts ({desc}); give every name of a tied "
                            f"parameter the same layout (e.g. shard the LM head like the embedding)")
        fused = {n: splits.get(n) for n in names}
        if len({repr(v) for v in fused.values()}) > 1:
            desc = ", ".join(f"{n}: splits={list(v) if v else None}" for n, v in fused.items())
            raise PlanError(f"tied parameters {names} are fused differently ({desc}); the tensor is sliced once, so "
                            f"give every name the same splits= (or none)")
