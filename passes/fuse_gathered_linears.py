"""fuse_gathered_linears: the linears that read a sequence-parallel gather keep its shard, not
the gathered whole (Megatron's sequence parallelism).

Under sequence parallelism a column-parallel region's input arrives ``Shard(seq)`` and is
gathered on entry; the gather's gradient is a share, reduce-scattered
(``all_gather(x, "tp", 1, grad="partial")``, after ``insert_grad_syncs`` folded the sync).
When every reader of the gathered value is a ``F.linear`` that takes it as its input
(q|k|v, gate|up), the gather and the linears become one call::

    all_gather = fxshard_all_gather(x, 'tp', 1, grad = 'partial')        # before
    linear = torch._C._nn.linear(all_gather, q_weight)
    linear_1 = torch._C._nn.linear(all_gather, k_weight)

    gathered_linears = fxshard_gathered_linears(x, 'tp', 1, [q_weight, k_weight])   # after
    q_proj = gathered_linears[0]
    k_proj = gathered_linears[1]

whose backward gathers ``x`` again instead of keeping the gathered tensor: a tp rank keeps
``1/tp`` of those inputs for the weight gradients, for one more all-gather per call in the
backward (``fxshard.runtime.gathered_linears``).  The numbers are the same.  A gather with
any other reader (a dropout, a router, a LoRA branch) than linears and reads of its leading
sizes (``bsz, seqlen, _ = x.shape``), with unequal pieces, or whose linears read a weight
computed after it, is left as it is; so is a gather outside the transformer blocks (the
LM head's input: one ``[B, S, H]`` a step, where torch.compile's partitioner would recompute
the head's logits in the backward from a gather of their input, a third gather).

Reads:  ``.collective`` of ``all_gather`` nodes, their ``grad`` keyword, their users.
Writes: one ``gathered_linears`` call per such gather, ``.collective`` on it; each linear
        becomes a ``getitem`` keeping its ``.value`` and ``meta["val"]``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxshard.meta import Collective, PassContext, block_of, info
from fxshard.runtime import collectives
from fxshard.runtime.gathered_linears import gathered_linears as gathered_linears_op


def _linear_parts(user: fx.Node, gathered: fx.Node) -> tuple[fx.Node, object] | None:
    """``(weight, bias)`` of a ``F.linear`` whose input (and only its input) is ``gathered``."""
    if user.op != "call_function" or user.target is not F.linear:
        return None
    args = list(user.args) + [None] * (3 - len(user.args))
    x, weight, bias = args[0], user.kwargs.get("weight", args[1]), user.kwargs.get("bias", args[2])
    if x is not gathered or weight is gathered or bias is gathered or not isinstance(weight, fx.Node):
        return None
    return weight, bias


def _reads_leading_sizes(user: fx.Node, gathered: fx.Node) -> bool:
    """Whether ``user`` reads only sizes of ``gathered`` other than its last: ``x.shape[0]``,
    ``x.size(1)`` (``bsz, seqlen, _ = x.shape``).  A linear's output has those sizes too."""
    ndim = len(gathered.meta["val"].shape)
    if user.op == "call_method" and user.target == "size" and len(user.args) == 2 and not user.kwargs:
        return isinstance(user.args[1], int) and user.args[1] % ndim != ndim - 1
    if user.op == "call_function" and user.target is getattr and user.args[1:] == ("shape",) or (
            user.op == "call_method" and user.target == "size" and len(user.args) == 1 and not user.kwargs):
        return all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   and (u.args[1] % ndim != ndim - 1 or not u.users) for u in user.users)  # ``_`` unread
    return False


# what a weight may pass through between its read and its linear: identities forward
_PARAMETER_SYNCS = (collectives.grad_sync, collectives.grad_sync_bucket, operator.getitem)


def _computed_after(inputs: list[fx.Node], gather: fx.Node, order: dict) -> list[fx.Node] | None:
    """The nodes after ``gather`` that ``inputs`` (the linears' weights and biases) need, in
    graph order, when each is computed from parameters alone (a ``get_attr``, the identity
    ``grad_sync`` of a KV head shared by ranks, and its bucket) and may run before the gather;
    else None."""
    late: set[fx.Node] = set()
    stack = [a for a in inputs if order[a] > order[gather]]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        if not (n.op == "get_attr" or n.op == "call_function" and n.target in _PARAMETER_SYNCS):
            return None
        late.add(n)
        stack += [a for a in n.all_input_nodes if order[a] > order[gather]]
    return sorted(late, key=order.__getitem__)


def _output_name(linear: fx.Node) -> str:
    """The name of a linear's output in the generated code: its module's (``q_proj``)."""
    stack = list(linear.meta.get("nn_module_stack", {}).values())
    path = stack[-1][0] if stack and isinstance(stack[-1], tuple) else ""
    return path.rsplit(".", 1)[-1] if path and path.rsplit(".", 1)[-1].isidentifier() else "linear"


def fuse_gathered_linears(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Fuse each sequence-parallel gather with the linears that read it (in place)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for gather in list(graph.nodes):
        if not (gather.op == "call_function" and gather.target is collectives.all_gather
                and gather.kwargs.get("grad") == "partial" and gather.kwargs.get("size") is None
                and isinstance(gather.meta.get("val"), torch.Tensor) and block_of(gather, ctx.block_pattern)):
            continue
        users = sorted(gather.users, key=order.__getitem__)
        linears = [u for u in users if _linear_parts(u, gather) is not None]
        sizes = [u for u in users if u not in linears and _reads_leading_sizes(u, gather)]
        if not linears or len(linears) + len(sizes) != len(users):
            continue  # another reader needs the gathered value itself
        parts = [_linear_parts(u, gather) for u in linears]
        inputs = [a for w, b in parts for a in (w, b) if isinstance(a, fx.Node)]
        late = _computed_after(inputs, gather, order)
        if late is None:
            continue  # a weight computed from the activations after the gather: keep them apart
        for n in late:  # read from the parameters alone (a get_attr, a replicated head's grad_sync): moved up
            gather.prepend(n)
        x, axis, dim = gather.args[:3]
        with graph.inserting_after(gather):
            fused = graph.call_function(gathered_linears_op, (x, axis, dim, [w for w, _ in parts]),
                                        {"biases": [b for _, b in parts]} if any(b is not None for _, b in parts) else {})
        fused.meta["nn_module_stack"] = gather.meta.get("nn_module_stack", {})
        fused.meta["stack_trace"] = gather.meta.get("stack_trace")
        fused.meta["val"] = tuple(u.meta.get("val") for u in linears)
        fi, gi = info(fused), info(gather)
        fi.region, fi.rule = gi.region, "gathered linears"
        fi.value = tuple(info(u).value for u in linears)
        fi.collective = Collective("gathered_linears", axis, "all-gather",
                                   "all-gather again + reduce-scatter",
                                   f"{gi.collective.purpose}, {len(linears)} linear(s)" if gi.collective else "")
        fi.extra["gathered"] = gi.value  # the whole input the backward gathers again (comm_summary's buffer)
        items, cur = [], fused
        for i, linear in enumerate(linears):
            with graph.inserting_after(cur):
                cur = graph.create_node("call_function", operator.getitem, (fused, i), name=_output_name(linear))
            cur.meta.update(linear.meta)
            items.append(cur)
        for linear, item in zip(linears, items):
            linear.replace_all_uses_with(item)
            graph.erase_node(linear)
        for read in sizes:  # the leading sizes of the gathered input are those of the outputs
            for unread in [u for u in read.users if not u.users]:
                graph.erase_node(unread)
            read.replace_input_with(gather, items[0])
        graph.erase_node(gather)
        order = {n: i for i, n in enumerate(graph.nodes)}
    graph.lint()
