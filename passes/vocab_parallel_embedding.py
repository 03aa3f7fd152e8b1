"""vocab_parallel_embedding: lookups into a vocab-sharded (``Shard(0)``) embedding.

Each rank holds rows ``[start, start + V/n)``: ``torch.chunk``'s rows, so where the axis
does not divide the vocab (GPT-2's 50257) the last ranks hold fewer, counted by a
second buffer ``<module>.vocab_rows`` sharded the same way.  Ids outside that range are masked,
shifted, looked up and their rows zeroed, so the output is ``Partial``: summing it over
the axis (the module's ``out`` boundary: all-reduce, or reduce-scatter for sequence
parallel) gives exactly the single-device rows.  ``start`` is a non-persistent
buffer ``<module>.vocab_start``, itself sharded ``Shard(0)`` over the axis, so the
generated code is the same on every rank and ``state_dict`` keys do not change.
``padding_idx`` keeps its meaning: the row is looked up, its gradient is dropped.

Reads:  ``.rewrite == Rewrite.VOCAB_PARALLEL_EMBEDDING``, ``.value``.
Writes: the masked lookup nodes with ``.value``; the ``vocab_start`` buffer.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxshard.errors import node_error
from fxshard.layout.placements import local_shape
from fxshard.layout.placements import chunk
from fxshard.meta import Rewrite, TensorInfo, info
from fxshard.meta import PassContext


def vocab_parallel_embedding(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite embeddings whose weight is vocab-sharded (in place)."""
    axes = ctx.axes
    graph = gm.graph
    for node in list(graph.nodes):
        if info(node).rewrite != Rewrite.VOCAB_PARALLEL_EMBEDDING:
            continue
        ids, weight = node.args[0], node.args[1]
        w: TensorInfo = info(weight).value
        id_info: TensorInfo = info(ids).value
        vocab_axes = [a for a, p in w.layout.items() if p == Shard(0)]
        if len(vocab_axes) != 1:
            raise node_error(node, f"the embedding vocab is sharded on several axes {vocab_axes}", "shard the vocab on one axis")
        (axis,) = vocab_axes
        n = axes[axis]
        padding_idx = node.kwargs.get("padding_idx")
        owner = weight.target.rsplit(".", 1)[0] if "." in weight.target else ""
        mod = gm.get_submodule(owner) if owner else gm
        # torch.chunk rows: where the axis does not divide the vocab, the last ranks hold fewer
        pieces = [chunk(w.shape[0], n, i) for i in range(n)]
        # on the weight's device, as the ids are (a CUDA model's ids minus a CPU table fail);
        # a meta weight's table stays on the CPU so that materialize() copies its values
        table_device = getattr(mod, weight.target.rsplit(".", 1)[-1]).device
        table_device = torch.device("cpu") if table_device.type == "meta" else table_device
        mod.register_buffer("vocab_start", torch.tensor([a for a, _ in pieces], dtype=torch.long, device=table_device),
                            persistent=False)
        start_target = f"{owner}.vocab_start" if owner else "vocab_start"
        even = w.shape[0] % n == 0
        if not even:
            mod.register_buffer("vocab_rows", torch.tensor([k for _, k in pieces], dtype=torch.long, device=table_device),
                                persistent=False)
        v_local = w.local_shape[0]

        def meta(new, layout, shape, lshape, dtype, grad=False, val=None):
            m = info(new)
            m.value, m.region, m.rule = TensorInfo(dict(layout), tuple(shape), tuple(lshape), dtype, grad), info(node).region, "vocab parallel"
            new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            new.meta["stack_trace"] = node.meta.get("stack_trace")
            return new

        with graph.inserting_before(node):
            start = graph.get_attr(start_target)
            start_layout = {a: (Shard(0) if a == axis else Replicate()) for a in axes}
            meta(start, start_layout, (n,), local_shape((n,), start_layout, axes), torch.long)
            shifted = meta(graph.call_function(operator.sub, (ids, start)), id_info.layout, id_info.shape, id_info.local_shape, id_info.dtype)
            below = meta(graph.call_function(operator.lt, (shifted, 0)), id_info.layout, id_info.shape, id_info.local_shape, torch.bool)
            if not even:  # the rank's own row count, from a buffer: the code is the same on every rank
                rows = graph.get_attr(f"{owner}.vocab_rows" if owner else "vocab_rows")
                meta(rows, start_layout, (n,), local_shape((n,), start_layout, axes), torch.long)
                v_local = rows
            above = meta(graph.call_function(operator.ge, (shifted, v_local)), id_info.layout, id_info.shape, id_info.local_shape, torch.bool)
            outside = meta(graph.call_function(operator.or_, (below, above)), id_info.layout, id_info.shape, id_info.local_shape, torch.bool)
            local_ids = meta(graph.call_method("masked_fill", (shifted, outside, 0)), id_info.layout, id_info.shape, id_info.local_shape, id_info.dtype)
        out: TensorInfo = info(node).value
        kwargs = {k: v for k, v in node.kwargs.items() if k != "padding_idx"}
        node.args = (local_ids, weight)
        node.kwargs = kwargs
        with graph.inserting_after(node):
            mask = meta(graph.call_method("unsqueeze", (outside, -1)), id_info.layout, id_info.shape + (1,), id_info.local_shape + (1,), torch.bool)
        with graph.inserting_after(mask):
            zeroed = meta(graph.call_method("masked_fill", (node, mask, 0.0)), out.layout, out.shape, out.local_shape, out.dtype, True)
        last = zeroed
        if padding_idx is not None:  # forward: the row as usual; backward: no gradient into it
            with graph.inserting_after(zeroed):
                is_pad = meta(graph.call_function(operator.eq, (ids, padding_idx)), id_info.layout, id_info.shape, id_info.local_shape, torch.bool)
            with graph.inserting_after(is_pad):
                pad_mask = meta(graph.call_method("unsqueeze", (is_pad, -1)), id_info.layout, id_info.shape + (1,), id_info.local_shape + (1,), torch.bool)
            with graph.inserting_after(pad_mask):
                frozen = meta(graph.call_method("detach", (zeroed,)), out.layout, out.shape, out.local_shape, out.dtype)
            with graph.inserting_after(frozen):
                last = meta(graph.call_function(torch.where, (pad_mask, frozen, zeroed)), out.layout, out.shape, out.local_shape, out.dtype, True)
        node.replace_all_uses_with(last, delete_user_cb=lambda u: u not in (zeroed,))
        info(node).rewrite = None
    graph.lint()
    return
