"""``fxshard.auto_plan``: a Megatron plan found in the captured graph.

The model is captured once (:func:`fxshard.trace`, any front end) and its graph read
for the structure a hand-written tensor-parallel plan encodes:

* **projection pairs**: a row-parallel projection ``r`` and the projections ``U`` its
  input is computed from (q/k/v -> o, gate/up -> down, c_attn -> c_proj), when every
  projection of ``U`` feeds ``r`` only: ``U`` colwise, ``r`` rowwise.  Nothing between
  them mixes the sharded width, or ``transform`` would refuse the candidate;
* **fused projections**: a ``U`` member whose output is split, chunked or sliced into
  parts along its width (Phi-3's ``qkv[..., :q]``, GPT-2's ``c_attn.split``) is
  sharded part by part (``colwise(splits=...)``);
* **norms over the projected width** (OLMo2's q/k norms): :func:`fxshard.distributed_norm`,
  or the projection gathered before the norm, whichever communicates less;
* **vocab layers**: the token embedding (vocab-parallel) and the LM head (colwise,
  gathered or kept vocab-sharded for loss parallelism).

Every candidate is checked by running ``transform`` on the captured graph; among the
variants of a pattern that transform, the one with the fewest bytes per training step
in :func:`fxshard.comm_summary` is kept, and a pattern no variant of which transforms
is left replicated.  The result is an ordinary :class:`fxshard.Plan`; ``print(plan)``
adds a comment per entry saying what was found and what it costs.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.tensor import Replicate, Shard

from fxshard.errors import PlanError
from fxshard.plan.mesh import MeshSpec, mesh_shape
from fxshard.plan.plan import Plan
from fxshard.plan.specs import ModuleSpec, colwise, distributed_norm, rowwise, vocab_parallel
from fxshard.plan.specs import sequence_parallel as sequence_parallel_spec
from fxshard.layout.op_rules import measures


class AutoPlan(Plan):
    """A :class:`Plan` that remembers why: ``why[pattern]`` is a line per entry,
    ``considered`` the variants tried with their bytes per step (or why they failed),
    ``left_whole[pattern]`` why each module that holds weights auto_plan could have
    sharded is left replicated (a projection with no partner, a pattern every variant of
    which ``transform`` refused, a module fxshard cannot see inside ...).
    It prints as the code that builds it, one comment per entry, then what it left whole.

    Example::

        plan = fxshard.auto_plan(model, mesh, (ids,))
        for pattern, why in plan.left_whole.items():
            print(pattern, "stays replicated:", why)
    """

    why: dict[str, str]
    considered: list[str]
    left_whole: dict[str, str]

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={n}" for a, n in self.axes.items())
        out = [f"# fxshard.auto_plan on a mesh ({axes})", "plan = fxshard.Plan(mesh, {"]
        for pattern, spec in self.specs.items():
            line = f"    {pattern!r}: {_as_code(spec)},"
            why = getattr(self, "why", {}).get(pattern)
            out.append(f"{line}  # {why}" if why else line)
        out.append("})")
        left = getattr(self, "left_whole", {})
        if left:
            out.append("# left replicated (module: why):")
            by_reason: dict[str, list[str]] = {}
            for pattern, why in left.items():
                by_reason.setdefault(why, []).append(pattern)
            out += [f"#   {', '.join(map(repr, patterns))}: {why}" for why, patterns in by_reason.items()]
        considered = getattr(self, "considered", [])
        if considered:
            out.append("# considered (the whole plan so far, one training step, by comm_summary):")
            out += [f"#   {c}" for c in considered]
        return "\n".join(out)


def _placement_code(p) -> str:
    return f"Shard({p.dim})" if isinstance(p, Shard) else "Replicate()" if isinstance(p, Replicate) else repr(p)


def _as_code(spec: ModuleSpec) -> str:
    """The preset call that builds ``spec`` (checked by building it), else the spelled-out ModuleSpec."""
    from fxshard.plan.specs import sequence_parallel as seq_norm

    axis = next(iter(spec.params.get("weight", {}) or spec.inputs or spec.out_src or {}), None)
    if isinstance(axis, str):
        def arg(name, value, default):
            return [] if value == default else [f"{name}={_placement_code(value)}"]

        get = lambda layout, default: (layout or {}).get(axis, default)  # noqa: E731
        calls = {
            "colwise": lambda: (colwise(axis, inputs=get(spec.in_src, Replicate()), out=get(spec.out_dst, Shard(-1)),
                                        splits=list(spec.splits) if spec.splits else None, heads=spec.heads),
                                arg("inputs", get(spec.in_src, Replicate()), Replicate()) + arg("out", get(spec.out_dst, Shard(-1)), Shard(-1))
                                + ([f"splits={list(spec.splits)}"] if spec.splits else [])
                                + ([f"heads={spec.heads}"] if spec.heads else [])),
            "rowwise": lambda: (rowwise(axis, inputs=get(spec.in_src, Shard(-1)), out=get(spec.out_dst, Replicate())),
                                arg("inputs", get(spec.in_src, Shard(-1)), Shard(-1)) + arg("out", get(spec.out_dst, Replicate()), Replicate())),
            "vocab_parallel": lambda: (vocab_parallel(axis, out=get(spec.out_dst, Replicate())),
                                       arg("out", get(spec.out_dst, Replicate()), Replicate())),
            "distributed_norm": lambda: (distributed_norm(axis, get(spec.inputs, Shard(-1)).dim), []
                                         if get(spec.inputs, Shard(-1)).dim == -1 else [f"dim={get(spec.inputs, Shard(-1)).dim}"]),
            "sequence_parallel": lambda: (seq_norm(axis, get(spec.inputs, Shard(1)).dim), []
                                          if get(spec.inputs, Shard(1)).dim == 1 else [f"dim={get(spec.inputs, Shard(1)).dim}"]),
        }
        if spec.style in calls:
            built, args = calls[spec.style]()
            if built == spec:
                return f"fxshard.{spec.style}(" + ", ".join([repr(axis)] + args) + ")"
    fields = []
    for name in ("params", "inputs", "in_src", "out_src", "out_dst"):
        v = getattr(spec, name)
        if v:
            fields.append(f"{name}=" + _layouts_code(v))
    if spec.style:
        fields.append(f"style={spec.style!r}")
    return "fxshard.ModuleSpec(" + ", ".join(fields) + ")"


def _layouts_code(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_layouts_code(x)}" for k, x in v.items()) + "}"
    return _placement_code(v)


@dataclass
class _Projection:
    fqn: str
    node: fx.Node  # the F.linear
    width: int  # out features
    users: set = field(default_factory=set)  # projections reached from the output without passing another
    to_output: bool = False


@dataclass
class _Group:
    """One pattern of the plan and its variants (name -> {fqn: spec}), best first."""

    what: str
    variants: list[tuple[str, dict[str, ModuleSpec]]]


def auto_plan(model: nn.Module, mesh, example_inputs: Sequence[Any] = (), example_kwargs: dict | None = None, *,
              axis: str = "tp", sequence_parallel: bool = False, loss_parallel: bool = False,
              vocab: bool = True) -> AutoPlan:
    """Find a tensor-parallel plan for ``model`` on ``axis`` of ``mesh``.

    ``vocab``: shard the token embeddings and the LM head too (vocab-parallel, or on
    the embedding dim where that communicates less and no LM head shares the weight);
    ``sequence_parallel``: the residual stream between the blocks is sequence-sharded
    (``Shard(1)``): the norms run on shards, each block all-gathers its input once and
    its row-parallel output reduce-scatters; ``PlanError`` if the model does not
    transform so.  ``loss_parallel``: keep the logits vocab-sharded for a loss-parallel
    cross-entropy.  Only ``axis`` is planned;
    the other mesh axes stay as the plan's inputs say (batch sharding is yours to add
    with ``plan.replace(inputs=...)``).  Experts are left replicated.  Only shapes are
    read: a model too big for the host can be built on the meta device for this.

    Example::

        plan = fxshard.auto_plan(model, mesh, example_kwargs={"input_ids": ids, "labels": labels})
        print(plan)              # one commented line per pattern found
        sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels})
    """
    from fxshard.frontend.trace import trace

    axes = mesh_shape(mesh)
    if axis not in axes:
        raise PlanError(f"auto_plan(axis={axis!r}): not an axis of the mesh, whose axes are {list(axes)}")
    n = axes[axis]
    if loss_parallel and not vocab:
        raise PlanError("auto_plan(loss_parallel=True, vocab=False): loss parallelism keeps the logits vocab-sharded, so "
                        "the LM head must be sharded; pass vocab=True")
    with maybe_disable_local_tensor_mode():  # capture and trial transforms see global tensors, as transform does
        probe = trace(model, None, example_inputs, example_kwargs)
        projections, embeddings, modules = _find(probe, model)
        groups, stream = _groups(projections, embeddings, modules, model, axis, n, loss_parallel, vocab, sequence_parallel)
        marked = {fqn for g in groups + ([stream] if stream else []) for _, v in g.variants for fqn in v}
        own = _own_plan(model, mesh, axis, sequence_parallel, loss_parallel, vocab)
        marked |= {fqn for fqn, _ in model.named_modules() if own is not None and own.match(fqn)}
        everything = Plan(MeshSpec(tuple(axes), tuple(axes.values())), {f: ModuleSpec(out_src={}) for f in sorted(marked)})
        captured = trace(model, everything, example_inputs, example_kwargs)
        plan, refused = _choose(captured, mesh, axes, groups, stream)
        plan, refused = _prefer_own_plan(plan, own, refused, groups, captured, axes)
    plan.left_whole = _own_plan_left_whole(plan, _left_whole(plan, projections, embeddings, modules, groups, refused, vocab))
    if not plan.specs:
        raise PlanError(_nothing_sharded(axis, plan.left_whole))
    return plan


# ----------------------------------------------------------------------------- reading the graph


def _owner(w) -> tuple[str, bool] | None:
    """(module FQN, is Conv1D) of a projection weight argument."""
    if isinstance(w, fx.Node) and w.op == "get_attr" and w.target.endswith(".weight"):
        return w.target[: -len(".weight")], False
    if isinstance(w, fx.Node) and w.op == "call_method" and w.target == "t" and isinstance(w.args[0], fx.Node):
        hit = _owner(w.args[0])
        return (hit[0], True) if hit else None
    return None


def _caller(node: fx.Node, fqn: str, modules: dict) -> str:
    """The module whose forward uses the weight of ``fqn``: a tied LM head reads the
    embedding's weight under the embedding's name."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if stack:
        inner = stack[-1][0]
        w = getattr(modules.get(inner), "weight", None)
        if w is not None and w is getattr(modules.get(fqn), "weight", None):
            return inner
    return fqn


def _find(gm: fx.GraphModule, model: nn.Module):
    from fxshard.passes.functionalize_leaves import functionalize  # leaf modules as functional calls, for any capture

    functionalize(gm)
    modules = dict(model.named_modules())
    norms: list[tuple[str | None, int]] = []  # (module, width) of every last-dim reduction: norms
    projections: dict[str, _Projection] = {}
    embeddings: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" and node.op != "call_method":
            continue
        if _reduces_last_dim(node):
            norms.append((_norm_module(node), node.args[0].meta["val"].shape[-1]))
        if node.op != "call_function":
            continue
        if node.target is F.linear and len(node.args) > 1:
            hit = _owner(node.args[1])
            val = node.meta.get("val")
            fqn = _caller(node, hit[0], modules) if hit and hit[0] in modules else None
            if fqn is not None and fqn not in projections and isinstance(val, torch.Tensor):
                projections[fqn] = _Projection(fqn, node, val.shape[-1])
        elif node.target is F.embedding and len(node.args) > 1:
            hit = _owner(node.args[1])
            if hit and hit[0] in modules:
                embeddings.setdefault(_caller(node, hit[0], modules), node)
    opaque = {n.target: type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"}
    by_node = {p.node: p for p in projections.values()}
    for p in projections.values():
        seen, todo = set(), [p.node]
        while todo:
            x = todo.pop()
            for u in x.users:
                if u in seen or measures(u, x):  # a size read (B, T, C = x.size()) carries no values
                    continue
                seen.add(u)
                if u in by_node and u.args[0] is x:
                    p.users.add(by_node[u].fqn)
                elif u.op == "output":
                    p.to_output = True
                elif u not in by_node:
                    todo.append(u)
        p.reach = seen
    return projections, embeddings, (modules, norms, opaque)


def _reads_input(ids) -> bool:
    """Token ids: a graph input, possibly viewed or cast on the way."""
    while isinstance(ids, fx.Node) and ids.op != "placeholder":
        if ids.op == "call_method" and ids.target in ("view", "reshape", "to", "long", "int", "contiguous"):
            ids = ids.args[0]
        else:
            return False
    return isinstance(ids, fx.Node)


def _upstream(r: _Projection, projections: dict[str, _Projection]) -> set[str]:
    by_node = {p.node: p.fqn for p in projections.values()}
    seen, todo, found = set(), [r.node.args[0]], set()
    while todo:
        x = todo.pop()
        if not isinstance(x, fx.Node) or x in seen:
            continue
        seen.add(x)
        if x in by_node:
            found.add(by_node[x])
            continue
        todo.extend(a for a in x.all_input_nodes if not measures(x, a))
    return found


def _parts(p: _Projection) -> list[int] | None:
    """The part sizes a fused projection's output is cut into along its width."""
    width, cuts = p.width, set()
    todo = [p.node]
    while todo:
        x = todo.pop()
        for u in x.users:
            if u.op == "call_method" and u.target in ("view", "reshape") and (u.meta.get("val") is not None
                                                                           and u.meta["val"].shape[-1] == width):
                todo.append(u)
            elif u.op == "call_method" and u.target in ("view", "reshape") and (k := _leading_factor(u, width)):
                return [width // k] * k  # timm's qkv.reshape(B, N, 3, heads, head_dim): the parts outermost
            elif (u.op == "call_method" and u.target == "split") or u.target is torch.split:
                sizes, dim = u.args[1], (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0))
                if dim in (-1, u.args[0].meta["val"].dim() - 1):
                    sizes = [sizes] * (width // sizes) if isinstance(sizes, int) else list(sizes)
                    return sizes if sum(sizes) == width and len(sizes) > 1 else None
            elif (u.op == "call_method" and u.target == "chunk") or u.target is torch.chunk:
                k, dim = u.args[1], (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0))
                if dim in (-1, u.args[0].meta["val"].dim() - 1) and isinstance(k, int) and width % k == 0:
                    return [width // k] * k
            elif u.target is operator.getitem and isinstance(u.args[1], tuple) and u.args[1]:
                idx, nd = u.args[1], x.meta["val"].dim() if x.meta.get("val") is not None else -1
                s = idx[-1]
                leading_whole = all(it is Ellipsis or it == slice(None) for it in idx[:-1])
                if (leading_whole and (Ellipsis in idx or len(idx) == nd) and isinstance(s, slice) and s.step in (None, 1)
                        and all(b is None or isinstance(b, int) for b in (s.start, s.stop))):
                    start, stop, _ = s.indices(width)
                    cuts.update({start, stop})
    cuts = sorted(cuts | {0, width})
    return [b - a for a, b in zip(cuts, cuts[1:])] if len(cuts) > 2 else None


def _leading_factor(view: fx.Node, width: int) -> int | None:
    """``k`` when ``view`` cuts the last dim (``width``) into three or more dims ``[k, h, d]``
    (parts, heads, head dim), else None; a plain ``[h, d]`` is heads, not parts."""
    val, src = view.meta.get("val"), view.args[0].meta.get("val") if isinstance(view.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor) or val.dim() < src.dim() + 2:
        return None
    lead = src.dim() - 1
    if tuple(val.shape[:lead]) != tuple(src.shape[:lead]) or math.prod(val.shape[lead:]) != width:
        return None
    k = int(val.shape[lead])
    return k if 1 < k < width and width % k == 0 else None


def _heads(p: _Projection) -> int | None:
    """The number of heads a projection's output is viewed into (``[..., width] -> [..., h, d]``)."""
    for u in p.node.users:
        val = u.meta.get("val")
        if (u.op == "call_method" and u.target in ("view", "reshape") and isinstance(val, torch.Tensor) and val.dim() >= 2
                and val.shape[-2] * val.shape[-1] == p.width and val.shape[-1] != p.width):
            return int(val.shape[-2])
    return None


def _reduces_last_dim(x: fx.Node) -> bool:
    """A mean/sum over the last dim, or an rms/layer norm: a norm's statistic."""
    if x.op == "call_method" and x.target in ("mean", "sum") or x.target in (torch.mean, torch.sum):
        dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim")
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        src = x.args[0].meta.get("val") if isinstance(x.args[0], fx.Node) else None
        return src is not None and len(dims) == 1 and dims[0] in (-1, src.dim() - 1)
    if x.target in (F.rms_norm, F.layer_norm):
        src = x.args[0].meta.get("val") if isinstance(x.args[0], fx.Node) else None
        shape = x.args[1] if len(x.args) > 1 else None
        return src is not None and (isinstance(shape, int) or (isinstance(shape, (tuple, list)) and len(shape) == 1))
    return False


def _norm_module(x: fx.Node) -> str | None:
    """The module a norm's statistic belongs to: its weight's owner, else the innermost module."""
    if x.target in (F.rms_norm, F.layer_norm) and len(x.args) > 2:
        hit = _owner(x.args[2])
        if hit:
            return hit[0]
    stack = list((x.meta.get("nn_module_stack") or {}).values())
    return stack[-1][0] if stack else None


def _width_norms(p: _Projection, width: int) -> set[str]:
    """Modules that normalize ``p``'s output over its whole width (OLMo2's q_norm)."""
    found = set()
    for x in getattr(p, "reach", ()):
        if _reduces_last_dim(x) and x.args[0].meta["val"].shape[-1] == width:
            m = _norm_module(x)
            if m:
                found.add(m)
    return found


# ----------------------------------------------------------------------------- the patterns


def _pattern(fqn: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


def _generalize(specs: dict[str, ModuleSpec]) -> dict[str, ModuleSpec]:
    """Layer indices become ``*`` where every layer agrees."""
    out: dict[str, ModuleSpec] = {}
    by_pattern: dict[str, list[tuple[str, ModuleSpec]]] = {}
    for fqn, spec in specs.items():
        by_pattern.setdefault(_pattern(fqn), []).append((fqn, spec))
    for pattern, items in by_pattern.items():
        if all(s == items[0][1] for _, s in items):
            out[pattern] = items[0][1]
            continue
        inner: dict[str, list[tuple[str, ModuleSpec]]] = {}  # an nn.Sequential's index is not a layer's
        for fqn, spec in items:
            inner.setdefault(re.sub(r"(?<=\.)\d+(?=\.)", "*", fqn), []).append((fqn, spec))
        for sub, members in inner.items():
            if len(members) > 1 and all(s == members[0][1] for _, s in members):
                out[sub] = members[0][1]
            else:
                out.update(dict(members))
    return out


def _tied(model: nn.Module, a: str, b: str) -> bool:
    wa = getattr(model.get_submodule(a), "weight", None)
    wb = getattr(model.get_submodule(b), "weight", None)
    return wa is not None and wa is wb


def _groups(projections, embeddings, found, model, axis, n, loss_parallel, vocab, sequence_parallel):
    """The patterns, each with its variants (best first); and with ``sequence_parallel``
    the sequence-sharded residual stream (norms, positions), which holds only as a whole."""
    modules, norm_stats, _ = found
    seq = Shard(1) if sequence_parallel else Replicate()
    groups: list[_Group] = []
    used: set[str] = set()
    hidden: set[int] = set()
    for r, late in _pairs(projections):
        if set(late) & used or r.fqn in used:
            continue
        order = late
        hidden |= {projections[u].node.args[0].meta["val"].shape[-1] for u in order}
        split = {u: _parts(projections[u]) for u in order}
        norms = {u: _width_norms(projections[u], projections[u].width) for u in order}
        few = {u: h for u in order if not split[u] and (h := _heads(projections[u])) and n > h}  # 2 KV heads at tp=4
        megatron = {u: colwise(axis, inputs=seq, splits=split[u], heads=few.get(u)) for u in order}
        megatron.update({m: distributed_norm(axis) for u in order for m in norms[u]})
        megatron[r.fqn] = rowwise(axis, out=seq)
        gathered = {u: colwise(axis, inputs=seq, out=Replicate()) for u in order}
        gathered[r.fqn] = rowwise(axis, inputs=Replicate(), out=seq)
        kind = _kind(order, split, norms, r)
        shared = "".join(sorted({f", {h} KV heads each on {n // h} ranks" for h in few.values()}))
        variants = [("megatron" + (" + distributed norms" if any(norms.values()) else "") + shared, megatron)]
        if any(norms.values()) or any(split.values()):
            variants.append(("gathered before the norm" if any(norms.values()) else "gathered, split replicated", gathered))
        _add(groups, _Group(kind, variants))
        used |= set(order) | {r.fqn}
        used |= {m for u in order for m in norms[u]}
    heads = [p for p in projections.values() if p.to_output and not p.users and p.fqn not in used]
    head_out = Shard(-1) if loss_parallel else Replicate()
    head_name = ", vocab-sharded logits" if loss_parallel else ", gathered"
    tied_to: set[str] = set()
    stream: dict[str, ModuleSpec] = {}
    for emb_fqn, emb in embeddings.items():
        weight = model.get_submodule(emb_fqn).weight
        if weight.dim() != 2:
            continue
        if not _reads_input(emb.args[0]):  # positions (GPT-2's wpe): small, indexed by an arange; sliced under SP
            if sequence_parallel:
                stream[emb_fqn] = ModuleSpec(out_dst={axis: Shard(emb.meta["val"].dim() - 2)}, style="sequence_shard")
            continue
        if not vocab:
            if sequence_parallel:
                stream[emb_fqn] = ModuleSpec(out_dst={axis: seq}, style="sequence_shard")
            continue
        tied = {h.fqn: colwise(axis, inputs=seq, out=head_out) for h in heads if _tied(model, emb_fqn, h.fqn)}
        tied_to |= set(tied)
        variants = []
        if weight.shape[0] % n == 0:
            variants.append(("vocab-parallel" + (f" + tied head colwise{head_name}" if tied else ""),
                             {emb_fqn: vocab_parallel(axis, out=seq), **tied}))
        if not tied and weight.shape[1] % n == 0:
            variants.append(("embedding dim sharded, gathered" if not sequence_parallel else "embedding dim sharded, all-to-all",
                             {emb_fqn: colwise(axis, out=seq)}))  # on an nn.Embedding: its embedding dim
        what = f"token embedding [{weight.shape[0]}, {weight.shape[1]}]" + (f", tied to {', '.join(tied)}" if tied else "")
        groups.append(_Group(what, variants))
    for h in heads:
        if h.fqn in tied_to:
            continue
        if vocab:
            groups.append(_Group(f"LM head [{h.width}]" + (", loss parallel" if loss_parallel else ""),
                                 [("colwise" + head_name, {h.fqn: colwise(axis, inputs=seq, out=head_out)})]))
        elif sequence_parallel:
            stream[h.fqn] = ModuleSpec(inputs={axis: Replicate()}, in_src={axis: seq}, style="prepare_input")
    if not sequence_parallel:
        return groups, None
    for module, width in norm_stats:
        if module and module not in used and width in hidden and module in modules:
            stream[module] = sequence_parallel_spec(axis)
    return groups, _Group("sequence-parallel residual stream (norms on sequence shards)", [("sequence parallel", stream)])


def _pairs(projections: dict[str, _Projection]) -> list[tuple[_Projection, list[str]]]:
    """(row-parallel ``r``, its column-parallel projections) in graph order.

    The projections ``r``'s input is computed from are *late* when they feed ``r``
    alone (q/k/v -> o) and *early* when they also feed late ones (MLA's
    ``kv_a_proj_with_mqa``, whose rope key reaches ``o_proj`` too): early ones stay
    replicated.  A pair whose ``r`` is itself a late projection of another pair is an
    inner chain (MLA's ``q_a_proj -> q_b_proj`` inside ``-> o_proj``) and gives way:
    sharding the heads costs nothing there, the chain would all-reduce the queries."""
    cands = []
    for r in projections.values():
        ups = _upstream(r, projections)
        if not ups or r.fqn in ups:
            continue
        late = [u for u in projections if u in ups and projections[u].users == {r.fqn} and not projections[u].to_output]
        early = [u for u in ups if u not in late and not projections[u].to_output and projections[u].users <= ups | {r.fqn}]
        if late and len(late) + len(early) == len(ups):
            cands.append((r, late))
    inner = {r.fqn for r, _ in cands if any(r.fqn in late for _, late in cands)}
    return [(r, late) for r, late in cands if r.fqn not in inner]


def _add(groups: list[_Group], g: _Group) -> None:
    """Layers alike make one pattern: the same variants, module names up to the layer index."""
    key = lambda grp: (grp.what, tuple((name, tuple(sorted((_pattern(f), s.style, s.splits) for f, s in v.items())))
                                       for name, v in grp.variants))
    for other in groups:
        if key(other) == key(g):
            for (_, mine), (_, theirs) in zip(g.variants, other.variants):
                theirs.update(mine)
            return
    groups.append(g)


def _kind(order, split, norms, r) -> str:
    leaf = lambda f: f.rsplit(".", 1)[-1]
    ups = "/".join(leaf(u) for u in order)
    fused = [f"{leaf(u)} fused {split[u]}" for u in order if split[u]]
    normed = sorted({leaf(m) for u in order for m in norms[u]})
    text = f"{ups} -> {leaf(r.fqn)}"
    if fused:
        text += "; " + ", ".join(fused)
    if normed:
        text += "; norms over the projected width: " + ", ".join(normed)
    return text


# ----------------------------------------------------------------------------- choosing


def _choose(captured: fx.GraphModule, mesh, axes, groups: list[_Group], stream: _Group | None) -> AutoPlan:
    """Without a stream: pattern by pattern, each the variant that transforms with the
    fewest wire bytes given those before.  With one (sequence parallel): every pattern's
    first variant and the stream at once (they only hold together), then each
    pattern's other variants tried in its place."""
    from fxshard.runtime import collectives
    from fxshard.debug.comm_summary import comm_summary
    from fxshard.transform import transform

    spec_mesh = MeshSpec(tuple(axes), tuple(axes.values()))
    considered: list[str] = []

    errors: dict[str, PlanError] = {}

    def cost(specs, label):
        try:
            gm = transform(captured, Plan(spec_mesh, _generalize(specs)))
        except PlanError as e:
            considered.append(f"{label}: refused ({str(e).splitlines()[0][:120]})")
            errors[label] = e
            return None, e
        rows = comm_summary(gm).select()
        wire = sum(r.wire_bytes for r in rows)
        considered.append(f"{label}: {wire} B on the wire per rank, {len(rows)} collectives")
        return wire, None

    chosen: dict[str, ModuleSpec] = {}
    picked: dict[int, int] = {}  # group index -> variant index
    with collectives.binding_kept():
        if stream is None:
            for i, g in enumerate(groups):
                best = None
                for j, (name, specs) in enumerate(g.variants):
                    wire, _ = cost({**chosen, **specs}, f"{g.what}: {name}")
                    if wire is not None and (best is None or wire < best[0]):
                        best = (wire, j)
                if best is not None:
                    picked[i] = best[1]
                    chosen.update(g.variants[best[1]][1])
        else:
            chosen = dict(stream.variants[0][1])
            for i, g in enumerate(groups):
                if g.variants:
                    picked[i] = 0
                    chosen.update(g.variants[0][1])
            wire, err = cost(chosen, "sequence parallel, every pattern's first variant")
            if err is not None:
                raise PlanError(f"auto_plan(sequence_parallel=True): the sequence-parallel plan does not transform:\n{err}\n"
                                f"  fix: use sequence_parallel=False, or start from auto_plan's plan and write the "
                                f"entries this model needs") from err
            for i, g in enumerate(groups):
                for j in range(1, len(g.variants)):
                    current = g.variants[picked[i]][1]
                    trial = {k: v for k, v in chosen.items() if k not in current}
                    trial.update(g.variants[j][1])
                    w, _ = cost(trial, f"{g.what}: {g.variants[j][0]}")
                    if w is not None and w < wire:
                        wire, chosen, picked[i] = w, trial, j
    why: dict[str, str] = {}
    for i, j in picked.items():
        for fqn in groups[i].variants[j][1]:
            why[_pattern(fqn)] = f"{groups[i].what}: {groups[i].variants[j][0]}"
    for fqn in (stream.variants[0][1] if stream else {}):
        why.setdefault(_pattern(fqn), stream.what)
    specs = _generalize(chosen)
    plan = AutoPlan(mesh, specs)
    plan.why = {p: why.get(p, "") for p in specs}
    plan.considered = considered
    refused = {i: errors.get(f"{g.what}: {g.variants[0][0]}") for i, g in enumerate(groups) if i not in picked}
    return plan, refused


# ----------------------------------------------------------------------------- the model's own plan


def _own_plan(model: nn.Module, mesh, axis: str, sequence_parallel: bool, loss_parallel: bool, vocab: bool) -> Plan | None:
    """The tensor-parallel plan the model ships (``Plan.from_hf``: HF's ``base_model_tp_plan``),
    when it has one and it answers the same question as auto_plan: only ``axis`` planned, no
    plan inputs, and auto_plan's options its defaults (HF's plans gather the logits, shard
    the LM head and keep the residual stream replicated); else None."""
    if sequence_parallel or loss_parallel or not vocab or getattr(model, "config", None) is None:
        return None
    try:
        own = Plan.from_hf(mesh, model, axis=axis)
    except PlanError:
        return None
    if not own.specs or own.inputs or any(set(_spec_axes(spec)) - {axis} for spec in own.specs.values()):
        return None
    return own


def _spec_axes(spec: ModuleSpec) -> set:
    """The mesh axes a spec's layouts name."""
    layouts = list(spec.params.values()) + [spec.inputs, spec.in_src, spec.out_src, spec.out_dst]
    out: set = set()
    while layouts:
        layout = layouts.pop()
        if isinstance(layout, dict):
            for key, value in layout.items():
                if isinstance(value, (dict, tuple, list)):
                    layouts.append(value)
                elif isinstance(key, str) and not isinstance(value, (str, type(None))):
                    out.add(key)
        elif isinstance(layout, (tuple, list)):
            layouts.extend(layout)
    return out


def _prefer_own_plan(plan: "AutoPlan", own: Plan | None, refused: dict, groups: list, captured: fx.GraphModule,
                     axes) -> tuple["AutoPlan", dict]:
    """auto_plan is never worse than the model's own plan: both are transformed on the
    captured graph and the model's own is kept when it sends no more bytes per training
    step (:func:`fxshard.comm_summary`), or when auto_plan's does not transform."""
    if own is None:
        return plan, refused
    from fxshard.debug.comm_summary import comm_summary
    from fxshard.runtime import collectives
    from fxshard.transform import transform

    spec_mesh = MeshSpec(tuple(axes), tuple(axes.values()))

    def wire(specs) -> tuple[int | None, str]:
        try:
            gm = transform(captured, Plan(spec_mesh, specs))
        except PlanError as e:
            return None, f"refused ({str(e).splitlines()[0][:120]})"
        rows = comm_summary(gm).select()
        total = sum(r.wire_bytes for r in rows)
        return total, f"{total} B on the wire per rank, {len(rows)} collectives"

    with collectives.binding_kept():
        found, found_line = wire(plan.specs) if plan.specs else (None, "shards nothing")
        mine, mine_line = wire(own.specs)
    plan.considered = list(getattr(plan, "considered", [])) + [f"auto_plan's whole plan: {found_line}",
                                                               f"the model's own plan (Plan.from_hf): {mine_line}"]
    if mine is None or (found is not None and found < mine):
        return plan, refused
    chosen = AutoPlan(plan.mesh, dict(own.specs))
    than = f"{found} B" if found is not None else "auto_plan's, which does not transform"
    chosen.why = {p: f"the model's own plan (Plan.from_hf): {mine} B per step, no more than {than}" for p in own.specs}
    chosen.considered = plan.considered
    kept = {i: e for i, e in refused.items()
            if not any(own.match(fqn) for fqn in (groups[i].variants[0][1] if groups[i].variants else ()))}
    return chosen, kept


def _own_plan_left_whole(plan: "AutoPlan", left: dict[str, str]) -> dict[str, str]:
    """With the model's own plan kept, what it leaves replicated is left by it."""
    if not any(w.startswith("the model's own plan") for w in getattr(plan, "why", {}).values()):
        return left
    return {p: f"the model's own plan (Plan.from_hf) keeps it replicated (auto_plan alone: {w})" for p, w in left.items()}


# ----------------------------------------------------------------------------- what is left whole


def _refusal(e: PlanError | None) -> str:
    """A PlanError in one line: where, and the problem."""
    if e is None:
        return "refused"
    lines = [line.strip() for line in str(e).splitlines()]
    problem = next((line[len("problem:"):].strip() for line in lines if line.startswith("problem:")), "")
    text = f"{lines[0]}: {problem}" if problem else lines[0]
    return text if len(text) <= 240 else text[:237] + "..."


def _left_whole(plan: Plan, projections, embeddings, found, groups, refused, vocab) -> dict[str, str]:
    """Why each module holding weights auto_plan could shard stays replicated, by pattern."""
    modules, _, opaque = found
    left: dict[str, str] = {}
    for i, err in refused.items():
        g = groups[i]
        for fqn in g.variants[0][1] if g.variants else ():
            left[fqn] = f"{g.what}: transform refused every variant: {_refusal(err)}"
    covered = lambda fqn: fqn in left or plan.match(fqn) is not None  # noqa: E731
    for fqn, p in projections.items():
        if covered(fqn):
            continue
        if p.to_output and not p.users:
            left[fqn] = "output projection: vocab=False keeps it replicated" if not vocab else "output projection, not sharded"
        elif p.users:
            names = sorted({_pattern(u) for u in p.users})
            left[fqn] = (f"no column -> row pair: its output feeds {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                         f", not a single row-parallel projection")
        else:
            left[fqn] = "no column -> row pair: its output reaches no other projection and not the output"
    for fqn, node in embeddings.items():
        if covered(fqn):
            continue
        if not _reads_input(node.args[0]):
            left[fqn] = "position embedding (looked up by positions, not by input ids): small, kept whole"
        elif not vocab:
            left[fqn] = "token embedding: vocab=False keeps it replicated"
        else:
            left[fqn] = "token embedding, not sharded (its dims do not divide by the axis)"
    for fqn, kind in opaque.items():
        owns = next(modules[fqn].parameters(), None) is not None if fqn in modules else False
        if not covered(fqn) and owns:
            left[fqn] = (f"fxshard cannot see inside it ({kind}: a leaf call whose forward is not traced; "
                         f"no functional form is known for it)")
    return _by_pattern(left)


def _by_pattern(left: dict[str, str]) -> dict[str, str]:
    """Layer indices become ``*`` where every layer gives the same reason."""
    layerless = lambda text: re.sub(r"(?<=\.)\d+(?=\.)", "*", text)  # noqa: E731
    groups: dict[str, list[tuple[str, str]]] = {}
    for fqn, why in left.items():
        groups.setdefault(_pattern(fqn), []).append((fqn, layerless(why)))
    out: dict[str, str] = {}
    for pattern, items in groups.items():
        if all(w == items[0][1] for _, w in items):
            out[pattern] = items[0][1]
        else:
            out.update({fqn: left[fqn] for fqn, _ in items})
    return out


def _nothing_sharded(axis: str, left: dict[str, str]) -> str:
    """The message of the PlanError for a plan that would shard nothing."""
    if not left:
        return (f"auto_plan found nothing to shard on {axis!r}: the captured graph has no linear projection and no "
                f"token embedding\n  fix: write the plan by hand (fxshard.Plan), or leave this model unsharded on "
                f"{axis!r}")
    lines = [f"auto_plan found nothing it can shard on {axis!r}; every module stays replicated:"]
    by_reason: dict[str, list[str]] = {}
    for pattern, why in left.items():
        by_reason.setdefault(why, []).append(pattern)
    lines += [f"  {', '.join(patterns)}: {why}" for why, patterns in by_reason.items()]
    lines.append("  fix: act on the reasons above (a module fxshard cannot see inside can be declared a local region, "
                 "ModuleSpec(local=True)), or write the plan by hand with fxshard.colwise/rowwise")
    return "\n".join(lines)
