"""bucket_grad_syncs: the gradient syncs of parameters, coalesced into buckets.

``grad_sync`` puts one ``grad_sync(w, axis)`` on each replicated parameter whose
gradient each rank holds only a share of (norm weights under sequence parallelism,
every replicated weight under a batch-sharded axis): one all-reduce per parameter per
step.  This pass replaces them, as DDP does, by ``grad_sync_bucket([w1, w2, ...],
axis)`` nodes: identity forward; backward, one all-reduce of the flattened gradients
once the last of them is complete.

* Members are the syncs whose input is a parameter (a ``get_attr`` that requires
  grad, or a view of one: a ``Conv1D`` weight read as ``w.t()``) or the output of a
  bucket on another axis (a parameter replicated on two
  axes is bucketed on the first, then on the second).  Syncs of activations stay
  where they are.
* Buckets fill in backward order: a parameter's gradient is complete once autograd
  has run its first use in the forward, so members are sorted by their first use,
  last first, and a bucket is closed when the next member would take it past
  ``cap_bytes`` (local bytes, DDP's ``bucket_cap_mb``).  The bucket node sits just
  before the first use among its members.
* When buckets overlap, the first one the backward completes (the last layers') holds
  at most ``FIRST_BUCKET_MB``, as DDP's first bucket: its all-reduce starts early and runs
  while the rest of the backward is computed (a larger first member gets a bucket alone).
* ``ctx.overlap_grad_syncs``: a bucket of parameters gets ``overlap=True`` (its
  all-reduce is waited on at the end of the backward, not at once), except under FSDP2.
* ``unit_of(node)`` names the unit a use belongs to; a bucket never mixes units.
  When the blocks are split (``ctx.split_blocks``: FSDP2, whose unsharded parameters
  exist only while their block runs, or ``transform(blocks=...)`` for
  ``fxshard.compile``) each transformer block is a unit; otherwise the whole graph is one.

Reads:  ``.collective``, ``.value``, ``nn_module_stack``.
Writes: ``grad_sync_bucket`` nodes (``.collective``, ``.value`` the members'
        tuple) and one ``getitem`` per member (``<parameter>_synced``); removes the
        ``grad_sync`` nodes they replace.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from fxshard.runtime import collectives
from fxshard.meta import Collective, PassContext, TensorInfo, block_of, info
from fxshard.state.module_state import attribute

DEFAULT_CAP_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb
FIRST_BUCKET_MB = 1.0  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass
class _Member:
    source: fx.Node  # the parameter's get_attr, or a bucket output on another axis
    syncs: list[fx.Node]  # the grad_sync nodes on ``source`` this member replaces
    uses: list[fx.Node]  # their users in this unit
    first: int  # graph position of the first use

    @property
    def nbytes(self) -> int:
        v = info(self.source).value
        return math.prod(v.local_shape) * v.dtype.itemsize


def bucket_grad_syncs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Coalesce parameter gradient syncs into buckets of at most ``cap_bytes`` (in place).
    ``cap_bytes=None`` or ``0`` keeps one sync per parameter."""
    cap_bytes = ctx.bucket_cap_bytes
    # a block split out (FSDP2: its parameters exist, unsharded, only while it runs) holds its own buckets
    unit_of: Callable[[fx.Node], str] = (lambda n: block_of(n, ctx.block_pattern)) if ctx.split_blocks else (lambda n: "")
    if not cap_bytes:
        return
    # FSDP2's post-backward hook reads a block's gradients before the backward ends: no overlap there
    overlap = ctx.overlap_grad_syncs and not ctx.fsdp_axes
    graph = gm.graph
    while True:  # one round per nesting level of syncs (a parameter replicated on dp and tp)
        order = {n: i for i, n in enumerate(graph.nodes)}
        groups: dict[tuple, dict[fx.Node, _Member]] = {}
        for node in graph.nodes:
            if not (_is_sync(node) and _is_parameter_like(gm, node.args[0])):
                continue
            for use in node.users:
                key = (unit_of(use), node.args[1], node.kwargs.get("op", "sum"), node.kwargs.get("replicas"))
                member = groups.setdefault(key, {}).get(node.args[0])
                if member is None:
                    member = groups[key][node.args[0]] = _Member(node.args[0], [], [], order[use])
                if node not in member.syncs:
                    member.syncs.append(node)
                member.uses.append(use)
                member.first = min(member.first, order[use])
        if not groups:
            break
        # the group whose gradients the backward completes first gets DDP's small first bucket
        ready_first = max(groups, key=lambda k: max(m.first for m in groups[k].values())) if overlap else None
        first_cap = min(cap_bytes, int(FIRST_BUCKET_MB * 2**20))
        for key, members in groups.items():
            _, axis, op, replicas = key
            caps = (first_cap if key == ready_first else cap_bytes, cap_bytes)
            for bucket in _fill(sorted(members.values(), key=lambda m: -m.first), caps):
                _make_bucket(graph, bucket, axis, op, order, replicas, overlap)
        for node in list(graph.nodes):
            if _is_sync(node) and not node.users:
                graph.erase_node(node)
    graph.lint()
    return


def _is_sync(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is collectives.grad_sync


_VIEWS = {"t", "transpose", "permute", "view", "reshape", "contiguous"}


def _is_parameter_like(gm: fx.GraphModule, node) -> bool:
    """A parameter, a view of one (transformers' ``Conv1D`` weight read as ``w.t()``), or
    a bucket's output on another axis."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        t = attribute(gm, node.target, None)
        return isinstance(t, torch.Tensor) and t.requires_grad and isinstance(info(node).value, TensorInfo)
    if node.op == "call_method" and node.target in _VIEWS and isinstance(info(node).value, TensorInfo):
        tensors = [a for a in node.all_input_nodes if isinstance(info(a).value, TensorInfo)]
        return len(tensors) == 1 and tensors[0] is node.args[0] and _is_parameter_like(gm, node.args[0])
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and node.args[0].target is collectives.grad_sync_bucket)


def _fill(members: list[_Member], caps: tuple[int, int]) -> list[list[_Member]]:
    """Members in backward order into buckets: the first of at most ``caps[0]`` bytes, the
    others of at most ``caps[1]``."""
    buckets: list[list[_Member]] = [[]]
    size = 0
    for m in members:
        if buckets[-1] and size + m.nbytes > caps[len(buckets) > 1]:
            buckets.append([])
            size = 0
        buckets[-1].append(m)
        size += m.nbytes
    return [b for b in buckets if b]


def _make_bucket(graph: fx.Graph, bucket: list[_Member], axis: str, op: str, order: dict, replicas: int | None,
                 overlap: bool) -> None:
    anchor = min((u for m in bucket for u in m.uses), key=lambda u: order[u])
    stack = _unit_stack(bucket)
    values = tuple(info(m.source).value for m in bucket)
    kwargs = {"op": op} if op != "sum" else {}
    if replicas:  # replicated heads: summed over the ranks sharing each head only
        kwargs["replicas"] = replicas
    if overlap and all(m.source.op == "get_attr" for m in bucket):  # a view's or a bucket's gradient is needed at once
        kwargs["overlap"] = True
    for m in bucket:  # a get_attr is made just before its own use, maybe after the anchor
        _hoist(m.source, anchor, order)
    with graph.inserting_before(anchor):
        node = graph.create_node("call_function", collectives.grad_sync_bucket, ([m.source for m in bucket], axis), kwargs,
                                 name="grad_bucket")
    names = ", ".join(_parameter_name(m.source) for m in bucket)
    _annotate(node, values, stack, anchor, "grad sync bucket")
    info(node).collective = Collective("grad_sync_bucket", axis, "identity",
                                       f"all-reduce over {replicas} ranks" if replicas else "all-reduce",
                                       f"grads of {len(bucket)} parameters"
                                       f"{' (replicated heads)' if replicas else ''}: {names}")
    node.meta["val"] = tuple(m.source.meta.get("val") for m in bucket)
    prev = node
    for i, m in enumerate(bucket):
        with graph.inserting_after(prev):
            out = graph.create_node("call_function", operator.getitem, (node, i), {}, name=f"{_parameter_name(m.source)}_synced")
        _annotate(out, values[i], stack, anchor, "grad sync bucket")
        out.meta["val"] = m.source.meta.get("val")
        for sync in m.syncs:
            for use in m.uses:
                if sync in use.all_input_nodes:
                    use.replace_input_with(sync, out)
        prev = out


def _hoist(node: fx.Node, anchor: fx.Node, order: dict) -> None:
    """Move ``node`` (and what it needs) before ``anchor`` if it comes after it."""
    if order[node] < order[anchor]:
        return
    for a in node.all_input_nodes:
        _hoist(a, anchor, order)
    anchor.prepend(node)
    order[node] = order[anchor] - 0.5


def _parameter_name(node: fx.Node) -> str:
    """The parameter's node name, also through buckets on other axes and views."""
    while node.op != "get_attr":
        node = node.args[0].args[0][node.args[1]] if node.target is operator.getitem else node.args[0]
    return node.name


def _unit_stack(bucket: list[_Member]) -> dict:
    """The module stack the members' uses share (a bucket in a block stays in it)."""
    stacks = [u.meta.get("nn_module_stack") or {} for m in bucket for u in m.uses]
    common = {}
    for key, entry in stacks[0].items():
        if all(s.get(key) == entry for s in stacks[1:]):
            common[key] = entry
        else:
            break
    return common


def _annotate(node: fx.Node, value, stack: dict, anchor: fx.Node, rule: str) -> None:
    m = info(node)
    m.value, m.rule = value, rule
    m.region = None
    node.meta["nn_module_stack"] = dict(stack)
    if anchor.meta.get("stack_trace"):
        node.meta["stack_trace"] = anchor.meta["stack_trace"]
