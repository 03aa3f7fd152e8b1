"""local_regions: each opaque region becomes its own sub-GraphModule, run on local tensors.

A local region (``ModuleSpec(local=True)``, ``fxshard.expert_parallel``) is one
``call_module`` node of the transformed graph.  This pass decides what runs there:

* the region's forward (or the user's ``compute=fn``, or fxshard's own block forward
  for ``expert_parallel(router=...)``) is traced by torch.fx from the region module
  and *carved* into a sub-GraphModule that replaces the module under the same FQN
  (children keep their FQNs, so ``state_dict`` keys do not change).  Children fx
  cannot trace (data-dependent Python, ``.tolist()``) and the experts of an
  expert-parallel region stay leaf ``call_module`` s.  ``fxshard.dump(gm,
  recursive=True)`` shows the carved graph.
* when the forward itself cannot be traced, the module runs as is (with ``compute``
  in place of its forward).

Replicated parameters of the region get their gradients summed over the axes on
which the region's input is sharded (the grad-sync rule outside regions).  One the
carved graph reads (a ``get_attr``) becomes an input of the carved graph: the outer
graph reads the parameter, passes it through ``grad_sync`` and hands it to the call,
so that its sync is bucketed with the others (``bucket_grad_syncs``).  A parameter
used only inside a leaf child, or in a region that runs as is, enters that module's
forward through ``grad_sync`` (the module's class gains a forward wrapper, see
:func:`fxshard.runtime.moe.with_grad_sync`).

Routed experts (:func:`fxshard.routed_experts`) always run as is, on their local weights:
HF's experts run fxshard's grouped GEMMs over the rank's (token, choice) rows
(:func:`fxshard.runtime.routed_experts.grouped_experts_forward`, whatever kernel the config
names; never a gather of an expert's weights per row), other modules their own forward; under
``ep`` with the routing pointed at this rank's experts
(:func:`fxshard.runtime.routed_experts.local_experts_forward`); first the plan entry's sharding is
checked by running one of its modules on its shards
(:func:`fxshard.runtime.routed_experts.sharding_error`).

A ``compute`` function is checked against the module's forward
(:func:`fxshard.runtime.moe.check_compute_signature`) and the region's call is re-bound to
its parameters.  Module-list experts (``router=``) become an
:class:`fxshard.runtime.moe.ExpertList` with the same FQNs.

Reads:  ``.declared`` (:class:`~fxshard.meta.LocalRegion`) and ``.value`` of the
        region's inputs.
Writes: the region's submodule; in a carved graph every node's ``.region``, the
        ``.value`` of ``get_attr`` nodes; in the outer graph the ``get_attr`` and
        ``grad_sync`` nodes (with ``.collective``) of lifted parameters,
        ``nn_module_stack`` with absolute FQNs; ``ProgramMeta.mesh`` and ``.region`` of
        the carved graph; ``.extra["region"]`` = ``"carved"`` or ``"as is: <why>"`` on
        the region's node.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from fxshard.runtime import collectives
from fxshard.errors import PlanError, SignatureMismatchError
from fxshard.layout.placements import local_shape, uneven_dims
from fxshard.meta import Collective, LocalRegion, TensorInfo, info, tensor_info
from fxshard.runtime.routed_experts import (RoutedExpertsSpec, dispatched_experts_forward, local_experts_forward,
                                            sharding_error, use_grouped_experts)
from fxshard.runtime.moe import ExpertList, check_compute_signature, routed_forward, swap_forward, with_compute, with_grad_sync

from fxshard.passes.functionalize_leaves import functionalize
from fxshard.passes.outline_regions import outline
from fxshard.meta import PassContext, program_meta
from fxshard.state.module_state import attribute


def local_regions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Carve every local region into a sub-GraphModule, or keep it as is (in place)."""
    axes = ctx.axes
    checked: set[str] = set()
    for node in list(gm.graph.nodes):
        region = info(node).declared
        if node.op != "call_module" or not isinstance(region, LocalRegion):
            continue
        module = gm.get_submodule(node.target)
        _refuse_uneven(gm, node, region, axes)
        if isinstance(module, fx.GraphModule) and program_meta(module).region == region.fqn:
            info(node).extra["region"] = "carved"  # a module called twice: carved at its first call
            _pass_lifted(gm, node, region, program_meta(module).lifted, axes)
            continue
        if isinstance(region.experts, RoutedExpertsSpec):
            if region.pattern not in checked:  # the layers a plan entry matches are alike: check one
                checked.add(region.pattern)
                _check_routed_experts(node, module, region, axes)
            _routed_experts(module, region, axes, _grad_syncs(gm, node, region, ctx.fsdp_axes))
            info(node).extra["region"] = "as is: routed experts (their loop over the chosen experts is data-dependent)"
            continue
        forward = _forward(node, module, region)
        syncs = _grad_syncs(gm, node, region, ctx.fsdp_axes)
        if isinstance(module, fx.GraphModule):  # outlined from an inline trace: already a graph
            if forward is not None:
                raise PlanError(f"local region {region.fqn!r} was traced inline (plain torch.fx.symbolic_trace), so its module "
                                f"is gone and its compute function / router cannot run on it; trace the model with "
                                f"fxshard.trace(model, plan, example_inputs) or pass the nn.Module to fxshard.transform")
            carved, why = module, None
            functionalize(carved)
        else:
            carved, why = _carve(module, forward, _forced_leaves(region))
        if carved is None:
            _run_as_is(module, forward, {_relative(f, region.fqn): a for f, a in syncs.items()})
            info(node).extra["region"] = f"as is: {why}"
            continue
        _record_local_shapes(carved, node)
        if region.experts is not None and _outline_experts(carved, region):
            _record_local_shapes(carved, node)
        lifted = _sync_in_graph(carved, region, syncs)
        _annotate(carved, region, axes)
        program_meta(carved, create=True).lifted = lifted
        _pass_lifted(gm, node, region, lifted, axes)
        _set_submodule(gm, node.target, carved)
        info(node).extra["region"] = "carved"
    return


# --------------------------------------------------------------------------- what runs


def _forward(node: fx.Node, module: nn.Module, region: LocalRegion):
    """The function that replaces the module's forward, if any (re-binding the call)."""
    if region.compute is not None:
        check_compute_signature(module, region.compute, region.fqn)
        _rebind_call(node, module, region.compute, region.fqn)
        return region.compute
    spec = region.experts
    if spec is None or spec.router is None:
        return None
    experts = getattr(module, spec.experts)
    if isinstance(experts, nn.ModuleList):
        setattr(module, spec.experts, ExpertList.from_list(experts))  # same FQNs, grouped call convention
    elif isinstance(experts, nn.ModuleDict) and not isinstance(experts, ExpertList):
        setattr(module, spec.experts, ExpertList(dict(experts.items())))
    tensors = [a for a in list(node.args) + list(node.kwargs.values()) if tensor_info(a) is not None]
    if len(tensors) != 1 or len(node.args) + len(node.kwargs) != 1:
        raise PlanError(f"expert_parallel(router=...) on {region.fqn!r}: fxshard runs the block as forward(module, x) and "
                        f"the block is called with {len(node.args) + len(node.kwargs)} arguments; give the block one "
                        f"input, or route in the block's own forward and drop router=")
    node.args, node.kwargs = tuple(node.args) + tuple(node.kwargs.values()), {}
    return routed_forward(spec, spec.n_experts(module))


def _rebind_call(node: fx.Node, module: nn.Module, fn, fqn: str) -> None:
    """Call ``fn``'s parameters by name with what the graph passes to the forward;
    forward defaults fill the ones the call leaves out."""
    fwd = inspect.signature(module.forward)
    bound = fwd.bind(*node.args, **node.kwargs)
    params = list(inspect.signature(fn).parameters.values())[1:]
    accepted = {p.name for p in params}
    for name in bound.arguments:
        if name not in accepted:
            raise SignatureMismatchError(f"compute function {getattr(fn, '__qualname__', fn)!r} of local region {fqn!r}: the model "
                            f"passes {name!r} to the region (node `{node.name}`), which the function does not accept")
    args, kwargs = [], {}
    for p in params:
        if p.name in bound.arguments:
            value = bound.arguments[p.name]
        elif fwd.parameters[p.name].default is not inspect.Parameter.empty:
            value = fwd.parameters[p.name].default
        else:
            continue
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[p.name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _forced_leaves(region: LocalRegion) -> set[str]:
    return {region.experts.experts} if region.experts is not None else set()


class _RegionTracer(fx.Tracer):
    """Traces a region from its own module: FQNs relative to the region."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def _trace(module: nn.Module, forward, leaves: set[str]) -> fx.Graph:
    cls = type(module)
    if forward is not None:  # trace fn(module, ...) as if it were the forward
        module.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    try:
        return _RegionTracer(leaves).trace(module)
    finally:
        module.__class__ = cls


def _leaves(module: nn.Module, forced: set[str]) -> set[str]:
    """Children the region's tracer keeps as leaves: the forced ones and those fx cannot
    trace, deepest first (a traceable parent of an untraceable child is still traced)."""
    leaves = set(forced)
    children = [(name, m) for name, m in module.named_modules() if name]
    for name, m in sorted(children, key=lambda nm: -nm[0].count(".")):
        if any(name == l or name.startswith(l + ".") for l in leaves):
            continue
        if fx.Tracer().is_leaf_module(m, name):
            continue
        inner = {l[len(name) + 1:] for l in leaves if l.startswith(name + ".")}
        try:
            _trace(m, None, inner)
        except Exception:
            leaves.add(name)
    return leaves


def _carve(module: nn.Module, forward, forced: set[str]):
    """``(GraphModule, None)``, or ``(None, why)`` when fx cannot trace the region."""
    leaves = _leaves(module, forced)
    try:
        graph = _trace(module, forward, leaves)
    except Exception as e:  # data-dependent Python, .tolist(), ...: the region runs as is
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    carved = fx.GraphModule(module, graph, type(module).__name__)
    # Functional parameter uses (get_attr edges) for the grad syncs; leaves stay modules.
    functionalize(carved)
    return carved, None


def _outline_experts(carved: fx.GraphModule, region: LocalRegion) -> bool:
    """Experts traced inline (in a region outlined from an inline trace) become a call,
    for the expert-parallel pass.  Their inputs in the grouped convention: the float
    tokens, then the integer counts (told apart by the local shapes just recorded)."""
    name = region.experts.experts
    if any(n.op == "call_module" and n.target == name for n in carved.graph.nodes):
        return False

    def order(inputs):
        kinds = [info(a).extra.get("local") for a in inputs]
        floats = [a for a, k in zip(inputs, kinds) if k is not None and k[1].is_floating_point]
        ints = [a for a, k in zip(inputs, kinds) if k is not None and not k[1].is_floating_point and not k[1].is_complex]
        if len(inputs) != 2 or len(floats) != 1 or len(ints) != 1:
            raise PlanError(f"expert_parallel on {region.fqn!r}: its experts {name!r} were traced inline and take "
                            f"{[a.name for a in inputs]}; fxshard needs the grouped convention experts(x, "
                            f"num_tokens_per_expert) (float tokens, integer counts) to find the call. Trace the model "
                            f"with fxshard.trace(model, plan, example_inputs), or pass the nn.Module")
        return floats + ints

    outline(carved, f"{region.fqn}.{name}", name, "Experts", order)
    return True


def _check_routed_experts(node: fx.Node, module: nn.Module, region: LocalRegion, axes: dict[str, int]) -> None:
    """The ranks' shares of routed experts must add up to one device's output (see
    :func:`fxshard.runtime.routed_experts.sharding_error`): a PlanError otherwise."""
    spec: RoutedExpertsSpec = region.experts
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    routed = len(vals) >= 3 and all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in vals[:3])
    if spec.ep is not None and not routed or not all(isinstance(v, torch.Tensor) for v in vals) or node.kwargs:
        raise PlanError(f"routed_experts on {region.fqn!r} (plan entry {region.pattern!r}): the module is called as "
                        f"`{node.format_node()}`; routed experts take (hidden_states [N, H], top_k_index [N, k], "
                        f"top_k_weights [N, k]) positionally (with tp= only, any tensors). Use fxshard.expert_parallel "
                        f"for other MoE blocks")
    why = sharding_error(module, spec, axes, vals, region.fqn)
    if why is not None:
        raise PlanError(f"routed_experts on {region.fqn!r} (plan entry {region.pattern!r}, {spec!r}): {why}. The plan "
                        f"does not shard these experts the way their forward computes: check which dims of each weight "
                        f"the axes {[a for a in (spec.ep, spec.tp) if a]} cut (tp_dims=, packed parts), or that the "
                        f"module skips the sentinel expert num_experts as HF's experts do")


def _routed_experts(module: nn.Module, region: LocalRegion, axes: dict[str, int], syncs: dict[str, tuple[str, ...]]) -> None:
    """Routed experts run their own forward on their local weights; under ``ep`` it sees
    the routing in local expert indices, and the module counts only its own experts (HF's
    experts read ``num_experts`` and skip the sentinel index it makes)."""
    spec: RoutedExpertsSpec = region.experts
    n_local = spec.n_experts(module) // (axes[spec.ep] if spec.ep is not None else 1)
    # HF's experts: grouped GEMMs over the rank's rows, whatever the config's kernel; seeing every token, an ep
    # rank computes the 1/ep of the rows its experts own (the FLOPs counted on meta)
    gathered = spec.ep is not None and spec.dispatch != "all_to_all"
    use_grouped_experts(module, row_share=1 / axes[spec.ep] if gathered else 1.0)
    if spec.ep is not None:
        if hasattr(module, "num_experts"):
            module.num_experts = n_local
        module._is_expert_parallel = True  # HF's grouped/batched kernels mask the sentinel only then
        if spec.dispatch == "all_to_all":
            swap_forward(module, dispatched_experts_forward(spec, spec.n_experts(module), n_local))
        else:
            swap_forward(module, local_experts_forward(spec, n_local))
    if syncs:
        swap_forward(module, with_grad_sync({_relative(f, region.fqn): a for f, a in syncs.items()}))


def _run_as_is(module: nn.Module, forward, syncs: dict[str, tuple[str, ...]]) -> None:
    if forward is not None:
        swap_forward(module, with_compute(forward))
    if syncs:
        swap_forward(module, with_grad_sync(syncs))


# --------------------------------------------------------------------------- gradients


def _grad_syncs(gm: fx.GraphModule, node: fx.Node, region: LocalRegion, fsdp_axes=()) -> dict[str, tuple[str, ...]]:
    """``{parameter FQN: axes}``: replicated trainable parameters of the region, per
    axis on which its input is sharded (each rank holds a share of their gradient).  Not
    on an axis given to FSDP2: its reduce-scatter syncs the parameters there (a second
    sum would count every rank's share twice), as ``insert_grad_syncs`` leaves them too."""
    sharded = []
    for a in node.all_input_nodes:
        ti = tensor_info(a)
        if ti is not None:
            sharded += [axis for axis, p in ti.layout.items() if isinstance(p, Shard) and axis not in sharded]
    params = dict(gm.named_parameters())
    syncs = {}
    for fqn, layout in region.params.items():
        p = params.get(fqn)
        if p is None or not p.requires_grad or any(fqn.startswith(child + ".") for child in region.owners):
            continue
        axes = tuple(a for a in layout if a in sharded and isinstance(layout[a], Replicate) and a not in fsdp_axes)
        if axes:
            syncs[fqn] = axes
    return syncs


def _sync_in_graph(carved: fx.GraphModule, region: LocalRegion, syncs: dict[str, tuple[str, ...]]) -> list[tuple[str, tuple[str, ...], str]]:
    """Parameters the carved graph reads (``get_attr``) and whose gradients need a sync
    become inputs of the carved graph (returned as ``(FQN, axes, input name)``: the
    caller passes them synced, by name); those of module-list experts, which live on one
    rank each, get a ``grad_sync`` in the carved graph; parameters used only inside a
    leaf child enter that child's forward through ``grad_sync``."""
    graph = carved.graph
    done = set()
    lifted: list[tuple[str, tuple[str, ...]]] = []
    last_input = next((n for n in reversed(graph.nodes) if n.op == "placeholder"), None)
    for node in list(graph.nodes):
        fqn = f"{region.fqn}.{node.target}" if node.op == "get_attr" else None
        if fqn not in syncs:
            continue
        done.add(fqn)
        if any(fqn.startswith(child + ".") for child in region.owners):
            # a module-list expert lives on one rank: the outer graph of the others cannot read it
            users, x = list(node.users), node
            for axis in syncs[fqn]:
                with graph.inserting_after(x):
                    x = graph.call_function(collectives.grad_sync, (x, axis))
                m = info(x)
                m.collective = Collective("grad_sync", axis, "identity", "all-reduce", f"grad of {fqn}")
                m.region = region.fqn
            for user in users:
                user.replace_input_with(node, x)
            continue
        if last_input is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                x = graph.placeholder(f"{node.name}_synced")
        else:
            with graph.inserting_after(last_input):
                x = graph.placeholder(f"{node.name}_synced")
        last_input = x
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        lifted.append((fqn, syncs[fqn], x.target))
    leaf_syncs: dict[str, dict[str, tuple[str, ...]]] = {}
    leaves = {n.target for n in graph.nodes if n.op == "call_module"}
    for fqn, axes in syncs.items():
        if fqn in done:
            continue
        rel = _relative(fqn, region.fqn)
        owner = max((l for l in leaves if rel.startswith(l + ".")), key=len, default=None)
        if owner is not None:
            leaf_syncs.setdefault(owner, {})[rel[len(owner) + 1:]] = axes
    for owner, names in leaf_syncs.items():
        swap_forward(carved.get_submodule(owner), with_grad_sync(names))
    graph.lint()
    return lifted


def _refuse_uneven(gm: fx.GraphModule, node: fx.Node, region: LocalRegion, axes: dict[str, int]) -> None:
    """A local region runs its own code on local tensors, sized for equal pieces (its
    experts' slices, its all-to-all rows): a tensor its axes cut unequally is refused."""
    own = dict(gm.named_parameters(remove_duplicate=False))
    own.update(gm.named_buffers(remove_duplicate=False))
    tensors = [(f"parameter {fqn!r}", tuple(own[fqn].shape), layout) for fqn, layout in region.params.items() if fqn in own]
    tensors += [(f"input `{a.name}`", tuple(t.shape), t.layout) for a in node.all_input_nodes
                if isinstance(t := tensor_info(a), TensorInfo)]
    for what, shape, layout in tensors:
        for d, axis in uneven_dims(shape, layout, axes).items():
            raise PlanError(f"local region {region.fqn!r}: {what} of shape {list(shape)} is sharded on {axis!r} along "
                            f"dim {d} in unequal pieces, which a local region cannot take\n  fix: use sizes {axis!r} "
                            f"divides ({shape[d]} is not a multiple of {axes[axis]}), or shard another dim")


def _pass_lifted(gm: fx.GraphModule, call: fx.Node, region: LocalRegion, lifted: list[tuple[str, tuple[str, ...], str]],
                 axes: dict[str, int]) -> None:
    """The outer graph reads each lifted parameter, syncs its gradient and passes it to
    the region's call by the name of the carved graph's input."""
    graph = gm.graph
    extra = {}
    for fqn, sync_axes, name in lifted:
        t = gm.get_parameter(fqn)
        layout = region.params[fqn]
        value = TensorInfo(layout, tuple(t.shape), local_shape(t.shape, layout, axes), t.dtype, t.requires_grad)
        with graph.inserting_before(call):
            x = graph.get_attr(fqn)
        _outer_meta(x, call, value, "parameter of a local region")
        for axis in sync_axes:
            with graph.inserting_before(call):
                x = graph.call_function(collectives.grad_sync, (x, axis))
            _outer_meta(x, call, value, "grad sync")
            info(x).collective = Collective("grad_sync", axis, "identity", "all-reduce", f"grad of {fqn}")
        extra[name] = x
    call.kwargs = {**call.kwargs, **extra}


def _outer_meta(node: fx.Node, call: fx.Node, value: TensorInfo, rule: str) -> None:
    m = info(node)
    m.value, m.rule, m.region = value, rule, info(call).region
    node.meta["nn_module_stack"] = dict(call.meta.get("nn_module_stack") or {})
    if call.meta.get("stack_trace"):
        node.meta["stack_trace"] = call.meta["stack_trace"]


# --------------------------------------------------------------------------- metadata


class _LocalShapes(fx.Interpreter):
    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            info(n).extra["local"] = (tuple(out.shape), out.dtype)
        return out


def _record_local_shapes(carved: fx.GraphModule, node: fx.Node) -> None:
    """Run the carved graph once on zeros of the region's local input shapes (one
    device's semantics: no collective is in it yet) and keep each tensor's local
    shape in ``.extra["local"]``.  The all-to-alls inserted next are sized from them
    (the rows a rank sends do not depend on the routing).  Best effort: a region that
    takes sizes computed outside, or fails on zeros, just has no sizes."""
    def zeros(a):
        ti = tensor_info(a)
        if ti is not None:
            return torch.zeros(ti.local_shape, dtype=ti.dtype)
        if isinstance(a, fx.Node):
            raise ValueError("a non-tensor value computed in the graph")
        return a

    try:
        bound = inspect.signature(carved.forward).bind(*map(zeros, node.args), **{k: zeros(v) for k, v in node.kwargs.items()})
        bound.apply_defaults()
        with torch.no_grad():
            _LocalShapes(carved).run(*bound.args)
    except Exception:
        for n in carved.graph.nodes:
            info(n).extra.pop("local", None)


def _annotate(carved: fx.GraphModule, region: LocalRegion, axes: dict[str, int]) -> None:
    """Metadata for dumps: absolute FQNs, the region, parameter layouts."""
    for node in carved.graph.nodes:
        m = info(node)
        m.region = region.fqn
        stack = node.meta.get("nn_module_stack")
        if stack and not any(q == region.fqn or q.startswith(region.fqn + ".") for q, _ in stack.values()):
            node.meta["nn_module_stack"] = {k: (_absolute(q, region.fqn), t) for k, (q, t) in stack.items()}
        if node.op == "get_attr":
            fqn = f"{region.fqn}.{node.target}"
            t = attribute(carved, node.target)
            layout = region.params.get(fqn)
            if isinstance(t, torch.Tensor) and layout is not None:
                m.value = TensorInfo(layout, tuple(t.shape), local_shape(t.shape, layout, axes), t.dtype, t.requires_grad)
    program = program_meta(carved, create=True)
    program.mesh, program.region = dict(axes), region.fqn
    carved.recompile()


def _absolute(qualname: str, fqn: str) -> str:
    return f"{fqn}.{qualname}" if qualname else fqn


def _relative(fqn: str, region: str) -> str:
    return fqn[len(region) + 1:]


def _set_submodule(gm: fx.GraphModule, fqn: str, module: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)
