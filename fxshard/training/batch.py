"""This rank's share of a global batch, as the plan lays the inputs out.

A transformed module takes, on every rank, the inputs the plan's ``inputs=`` layouts
describe: rows of the batch over a data-parallel axis (``{"dp": Shard(0)}``), a piece of
the sequence over a context-parallel one (load-balanced: chunks ``i`` and ``2n-1-i``).
:func:`shard_inputs` cuts the global batch that every rank reads (same seed, same data
order) into exactly that, from the layouts the transform recorded on the graph's
inputs, so a training loop reads the same with and without dp or cp.

Example::

    plan = fxshard.Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)},
                                                             "labels": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, example_kwargs=batch)
    args, kwargs = fxshard.shard_inputs(sharded, **batch)      # this rank's rows
    loss = sharded(*args, **kwargs).loss                        # this rank's mean
    logged = fxshard.reduce_over(loss.detach(), op="avg")      # the mean over the mesh, on every rank
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxshard.runtime import collectives
from fxshard.runtime.context_parallel_ops import split_sequence
from fxshard.errors import PlanError
from fxshard.meta import KEY, TensorInfo, program_meta
from fxshard.plan.mesh import mesh_shape

__all__ = ["shard_inputs"]


def shard_inputs(sharded: fx.GraphModule, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for this rank from the global ``args`` / ``kwargs``: every tensor
    input cut as its layout in the plan says (``Shard(d)`` over an axis: this rank's
    ``torch.chunk`` piece of dim ``d``; over a context-parallel axis: its sequence
    positions, load-balanced when the plan's :func:`fxshard.context_parallel` is); other
    inputs unchanged.  Needs the mesh the transform bound; no communication.

    Example: ``args, kwargs = fxshard.shard_inputs(sharded, input_ids=ids, labels=labels)``
    """
    if program_meta(sharded).state is None:
        raise PlanError("fxshard.shard_inputs: this module was not made by fxshard.transform\n"
                        "  fix: pass the module fxshard.transform returned")
    placeholders = [n for n in sharded.graph.nodes if n.op == "placeholder"]
    pytree_info = getattr(sharded.graph._codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.in_spec is not None:  # a captured model: inputs flattened by its spec
        import torch.fx._pytree as fx_pytree
        from torch.utils import _pytree as pytree

        flat = fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), pytree_info.in_spec)
        local = [_share(sharded, node, x) for node, x in zip(placeholders, flat)]
        out_args, out_kwargs = pytree.tree_unflatten(local, pytree_info.in_spec)
        return tuple(out_args), dict(out_kwargs)
    by_name = {n.target: n for n in placeholders}
    unknown = sorted(set(kwargs) - set(by_name))
    if unknown:
        raise PlanError(f"fxshard.shard_inputs: {unknown} are not inputs of the module (its inputs are {list(by_name)})")
    out_args = tuple(_share(sharded, node, x) for node, x in zip(placeholders, args))
    return out_args, {k: _share(sharded, by_name[k], v) for k, v in kwargs.items()}


def _share(sharded: fx.GraphModule, node: fx.Node, x: Any) -> Any:
    meta = node.meta.get(KEY)
    value = meta.value if meta is not None else None
    if not isinstance(x, torch.Tensor) or not isinstance(value, TensorInfo):
        return x
    cp_axes = program_meta(sharded).context_parallel or {}
    cuts = [(axis, p.dim) for axis, p in value.layout.items() if isinstance(p, Shard)]  # outer axes first
    # the sequence positions are picked from the global tensor (split_sequence reads a whole
    # one), then the other axes cut their dims: the same pieces when no two axes cut one dim
    sequence = [(a, d) for a, d in cuts if a in cp_axes]
    others = [(a, d) for a, d in cuts if a not in cp_axes]
    if sequence and len({d for _, d in cuts}) < len(cuts):
        raise PlanError(f"fxshard.shard_inputs: input {node.target!r} is cut on one dim by a context-parallel axis and "
                        f"another ({cuts}); cut it by hand with fxshard.split_sequence and fxshard.shard")
    _check_even(sharded, node, value, x, cuts)
    with torch.no_grad():
        t = x
        for axis, dim in sequence:
            t = split_sequence(t, axis, dim, load_balance=cp_axes[axis]["load_balance"])
        for axis, dim in others:
            t = collectives.shard(t, axis, dim)
        t = t if t is x else t.contiguous()
    return t.detach().requires_grad_(x.requires_grad) if t is not x else x


def _check_even(sharded: fx.GraphModule, node: fx.Node, value: TensorInfo, x: torch.Tensor, cuts) -> None:
    """A dim the example's axis divided must divide now: the program computes each rank's
    positions as its index times its own length, which holds only for equal pieces."""
    axes = program_meta(sharded).mesh or {}
    for axis, dim in cuts:
        n = axes.get(axis, 1)
        if n > 1 and value.shape[dim] % n == 0 and x.size(dim) % n:
            raise PlanError(f"fxshard.shard_inputs: input {node.target!r} has {x.size(dim)} along dim {dim}, which the "
                            f"{n} ranks of axis {axis!r} do not divide; the program was transformed at "
                            f"{value.shape[dim]}, which they do, so it assumes equal pieces (each rank's positions are "
                            f"its index times its own length)\n  fix: pad dim {dim} to a multiple of {n}, or transform "
                            f"with an example whose dim {dim} the axis does not divide (the pieces' lengths are then "
                            f"exchanged at run time)")


# ----------------------------------------------------------------------------- pieces cut by hand


@dataclass(frozen=True)
class EqualPiece:
    """Input ``name`` (placeholder ``index``) is cut on ``dim`` over ``axis`` and the program
    assumes equal pieces there: the example's ``size`` was divided by the axis's ``n`` ranks."""

    index: int
    name: str
    dim: int
    axis: str
    n: int
    size: int


def equal_pieces(gm: fx.GraphModule) -> list[EqualPiece]:
    """The inputs of a transformed program whose pieces must be equal on every rank of an axis:
    a dim the example's axis divided, sharded on a context-parallel axis or on an axis that
    shards parameters (the sequence under sequence parallelism).  A purely data-parallel
    axis (no parameter sharded on it, not context-parallel: the batch rows over ``dp``) may
    hold unequal rows: nothing there assumes equal ones."""
    program = program_meta(gm)
    axes = program.mesh or {}
    cp_axes = program.context_parallel or {}
    param_axes = {a for layout, _ in (program.state or {}).values() for a, p in (layout or {}).items()
                  if isinstance(p, Shard)}
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value = getattr(node.meta.get(KEY), "value", None)
        if not isinstance(value, TensorInfo):
            continue
        for axis, p in value.layout.items():
            n = axes.get(axis, 1)
            # the rows of a batch (dim 0) split over an expert-parallel axis travel by counts (all-to-all):
            # like data parallelism, uneven rows are exact there
            along_rows = p.dim % len(value.shape) == 0 if isinstance(p, Shard) else False
            if (isinstance(p, Shard) and n > 1 and (axis in cp_axes or (axis in param_axes and not along_rows))
                    and isinstance(value.shape[p.dim], int) and value.shape[p.dim] % n == 0):
                out.append(EqualPiece(index, node.target, p.dim % len(value.shape), axis, n, value.shape[p.dim]))
    return out


class EqualPiecesGuard:
    """Forward pre-hook of :func:`guard_equal_pieces`: before any collective, the ranks
    compare the lengths of the pieces they were given (one all-reduce of a few ints per
    axis; where the mesh has other axes, one more to agree), and every rank raises the same
    PlanError when some axis's ranks hold unequal pieces, so that no rank is left waiting in
    a collective its peers never enter."""

    def __init__(self, pieces, model: str, order):
        self.pieces, self.model, self.order = tuple(pieces), model, order

    def __call__(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            # the check is a collective and a Python branch on its result: a compiled program
            # (fullgraph) cannot hold it, so there the pieces are the caller's to cut equal
            # (fxshard.shard_inputs does; docs/training.md)
            return None
        flat = self.order.flatten(args, kwargs)
        given = [(p, flat[p.index]) for p in self.pieces if p.index < len(flat) and isinstance(flat[p.index], torch.Tensor)
                 and flat[p.index].dim() > p.dim]
        if given:
            check_equal_pieces(given, self.model)
        return None


def check_equal_pieces(given, model: str) -> None:
    """Raise the same PlanError on every rank when the ranks of an axis hold pieces of unequal
    lengths of an input that must be cut in equal ones (``given``: ``(EqualPiece, tensor)``)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    spreads = _simulated_spreads(given) if enabled_local_tensor_mode() is not None else _spreads(given)
    bad = [(p, x, lo, hi) for (p, x), (lo, hi, unequal) in zip(given, spreads) if unequal]
    if not bad:
        return
    p, x, lo, hi = bad[0]
    where = (f"the ranks of axis {p.axis!r} hold {lo} to {hi}" if lo != hi else
             f"ranks of axis {p.axis!r} elsewhere on the mesh hold unequal pieces")
    raise PlanError(
        f"input {p.name!r} of {model} has {x.size(p.dim)} on dim {p.dim} on this rank, and {where}: the program was "
        f"transformed at {p.size}, which the {p.n} ranks of {p.axis!r} divide, so it assumes every rank holds an equal "
        f"piece (each rank's positions are its index times its own length, and the pieces are exchanged as equal "
        f"ones); unequal pieces would compute wrong positions or fail inside a collective\n  fix: pad dim {p.dim} to a "
        f"multiple of {p.n} and give every rank its equal piece (fxshard.shard_inputs(sharded, ...) cuts the global "
        f"batch so; a piece cut by hand, as ids.chunk({p.n}, {p.dim}) of an odd length, is not equal)")


def _spreads(given) -> list[tuple[int, int, bool]]:
    """Per piece, ``(min, max)`` of its length over this rank's group of its axis, and whether
    some group of the mesh holds unequal pieces of it (the same answer on every rank)."""
    by_axis: dict[str, list[int]] = {}
    for i, (p, _) in enumerate(given):
        by_axis.setdefault(p.axis, []).append(i)
    mesh = collectives.bound_mesh()
    device = next((x.device for _, x in given if x.device.type == mesh.device_type), torch.device(mesh.device_type))
    spans: list = [None] * len(given)
    for axis, idx in by_axis.items():
        lengths = [int(given[i][1].size(given[i][0].dim)) for i in idx]
        t = torch.tensor(lengths + [-v for v in lengths], dtype=torch.int64, device=device)
        t = collectives.raw_all_reduce(t, collectives.comm_axis(axis, "check of the input pieces"), "max").tolist()
        for k, i in enumerate(idx):
            spans[i] = (-t[len(idx) + k], t[k])
    unequal = [lo != hi for lo, hi in spans]
    shape = mesh_shape(mesh)
    others = [a for a, n in shape.items() if n > 1 and (len(by_axis) > 1 or a not in by_axis)]
    if others:  # every group agrees: a rank whose own group is fine must not go on into a collective alone
        flags = torch.tensor(unequal, dtype=torch.int64, device=device)
        for a in others:
            flags = collectives.raw_all_reduce(flags, collectives.comm_axis(a, "check of the input pieces"), "max")
        unequal = [bool(f) for f in flags.tolist()]
    return [(lo, hi, u) for (lo, hi), u in zip(spans, unequal)]


def _simulated_spreads(given) -> list[tuple[int, int, bool]]:
    """:func:`_spreads` under simulated ranks: every rank's length is read here."""
    mesh = collectives.bound_mesh()
    names = list(mesh.mesh_dim_names)
    out = []
    for p, x in given:
        size = x.size(p.dim)
        ints = getattr(getattr(size, "node", None), "_local_ints", None)
        if ints is None:
            out.append((int(size), int(size), False))
            continue
        per_rank = dict(ints)
        groups = mesh.mesh.movedim(names.index(p.axis), -1).reshape(-1, p.n).tolist()
        spans = [(min(per_rank[r] for r in g), max(per_rank[r] for r in g)) for g in groups]
        lo, hi = next((s for s in spans if s[0] != s[1]), spans[0])
        out.append((lo, hi, lo != hi))
    return out


def guard_equal_pieces(gm: fx.GraphModule) -> list[EqualPiece]:
    """Give ``gm`` a pre-hook that checks its inputs' pieces are equal where the program
    assumes so (:func:`equal_pieces`), if it has any; returns them."""
    pieces = equal_pieces(gm)
    if pieces:
        from fxshard.frontend.capture import InputOrder

        guard = EqualPiecesGuard(pieces, program_meta(gm).model_class or type(gm).__name__, InputOrder.of(gm))
        gm.register_forward_pre_hook(guard, with_kwargs=True)
    return pieces
