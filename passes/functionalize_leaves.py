"""functionalize_leaves: leaf modules that own parameters become functional calls.

``call_module`` nodes of ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.RMSNorm`` (and the parameter-free ``nn.Dropout`` and activation modules) are
replaced by their ``torch.nn.functional`` form with ``get_attr`` inputs, so every use
of a parameter is an edge later passes can see and rewrite.  Any other ``torch.nn``
leaf that owns no parameter or buffer (``nn.Identity``, ``nn.Flatten``,
``nn.Softmax``, a loss module ...) is a pure function of its inputs: its forward,
traced on its own, is inlined in its place (``nn.Identity`` leaves no node at all),
so layouts flow through it; one whose forward fx cannot trace stays a leaf.  A
planned leaf module that declares inputs or outputs gets
``region_input``/``region_output`` markers around its functional call, the same
markers ``fxshard.trace`` puts around planned modules it traces through.  A local
region (``ModuleSpec(local=True)``) stays a ``call_module``, with markers on its
tensor arguments and outputs.

Reads:  ``node.meta["nn_module_stack"]``, the plan (which modules declare boundaries).
Writes: new nodes inherit ``nn_module_stack``, ``stack_trace`` and ``val`` of the
        ``call_module`` they replace.  No ``node.meta["fxshard"]`` field.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxshard.meta import PassContext
from fxshard.markers import region_input, region_output
from fxshard.errors import PlanError
from fxshard.state.module_state import drop_unused_modules

_ACTIVATIONS = {nn.ReLU: F.relu, nn.GELU: F.gelu, nn.SiLU: F.silu, nn.Tanh: F.tanh, nn.Sigmoid: F.sigmoid}


def _functional(graph: fx.Graph, node: fx.Node, mod: nn.Module, x: fx.Node):
    """Emit the functional call for ``mod(x)`` before ``node``; None if unknown."""
    fqn = node.target

    def param(name):
        return graph.get_attr(f"{fqn}.{name}") if getattr(mod, name, None) is not None else None

    if isinstance(mod, nn.Linear):
        return graph.call_function(F.linear, (x, param("weight"), param("bias")))
    if isinstance(mod, nn.Embedding):
        return graph.call_function(F.embedding, (x, param("weight")), {
            "padding_idx": mod.padding_idx, "max_norm": mod.max_norm, "norm_type": mod.norm_type,
            "scale_grad_by_freq": mod.scale_grad_by_freq, "sparse": mod.sparse})
    if isinstance(mod, nn.LayerNorm):
        return graph.call_function(F.layer_norm, (x, tuple(mod.normalized_shape), param("weight"), param("bias"), mod.eps))
    if isinstance(mod, nn.RMSNorm):
        return graph.call_function(F.rms_norm, (x, tuple(mod.normalized_shape), param("weight"), mod.eps))
    if isinstance(mod, nn.Dropout):
        return graph.call_function(F.dropout, (x, mod.p, mod.training, mod.inplace))
    if isinstance(mod, nn.GELU):
        return graph.call_function(F.gelu, (x,), {"approximate": mod.approximate})
    for cls, fn in _ACTIVATIONS.items():
        if type(mod) is cls:
            return graph.call_function(fn, (x,))
    return None


def _has_functional_form(mod: nn.Module) -> bool:
    """Does ``_functional`` know ``mod``?"""
    return (isinstance(mod, (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.GELU))
            or type(mod) in _ACTIVATIONS)


def functionalize_leaves(gm: fx.GraphModule, ctx: PassContext) -> None:
    """The pass: every leaf module of ``gm`` as a functional call (in place)."""
    functionalize(gm, ctx.plan)


def functionalize(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Rewrite parameter-owning leaf modules into functional calls (in place); ``plan``
    (optional) says which modules are local regions or declare boundaries."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and plan is not None and _is_local_region(plan, node.target):
            _mark_local_region(graph, node, gm.get_submodule(node.target), plan.match(node.target)[1])
            continue
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        hit = plan.match(node.target) if plan is not None else None
        spec = hit[1] if hit else None
        if spec is not None and spec.local:
            continue  # opaque region: stays a call_module
        if len(node.args) != 1 or node.kwargs or not _has_functional_form(mod):
            _inline_pure_leaf(graph, node, mod, spec)
            continue
        first_new = node.prev  # the nodes made below land between it and ``node``
        with graph.inserting_before(node):
            x = node.args[0]
            marked = spec is not None and spec.declares_boundary()
            if marked:
                arg_name = next(iter(inspect.signature(mod.forward).parameters))
                x = graph.call_function(region_input, (x, node.target, arg_name))
            new = _functional(graph, node, mod, x)
            if new is None:
                if marked:
                    graph.erase_node(x)
                continue
            out = graph.call_function(region_output, (new, node.target, "output")) if marked else new
        for n in _nodes_between(first_new.next, out):
            n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
            if "val" in node.meta and n.op != "get_attr":
                n.meta["val"] = node.meta["val"] if n is not x else node.args[0].meta.get("val")
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    drop_unused_modules(gm)  # the replaced leaves; their parameters stay
    gm.recompile()
    return gm


def _is_pure_leaf(mod: nn.Module) -> bool:
    """A module that torch.fx keeps as a leaf (it comes from ``torch.nn``) but that owns
    no parameter, no buffer and no hook: what it computes depends on its inputs only."""
    return (fx.Tracer().is_leaf_module(mod, "") and next(mod.parameters(), None) is None
            and next(mod.buffers(), None) is None and not mod._forward_hooks and not mod._forward_pre_hooks)


_SPECIALIZATION_CHECKS = (torch._assert, fx._symbolic_trace._assert_is_none)


def _inline_pure_leaf(graph: fx.Graph, node: fx.Node, mod: nn.Module, spec) -> bool:
    """Replace the call of a parameter-free ``torch.nn`` leaf by its forward, traced on
    its own (arguments that are not graph values are fixed as constants), with shapes
    recorded on the fake values of its inputs.  False, and the call left as it is,
    when the forward does not trace, reads a tensor attribute, calls a submodule, or
    (for a planned module with a boundary) returns something other than one tensor."""
    if not _is_pure_leaf(mod):
        return False
    sig = inspect.signature(mod.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        return False
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    args = bound.arguments
    constants = {k: v for k, v in args.items() if not isinstance(v, fx.Node)}
    if any(_holds_node(v) for v in constants.values()):
        return False
    try:
        body = fx.Tracer().trace(mod, concrete_args=constants or None)
    except Exception:  # control flow on its inputs (nn.Softmax2d): it stays a leaf
        return False
    for n in list(body.nodes):  # the checks that the constants keep their value: they do, by construction
        if n.op == "call_function" and n.target in _SPECIALIZATION_CHECKS:
            body.erase_node(n)
    body.eliminate_dead_code()
    if any(n.op in ("get_attr", "call_module") for n in body.nodes):
        return False
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    result = next(n for n in body.nodes if n.op == "output").args[0]
    marked = spec is not None and spec.declares_boundary()
    if not isinstance(result, fx.Node) or (marked and not isinstance(node.meta.get("val"), torch.Tensor)):
        return False
    inputs = [args[p] for p in sig.parameters]
    if len(placeholders) != len(inputs) or (result.op == "placeholder" and not isinstance(inputs[placeholders.index(result)], fx.Node)):
        return False
    if not _record_body_shapes(mod, body, inputs):
        return False
    fqn = node.target
    env: dict[fx.Node, object] = {}
    with graph.inserting_before(node):
        for ph, (name, value) in zip(placeholders, args.items()):
            if marked and isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                value = _marker(graph, region_input, value, fqn, name, node)
            env[ph] = value
        for n in body.nodes:
            if n.op in ("placeholder", "output"):
                continue
            new = graph.node_copy(n, lambda a: env[a])
            if "_stacklevel" in new.kwargs:  # where F.softmax's deprecation warning points: noise in the code
                new.kwargs = {k: v for k, v in new.kwargs.items() if k != "_stacklevel"}
            new.meta = {k: v for k, v in n.meta.items() if k == "val"}
            new.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
            env[n] = new
        out = env[result]
        if marked:
            out = _marker(graph, region_output, out, fqn, (spec.out_names or ("output",))[0], node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


def _holds_node(value) -> bool:
    found = []
    fx.node.map_arg(value, lambda n: found.append(n))
    return bool(found)


def _record_body_shapes(mod: nn.Module, body: fx.Graph, inputs: list) -> bool:
    """``meta["val"]`` of the inlined nodes, from the fake values of the call's inputs
    (none when the graph has no recorded shapes); False if the body does not run on them."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    vals = [x.meta.get("val") if isinstance(x, fx.Node) else x for x in inputs]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None or any(isinstance(x, fx.Node) and "val" not in x.meta for x in inputs):
        return True
    try:
        FakeTensorProp(fx.GraphModule(mod, body), mode).propagate_dont_convert_inputs(*vals)
    except Exception:  # it does not run on fake tensors: it stays a leaf, run as recorded
        return False
    return True


def _is_local_region(plan, fqn: str) -> bool:
    hit = plan.match(fqn)
    return hit is not None and hit[1].local


def _mark_local_region(graph: fx.Graph, node: fx.Node, mod: nn.Module, spec) -> None:
    """An opaque region stays a ``call_module``; each tensor argument gets a
    ``region_input`` and each tensor output a ``region_output`` marker, so the layouts
    at its entry and exit are redistributed like at any module boundary."""
    fqn = node.target
    try:
        bound = inspect.signature(mod.forward).bind(*node.args, **node.kwargs)
    except TypeError as e:
        raise PlanError(f"local region {fqn!r}: cannot bind its call to forward{inspect.signature(mod.forward)}: {e}") from e
    for name, value in list(bound.arguments.items()):
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            with graph.inserting_before(node):
                bound.arguments[name] = _marker(graph, region_input, value, fqn, name, node)
    node.args, node.kwargs = tuple(bound.args), dict(bound.kwargs)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        _mark_output(graph, node, fqn, (spec.out_names or ("output",))[0], node)
    elif isinstance(val, (tuple, list)):
        names = spec.out_names or tuple(str(i) for i in range(len(val)))
        for user in list(node.users):
            if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
                raise PlanError(f"local region {fqn!r} returns a tuple that node `{user.name}` uses whole; unpack its "
                                f"outputs (a, b = region(x)) so each gets its declared layout")
            if isinstance(user.meta.get("val"), torch.Tensor):
                _mark_output(graph, user, fqn, names[user.args[1]], node)


def _mark_output(graph, value: fx.Node, fqn: str, name: str, region: fx.Node) -> None:
    with graph.inserting_after(value):
        marker = _marker(graph, region_output, value, fqn, name, region)
    value.replace_all_uses_with(marker, delete_user_cb=lambda user: user is not marker)


def _marker(graph, fn, value: fx.Node, fqn: str, name: str, region: fx.Node) -> fx.Node:
    marker = graph.call_function(fn, (value, fqn, name))
    marker.meta.update({k: region.meta[k] for k in ("nn_module_stack", "stack_trace") if k in region.meta})
    marker.meta["val"] = value.meta.get("val")
    return marker


def _nodes_between(first: fx.Node, last: fx.Node):
    n = first
    while True:
        yield n
        if n is last:
            return
        n = n.next
