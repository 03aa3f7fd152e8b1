"""localize: literal sizes of sharded dims become local sizes.

``x.view(bsz, seqlen, 8, 16)`` with the head dim sharded over ``tp=4`` becomes
``x.view(bsz, seqlen, 2, 16)``.  Sizes read at run time (``x.shape[0]``) stay as they
are, so the graph works for any batch or sequence length, but they must come from a
dim sharded the same way as the dim they size; ``-1`` is left to infer.

Reads:  ``.value`` (TensorInfo of results, SizeInfo of runtime sizes).
Writes: the size arguments of ``view``/``reshape``/``expand``/``unflatten``/
        ``new_*`` nodes and of ``split`` along a fused projection's sharded dim;
        no metadata.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxshard.errors import node_error
from fxshard.meta import SizeInfo, TensorInfo, info

_SIZED_METHODS = {"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full"}


def _sizes_slot(node: fx.Node):
    """(args index holding the sizes, sizes list, packed-as-tuple?) or None."""
    if node.op == "call_method" and node.target in _SIZED_METHODS:
        if node.target == "new_full":
            return 1, list(node.args[1]), True
        rest = node.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
            return 1, list(rest[0]), True
        return 1, list(rest), False
    if node.op == "call_function" and node.target is torch.reshape:
        return 1, list(node.args[1]), True
    return None


def localize(gm: fx.GraphModule, axes: dict[str, int]) -> fx.GraphModule:
    """Rewrite literal global sizes of sharded dims to local sizes (in place)."""
    for node in gm.graph.nodes:
        if node.target == "split" or node.target is torch.split:
            _split(node, axes)
            continue
        out = info(node).value
        if not isinstance(out, TensorInfo):
            continue
        if node.op == "call_method" and node.target == "unflatten" or node.target is torch.unflatten:
            _unflatten(node, out, axes)
            continue
        slot = _sizes_slot(node)
        if slot is None:
            continue
        start, sizes, packed = slot
        if len(sizes) == 1 and isinstance(sizes[0], fx.Node) and isinstance(info(sizes[0]).value, SizeInfo) and isinstance(info(sizes[0]).value.axes, tuple):
            continue  # x.view(y.shape): sizes of a tensor with the same layout
        offset = len(out.shape) - len(sizes)
        new = [_local_size(node, s, d + offset, out, axes) for d, s in enumerate(sizes)]
        if new != sizes:
            args = list(node.args)
            if packed:
                args[start] = type(node.args[start])(new) if not isinstance(node.args[start], torch.Size) else tuple(new)
            else:
                args[start:] = new
            node.args = tuple(args)
    gm.recompile()
    return gm


def _sharding(out: TensorInfo, d: int) -> frozenset:
    return frozenset(a for a, p in out.layout.items() if isinstance(p, Shard) and p.dim == d)


def _local_size(node, s, d, out: TensorInfo, axes):
    if d < 0:
        return s
    sharded = _sharding(out, d)
    if isinstance(s, fx.Node):
        v = info(s).value
        src_axes = v.axes if isinstance(v, SizeInfo) else frozenset()
        if src_axes is None or src_axes != sharded:
            raise node_error(node, f"dim {d} is sized by `{s.name}`, a size read at run time from a dim sharded on "
                                   f"{sorted(src_axes) if src_axes is not None else 'an unknown combination of axes'}, "
                                   f"but the result's dim {d} is sharded on {sorted(sharded)}",
                             "size that dim with a literal, or read the size from a tensor sharded the same way")
        return s
    if isinstance(s, int) and s != -1 and sharded:
        return s // math.prod(axes[a] for a in sharded)
    return s


def _unflatten(node, out: TensorInfo, axes):
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    sizes = list(node.args[2] if len(node.args) > 2 else node.kwargs["sizes"])
    dim = dim % (len(out.shape) - len(sizes) + 1)
    new = [_local_size(node, s, dim + i, out, axes) for i, s in enumerate(sizes)]
    if new != sizes:
        args = list(node.args)
        args[2] = tuple(new)
        node.args = tuple(args)


def _split(node, axes):
    """``split`` of a fused projection's output along its sharded dim: local part sizes."""
    x = info(node.args[0]).value
    if not isinstance(x, TensorInfo):
        return
    nd = len(x.shape)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim % nd
    sharded = _sharding(x, dim)
    if not sharded:
        return
    k = math.prod(axes[a] for a in sharded)
    sizes = node.args[1]
    new = sizes // k if isinstance(sizes, int) else type(sizes)(s // k for s in sizes)
    node.args = (node.args[0], new, *node.args[2:])
