"""DTensor's sharding propagation as the layout rule of ops fxshard has no rule for.

DTensor knows how hundreds of aten ops map placements.  For a node with no
hand-written rule and a non-replicated input, fxshard runs the node once on its fake
(global) values under a dispatch mode that records the aten ops it becomes, then
replays DTensor's sharding propagator over that sequence, op by op, starting from the
inputs' layouts.  If every op runs on the layouts it receives, the output layout is
DTensor's; if DTensor would redistribute anywhere, that is a PlanError: fxshard never
inserts communication the plan did not ask for.

Example (what ``propagate`` does for ``torch.cumsum(x, 0)`` with ``x`` ``Shard(1)``)::

    layout = dtensor_layout(ctx)     # {"tp": Shard(1)}: cumsum along an unsharded dim
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from fxshard.layout.placements import fmt_layout
from fxshard.meta import TensorInfo

@functools.lru_cache(maxsize=None)
def offline_mesh(names: tuple[str, ...], sizes: tuple[int, ...]):
    """A DeviceMesh with no process group: DTensor's propagator reads only its shape."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(math.prod(sizes)).view(sizes), mesh_dim_names=names,
                      _init_backend=False, _rank=0)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _run_recorded(node: fx.Node) -> tuple[_Recorder, Any, dict[int, Any]]:
    """Run ``node`` on its inputs' recorded fake values; the aten calls it made."""
    from torch._guards import detect_fake_mode

    vals: dict[int, Any] = {}

    def val(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                vals[id(v)] = a
            return v
        return a

    args = tree_map(val, node.args)
    kwargs = tree_map(val, node.kwargs)
    fake_mode = detect_fake_mode(tree_flatten((args, kwargs))[0])
    rec = _Recorder()
    # torch.set_grad_enabled(torch.is_grad_enabled()): a higher-order op that raises
    # midway would leave grad mode as its body set it
    with torch.set_grad_enabled(torch.is_grad_enabled()), fake_mode or contextlib.nullcontext(), rec:
        if node.op == "call_method":
            out = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            out = node.target(*args, **kwargs)
    return rec, out, vals


def dtensor_layout(ctx) -> dict | list[dict] | None:
    """Output layout(s) of ``ctx.node`` by DTensor's sharding propagation; PlanError
    when DTensor would need to redistribute an input or has no strategy."""
    from fxshard.layout.op_rules import reduce_fix

    node, axes = ctx.node, ctx.axes
    names = tuple(axes)
    mesh = offline_mesh(names, tuple(axes[a] for a in names))
    try:
        rec, out, inputs = _run_recorded(node)
    except Exception as e:  # the op does not run on its recorded values
        raise ctx.fail(f"fxshard has no layout rule for this op, and running it to ask DTensor failed: {type(e).__name__}: {e}",
                       "make its inputs Replicate in the plan, or file an issue for a rule") from None
    placements: dict[int, tuple] = {}
    for vid, src in inputs.items():
        ti = ctx.info_of(src)
        if isinstance(ti, TensorInfo):
            placements[vid] = tuple(ti.layout[a] for a in names)
    propagator = DTensor._op_dispatcher.sharding_propagator
    producers: dict[int, Any] = {}
    for func, args, kwargs, result in rec.calls:
        _propagate_one(ctx, propagator, mesh, names, func, args, kwargs, result, placements, producers, reduce_fix)

    def layout_of(t):
        p = placements.get(id(t), tuple(Replicate() for _ in names))
        for q in p:
            if not (type(q) in (Shard, Replicate) or isinstance(q, Partial)):
                raise ctx.fail(f"DTensor lays out the result of `{producers.get(id(t), node.target)}` as {q}, which fxshard "
                               f"does not represent", "make the inputs of this op Replicate in the plan")
        return dict(zip(names, p))

    if isinstance(out, torch.Tensor):
        return layout_of(out)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return [layout_of(t) for t in out]
    return None


def _propagate_one(ctx, propagator, mesh, names, func, args, kwargs, result, placements, producers, reduce_fix) -> None:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema

    replicate = tuple(Replicate() for _ in names)
    if not any(isinstance(t, torch.Tensor) for t in tree_flatten(result)[0]):
        return  # a query (prim.device, sym sizes): no tensor out, no layout to derive
    ins = [placements.get(id(t), replicate) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if all(all(isinstance(p, Replicate) for p in pl) for pl in ins):
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor):
                placements[id(t)] = replicate
        return

    def spec(t):
        if not isinstance(t, torch.Tensor):
            return t
        return DTensorSpec(mesh, placements.get(id(t), replicate), TensorMeta(t.shape, t.stride(), t.dtype))

    schema = OpSchema(func, tree_map(spec, args), tree_map(spec, kwargs))
    try:
        sharding = propagator.propagate_op_sharding(schema)
    except Exception as e:
        raise ctx.fail(f"fxshard has no layout rule for this op and DTensor has no sharding strategy for `{func}` "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                       "make its inputs Replicate in the plan, move it inside a local region, or file an issue for a rule") from None
    wanted = sharding.redistribute_schema
    want = [dict(zip(names, s.placements)) for s in tree_flatten((wanted.args_schema, wanted.kwargs_schema))[0]
            if isinstance(s, DTensorSpec)] if wanted is not None else []
    have = [dict(zip(names, p)) for p in ins]
    if sharding.needs_redistribute and want != have:  # (equal placements: only tensor metadata differs)
        partial = [a for pl in have for a, p in pl.items() if isinstance(p, Partial)]
        fix = reduce_fix(partial[0]) if partial else (
            "declare layouts in the plan so that this op receives " + "; ".join(fmt_layout(w) for w in want)
            + " (at the producing module's boundary), or make the inputs Replicate")
        raise ctx.fail(f"`{func}` cannot run on the layouts it receives: DTensor would redistribute its inputs "
                       f"from {'; '.join(fmt_layout(h) for h in have)} to {'; '.join(fmt_layout(w) for w in want)}, "
                       f"and fxshard inserts no communication the plan did not ask for", fix)
    out_specs = sharding.output_spec
    outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    specs = [s for s in tree_flatten(out_specs)[0] if isinstance(s, DTensorSpec)] if out_specs is not None else []
    for t, s in zip(outs, specs):
        # an intermediate may be laid out in ways fxshard does not represent (einsum's
        # _StridedShard between its views): only the node's own outputs are checked
        placements[id(t)] = tuple(s.placements)
        producers[id(t)] = func
