"""Runtime collectives called by the graphs that fxshard generates.

Every public op takes the mesh axis *name* as a literal string
(``all_reduce(x, "tp")``) and resolves it, at run time, through the mesh bound by
:func:`bind_mesh` (``fxshard.transform`` binds one).  The generated code is
therefore identical on every rank and stays readable in dumps.

The ops are ``torch.autograd.Function``\\ s with Megatron's f/g semantics
(docs/design.md §6), not the raw functional collectives, whose backward would
scale replicated gradients by the group size:

==============================  ==================  ==========================
op                              forward             backward
==============================  ==================  ==========================
``all_reduce``   P -> R         all-reduce          identity (1/n for avg)
``reduce_scatter`` P -> S(d)    reduce-scatter      all-gather
``all_gather``   S(d) -> R      all-gather          local chunk (grad R) or
                                                    reduce-scatter (grad P)
``shard``        R -> S(d)      local chunk         all-gather
``all_to_all``   S(i) -> S(j)   all-to-all          all-to-all back
``grad_sync``                   identity            all-reduce (sum or avg; over
                                                    ``replicas`` ranks of the axis)
``grad_sync_bucket``            identity            one all-reduce of all the
                                                    gradients, flattened
==============================  ==================  ==========================

Communication goes through ``torch.ops._c10d_functional`` (followed by
``wait_tensor``) with the process-group *name*, so ``torch.compile`` sees the
collectives.  On an axis of size 1 every op returns its input unchanged.

Each op is registered with ``torch.fx.wrap`` so that re-tracing a transformed
graph keeps it as a single leaf ``call_function`` node.
"""
from __future__ import annotations

import contextlib
import functools
import math

from typing import Any, Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._local_tensor import enabled_local_tensor_mode

from fxshard.layout.placements import chunk
from fxshard.plan.mesh import Mesh, MeshSpec, mesh_shape

__all__ = [
    "bind_mesh",
    "bound_mesh",
    "axis_size",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "shard",
    "all_to_all",
    "grad_sync",
    "grad_sync_bucket",
    "local_sizes",
    "local_span",
    "reduce_over",
    "hold_param_syncs",
    "held_back",
    "started_grad_syncs",
]

_c10d = torch.ops._c10d_functional

# The only global state of fxshard: the bound mesh and, per axis, what the ops need.
#   "mesh": DeviceMesh | MeshSpec
#   "axes": {axis: _Axis}
_BINDING: dict[str, Any] = {}

_UNBOUND_MSG = "no device mesh is bound: fxshard.transform(...) binds one, or call fxshard.bind_mesh(mesh)"


class _Axis:
    """What the ops need about one mesh axis (cached at bind time)."""

    __slots__ = ("name", "size", "group_name", "local_index")

    def __init__(self, name: str, size: int, group_name: Optional[str], local_index: Optional[int]):
        self.name = name
        self.size = size
        self.group_name = group_name  # None for a MeshSpec
        self.local_index = local_index  # None for a MeshSpec or when bound under simulated ranks


# --------------------------------------------------------------------------- binding


def bind_mesh(mesh: Optional[Mesh]) -> Optional[Mesh]:
    """Bind ``mesh`` (a ``DeviceMesh`` with named dims, or a ``MeshSpec``) for the ops.

    Caches, per axis, its size and, for a ``DeviceMesh``, the process-group name and
    this rank's index on the axis.  ``bind_mesh(None)`` unbinds.  Returns the
    previously bound mesh (or ``None``) so callers can restore it.
    """
    previous = _BINDING.get("mesh")
    if mesh is None:
        _BINDING.clear()
        return previous
    shape = mesh_shape(mesh)  # validates the type and the dim names
    axes: dict[str, _Axis] = {}
    if isinstance(mesh, MeshSpec):
        for name, size in shape.items():
            axes[name] = _Axis(name, int(size), None, None)
    else:
        simulated = enabled_local_tensor_mode() is not None
        for name, size in shape.items():
            group_name = mesh.get_group(name).group_name
            # Under simulated ranks the index is a per-rank SymInt: read it at run time.
            local_index = None if simulated else int(mesh.get_local_rank(name))
            axes[name] = _Axis(name, int(size), group_name, local_index)
    _BINDING.clear()
    _BINDING["mesh"] = mesh
    _BINDING["axes"] = axes
    return previous


def replica_axis(axis: str, replicas: int) -> _Axis:
    """The ``replicas`` consecutive ranks of ``axis`` that hold the same shard (a KV head
    replicated over the ranks whose query heads use it, ``colwise(heads=...)``), as an
    axis of their own: the bound mesh's ``axis`` unflattened to ``(size // replicas,
    replicas)``.  Made once per binding (creating process groups is collective: every rank
    does it, in the same order)."""
    ax = comm_axis(axis, "grad_sync")
    if replicas == ax.size:
        return ax
    if replicas < 1 or ax.size % replicas:
        raise ValueError(f"fxshard.grad_sync: {replicas} replicas do not divide the {ax.size} ranks of axis {axis!r}")
    cache = _BINDING.setdefault("replicas", {})
    if (axis, replicas) not in cache:
        mesh = bound_mesh()
        names = (f"{axis}_heads_{replicas}", f"{axis}_replicas_{replicas}")
        sub = mesh._unflatten(axis, (ax.size // replicas, replicas), names)
        cache[(axis, replicas)] = _Axis(names[1], replicas, sub.get_group(names[1]).group_name, None)
    return cache[(axis, replicas)]


def bind_replica_groups(gm) -> None:
    """Make the replica groups the gradient syncs of ``gm`` use (none for a ``MeshSpec``)."""
    if isinstance(_BINDING.get("mesh"), MeshSpec):
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (grad_sync, grad_sync_bucket) and node.kwargs.get("replicas"):
            replica_axis(node.args[1], node.kwargs["replicas"])


@contextlib.contextmanager
def binding_kept():
    """Whatever ``transform`` binds inside is unbound on exit, and the binding from before
    comes back as it was (``auto_plan``'s trial transforms bind a ``MeshSpec``)."""
    saved = dict(_BINDING)
    try:
        yield
    finally:
        _BINDING.clear()
        _BINDING.update(saved)


def bound_mesh() -> Mesh:
    """The mesh bound by :func:`bind_mesh`; ``RuntimeError`` when none is bound."""
    mesh = _BINDING.get("mesh")
    if mesh is None:
        raise RuntimeError(_UNBOUND_MSG)
    return mesh


def mesh_axis(axis: str) -> _Axis:
    bound_mesh()
    axes: dict[str, _Axis] = _BINDING["axes"]
    try:
        return axes[axis]
    except KeyError:
        raise ValueError(
            f"mesh axis {axis!r} is not on the bound mesh, whose axes are {list(axes)}"
        ) from None


def axis_size(axis: str) -> int:
    """Size of mesh axis ``axis`` of the bound mesh (no communication; works for a MeshSpec)."""
    return mesh_axis(axis).size


def comm_axis(axis: str, op: str) -> _Axis:
    """Resolve ``axis`` for a collective; refuse an offline (MeshSpec) binding."""
    ax = mesh_axis(axis)
    if ax.group_name is None:
        raise RuntimeError(
            f"fxshard.{op}(..., {axis!r}): the bound mesh is {bound_mesh()}, so this graph was transformed "
            f"offline with a MeshSpec; transform it with a DeviceMesh (init_device_mesh) to run it"
        )
    return ax


def local_index(ax: _Axis):
    """This rank's index on the axis: an int, or a per-rank SymInt under simulated ranks."""
    if enabled_local_tensor_mode() is not None or ax.local_index is None:
        return bound_mesh().get_local_rank(ax.name)
    return ax.local_index


def _norm_dim(x: torch.Tensor, dim: int, op: str) -> int:
    nd = x.dim()
    if not -nd <= dim < nd:
        raise IndexError(f"fxshard.{op}: dim {dim} is out of range for a tensor of {nd} dims (shape {tuple(x.shape)})")
    return dim % nd


def _check_divisible(x: torch.Tensor, dim: int, ax: _Axis, op: str) -> None:
    if x.size(dim) % ax.size != 0:
        raise ValueError(
            f"fxshard.{op}: dim {dim} of a tensor of shape {tuple(x.shape)} has size {x.size(dim)}, "
            f"which is not divisible by the size {ax.size} of mesh axis {ax.name!r}"
        )


# --------------------------------------------------------------------------- raw collectives


def raw_all_reduce(x: torch.Tensor, ax: _Axis, op: str = "sum", wait: bool = True) -> torch.Tensor:
    """``wait=False``: the all-reduce is only issued; ``_c10d.wait_tensor`` of the result waits."""
    reduced = _c10d.all_reduce(x.contiguous(), op, ax.group_name)
    return _c10d.wait_tensor(reduced) if wait else reduced


def _padded(x: torch.Tensor, dim: int, length) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``length``: uneven pieces made equal
    for a collective that needs them so."""
    shape = list(x.shape)
    shape[dim] = length - x.size(dim)
    return torch.cat([x, x.new_zeros(shape)], dim)


def raw_all_gather(x: torch.Tensor, dim: int, ax: _Axis, size: int | None = None, lengths: list | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (``dim`` normalized).  The collective
    stacks the ranks' tensors on dim 0; they are concatenated along ``dim`` with one
    ``cat`` (not two transposing copies of the whole tensor: 10x slower on logits).
    ``size``: the gathered dim's size when the axis does not divide it: the ranks' unequal
    ``torch.chunk`` pieces are padded to the largest, gathered, and cut back.
    ``lengths``: every rank's length of ``dim`` (from :func:`_piece_lengths`), where the
    gathered size is not known but read at run time."""
    n = ax.size
    if lengths is not None:
        step = functools.reduce(torch.sym_max, lengths)
        y = _c10d.wait_tensor(_c10d.all_gather_into_tensor(_padded(x, dim, step).contiguous(), n, ax.group_name))
        return torch.cat([piece.narrow(dim, 0, length) for length, piece in zip(lengths, y.chunk(n, 0))], dim)
    if size is None or size % n == 0:
        y = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), n, ax.group_name))
        return torch.cat(y.chunk(n, 0), dim) if dim != 0 else y
    step = -(-size // n)
    y = _c10d.wait_tensor(_c10d.all_gather_into_tensor(_padded(x, dim, step).contiguous(), n, ax.group_name))
    return torch.cat([piece.narrow(dim, 0, chunk(size, n, j)[1]) for j, piece in enumerate(y.chunk(n, 0))], dim)


def _piece_lengths(x: torch.Tensor, dim: int, ax: _Axis, size: int | None = None) -> list:
    """Every rank's length of ``dim``, in rank order on the axis, by one all-gather of an
    int each.  A gather of unequal pieces cannot take them from the example: a dynamic dim
    (batch, sequence) cut in pieces of 4 and 3 at length 7 is 4 and 4 at length 8, and no
    rank's own length tells the others' (4 is the first piece of both).

    A tensor without data (the meta device, a fake tensor: the planner's runs, a capture)
    has no lengths to exchange; they are read from the shapes (:func:`_shape_piece_lengths`)."""
    if x.device.type == "meta" or is_fake(x):
        return _shape_piece_lengths(x.size(dim), ax, size)
    mine = torch.full((1,), x.size(dim), dtype=torch.int64, device=x.device)
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(mine, ax.size, ax.group_name)).tolist()


def _shape_piece_lengths(length, ax: _Axis, size) -> list:
    """Every rank's length where only this rank's ``length`` and the example's gathered
    ``size`` are known: the example's ``torch.chunk`` pieces when this rank's piece is the
    example's (a static dim such as the vocabulary: 32000 over 3 ranks is 10667, 10667,
    10666), else ``length`` on every rank (the largest total whose piece here is ``length``)."""
    n = ax.size
    if size is not None and chunk(size, n, local_index(ax))[1] == length:
        return [chunk(size, n, j)[1] for j in range(n)]
    return [length] * n


def raw_reduce_scatter(x: torch.Tensor, dim: int, ax: _Axis) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's chunk along ``dim`` (``dim`` normalized).
    The collective scatters dim-0 chunks: the ``dim`` chunks are laid out on dim 0 first.
    A dim the axis does not divide is padded to equal chunks, and each rank keeps its
    ``torch.chunk`` piece of the sum."""
    n, size = ax.size, x.size(dim)
    uneven = size % n != 0
    if uneven:
        x = _padded(x, dim, n * -(-size // n))
    y = torch.cat(x.chunk(n, dim), 0) if dim != 0 else x.contiguous()
    y = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(y, "sum", n, ax.group_name))
    return y.narrow(dim, 0, chunk(size, n, local_index(ax))[1]) if uneven else y


def _local_chunk(x: torch.Tensor, dim: int, ax: _Axis) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``x`` along ``dim`` (smaller, or empty, on the
    last ranks where the axis does not divide the dim)."""
    size, n = x.size(dim), ax.size
    lm = enabled_local_tensor_mode()
    if lm is not None and not hasattr(x, "_local_tensors"):
        x = lm.rank_map(lambda r: x.clone())  # a plain tensor is the same on every simulated rank
    if size % n == 0:
        return x.narrow(dim, local_index(ax) * (size // n), size // n).contiguous()
    return x.narrow(dim, *chunk(size, n, local_index(ax))).contiguous()


def local_sizes(sizes, axis: str) -> list:
    """This rank's lengths of the parts ``sizes`` of a fused dim sharded on ``axis``, each part
    cut on its own in ``torch.chunk`` pieces (``colwise(splits=[30, 30])`` on 4 ranks: ``[8, 8]``,
    the last rank ``[6, 6]``): the split sizes of an uneven fused projection's output.

    Example: ``gate, up = fxshard.local_sizes([30, 30], "tp")``
    """
    ax = mesh_axis(axis)
    index = local_index(ax) if ax.group_name is not None else 0
    return [chunk(int(s), ax.size, index)[1] for s in sizes]


def local_span(sizes, axis: str, start: int, stop: int) -> tuple:
    """This rank's ``(start, length)`` of the parts in ``[start, stop)`` of a fused dim (global
    bounds on part boundaries, ``qkv[..., q:q + kv]``), each part cut in ``torch.chunk`` pieces:
    the arguments of a ``narrow``.

    Example: ``k = qkv.narrow(-1, *fxshard.local_span([64, 30, 30], "tp", 64, 94))``
    """
    local, lo, hi, pos = local_sizes(sizes, axis), 0, 0, 0
    for size, mine in zip(sizes, local):
        if pos < start:
            lo = lo + mine
        if pos < stop:
            hi = hi + mine
        pos += size
    return lo, hi - lo


def local_offset(axis: str, block: int, like: torch.Tensor):
    """``index_on_axis * block`` for this rank: an int, or under simulated ranks a
    per-rank tensor (SymInt arithmetic with plain tensors is not simulated)."""
    ax = mesh_axis(axis)
    lm = enabled_local_tensor_mode()
    if lm is None:
        return local_index(ax) * block
    ints = bound_mesh().get_local_rank(axis).node._local_ints
    return lm.rank_map(lambda r: torch.tensor(ints[r] * block, dtype=like.dtype, device=like.device))


def _raw_all_to_all(x: torch.Tensor, src: int, dst: int, ax: _Axis) -> torch.Tensor:
    """Split ``x`` along ``dst`` into one piece per rank, exchange, concat along ``src``."""
    n = ax.size
    m = x.size(dst) // n
    # (n, *piece): piece j goes to rank j.
    send = torch.stack(x.split(m, dst), 0).contiguous()
    flat = send.flatten(0, 1)  # x has >= 2 dims (src != dst), so send has >= 3
    rows = flat.size(0) // n
    recv = _c10d.wait_tensor(_c10d.all_to_all_single(flat, [rows] * n, [rows] * n, ax.group_name))
    recv = recv.view(send.shape)  # recv[j] = piece from rank j
    # Received pieces are consecutive chunks of the ``src`` dim, in rank order.
    return recv.movedim(0, src).flatten(src, src + 1).contiguous()


# --------------------------------------------------------------------------- autograd functions


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, op):
        ctx.scale = 1.0 / ax.size if op == "avg" else None
        y = raw_all_reduce(x, ax)
        return y if ctx.scale is None else y * ctx.scale  # gloo has no AVG: sum, then scale

    @staticmethod
    def backward(ctx, g):
        # avg: each rank's share entered the mean with weight 1/n
        return (g if ctx.scale is None else g * ctx.scale), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, dim, op):
        ctx.ax, ctx.dim, ctx.size = ax, dim, x.size(dim)
        ctx.scale = 1.0 / ax.size if op == "avg" else None
        y = raw_reduce_scatter(x, dim, ax)
        return y if ctx.scale is None else y * ctx.scale

    @staticmethod
    def backward(ctx, g):
        gx = raw_all_gather(g, ctx.dim, ctx.ax, ctx.size)
        return (gx if ctx.scale is None else gx * ctx.scale), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, dim, grad_partial, size):
        ctx.ax, ctx.dim, ctx.grad_partial = ax, dim, grad_partial
        if size is not None and size % ax.size:  # unequal pieces: their lengths at run time, not the example's
            return raw_all_gather(x, dim, ax, lengths=_piece_lengths(x, dim, ax, size))
        return raw_all_gather(x, dim, ax, size)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_partial:
            gx = raw_reduce_scatter(g, ctx.dim, ctx.ax)
        else:
            gx = _local_chunk(g, ctx.dim, ctx.ax)
        return gx, None, None, None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, dim):
        ctx.ax, ctx.dim, ctx.size = ax, dim, x.size(dim)
        return _local_chunk(x, dim, ax)

    @staticmethod
    def backward(ctx, g):
        return raw_all_gather(g, ctx.dim, ctx.ax, ctx.size), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, src, dst):
        ctx.ax, ctx.src, ctx.dst = ax, src, dst
        return _raw_all_to_all(x, src, dst, ax)

    @staticmethod
    def backward(ctx, g):
        return _raw_all_to_all(g, ctx.dst, ctx.src, ctx.ax), None, None, None


# --------------------------------------------------------------------------- gradient accumulation
#
# Under ``fxshard.no_sync`` the gradient syncs of *parameters* (a replicated weight whose
# gradient is Partial: sequence-parallel norms, a batch-sharded axis, shared KV heads) hold
# their rank-local gradient back instead of all-reducing it; the first sync outside adds
# what was held back and reduces the sum once (a sum of all-reduces is the all-reduce of
# the sum).  Syncs of activations (Megatron's f before a column-parallel linear) are
# needed by the rest of every backward and always run.  Held back per parameter, apart
# from ``.grad``: the parameter may also have uses whose gradient is already complete.
_HELD: dict[tuple[int, str], tuple[Any, torch.Tensor]] = {}  # (id(param), axis group) -> (weakref, held-back sum)


def _leaf_params(xs) -> tuple:
    return tuple(x if isinstance(x, torch.nn.Parameter) or (x.is_leaf and x.requires_grad) else None for x in xs)


def hold_param_syncs(enabled: bool) -> bool:
    """Hold the gradient syncs of parameters back (``fxshard.no_sync``); returns the
    previous setting."""
    previous = bool(_BINDING.get("hold_param_syncs", False))
    _BINDING["hold_param_syncs"] = enabled
    return previous


def held_back() -> int:
    """How many parameters' gradients are held back, waiting for a sync."""
    return sum(1 for ref, _ in _HELD.values() if ref() is not None)


def held_gradient(g: torch.Tensor) -> torch.Tensor:
    """What a parameter receives from a sync held back: zeros of its gradient's shape and dtype.
    The sum arrives with the first sync outside ``no_sync``.  Not ``None``: under FSDP2's mixed
    precision, a parameter that gets no gradient in the held backwards has none to accumulate
    in fp32 while the others do, and FSDP's reduce-scatter refuses gradients of mixed dtypes."""
    return torch.zeros_like(g)


def _hold_or_add(params: tuple, gs: tuple, ax: _Axis):
    """``None`` if every gradient of ``gs`` belongs to a parameter and syncs are held back
    (each is added to what is held); else ``gs`` with what was held back added."""
    import weakref

    if torch.compiler.is_compiling():
        # a compiled graph keeps no Python state from one backward to the next: traced, a
        # sync always reduces (under no_sync: the same numbers, one all-reduce per backward)
        return tuple(gs)
    hold = _BINDING.get("hold_param_syncs")
    if not hold and not _HELD:  # nothing to hold nor to add (and no id() a compiler would guard on, per parameter)
        return tuple(gs)
    if params and all(p is not None for p in params) and hold:
        for p, g in zip(params, gs):
            key = (id(p), ax.group_name)
            ref, held = _HELD.get(key, (None, None))
            if ref is None or ref() is not p:
                _HELD[key] = (weakref.ref(p), g.detach().clone())
            else:
                held.add_(g.detach())
        return None
    out = []
    for p, g in zip(params or (None,) * len(gs), gs):
        entry = _HELD.pop((id(p), ax.group_name), None) if p is not None else None
        out.append(g + entry[1] if entry is not None and entry[0]() is p else g)
    return tuple(out)


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, op):
        ctx.ax, ctx.op, ctx.params = ax, op, _leaf_params((x,))
        return x

    @staticmethod
    def backward(ctx, g):
        gs = _hold_or_add(ctx.params, (g,), ctx.ax)
        if gs is None:  # held back: a zero, not no gradient (see held_gradient)
            return held_gradient(g), None, None
        g = raw_all_reduce(gs[0], ctx.ax)
        return (g / ctx.ax.size if ctx.op == "avg" else g), None, None


class _GradSyncBucket(torch.autograd.Function):
    """Identity on several tensors; backward all-reduces their gradients as one flat
    buffer.  Autograd runs it once every output's gradient is complete, as DDP fires a
    bucket once its last gradient is ready.  ``overlap``: the all-reduce is only started
    there, and waited on at the end of the backward (:func:`_start_bucket`)."""

    @staticmethod
    def forward(ctx, ax, op, overlap, *xs):
        ctx.ax, ctx.op, ctx.params = ax, op, _leaf_params(xs)
        # a compiled graph waits where it reduces (no autograd-engine callback in a traced
        # backward); inductor may still move the wait (reorder_for_compute_comm_overlap)
        ctx.overlap = overlap and not torch.compiler.is_compiling()
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        held = gs
        gs = _hold_or_add(ctx.params, gs, ctx.ax)
        if gs is None:  # held back: zeros, not no gradients (see held_gradient)
            return (None, None, None) + tuple(held_gradient(g) for g in held)
        # mixed precision (FSDP2's param_dtype) may hand gradients of several dtypes:
        # reduce in the widest one, return each in its own
        dtype = gs[0].dtype
        for g in gs[1:]:
            dtype = torch.promote_types(dtype, g.dtype)
        flat = torch.cat([g.reshape(-1).to(dtype) for g in gs])
        if ctx.overlap and _accumulated_by_engine(ctx):
            _start_bucket(flat, ctx.ax, ctx.op, ctx.params, gs)
            return (None, None, None) + (None,) * len(ctx.params)
        flat = raw_all_reduce(flat, ctx.ax)
        if ctx.op == "avg":
            flat = flat / ctx.ax.size
        parts = flat.split([g.numel() for g in gs])
        return (None, None, None) + tuple(p.view(g.shape).to(g.dtype) for p, g in zip(parts, gs))


# --------------------------------------------------------------------------- overlapped bucket syncs
#
# DDP's overlap: a bucket's all-reduce is started in its backward and waited on at the end
# of that backward (a callback of the autograd engine), while autograd computes the
# gradients of the earlier layers.  The bucket hands autograd no gradient; the callback
# adds the reduced one into each parameter's ``.grad``, as autograd's AccumulateGrad would
# have (``.grad`` may hold an earlier micro-batch's gradient, or the parameter's other uses').
_STARTED: dict[int, list[tuple]] = {}  # autograd graph task id -> the buckets started in it, in order


def started_grad_syncs() -> int:
    """How many bucket all-reduces are started and not yet waited on (0 after every
    backward that finished)."""
    return sum(len(started) for started in _STARTED.values())


def _accumulated_by_engine(ctx) -> bool:
    """Whether this backward would add the bucket's gradients into its tensors' ``.grad``
    and nothing else: every member is a parameter whose AccumulateGrad this backward runs
    (``.backward()``, not ``torch.autograd.grad``, nor ``backward(inputs=...)`` leaving
    one out), without ``create_graph`` and without gradient hooks on the parameters.
    Anything else takes the synchronous path, which returns the gradients to autograd."""
    if torch.is_grad_enabled() or not ctx.params or any(p is None for p in ctx.params):
        return False
    for (node, _), p in zip(ctx.next_functions, ctx.params):
        if not isinstance(node, torch._C._functions.AccumulateGrad) or p._backward_hooks \
                or getattr(p, "_post_accumulate_grad_hooks", None):
            return False
        try:
            if not torch._C._will_engine_execute_node(node):
                return False
        except RuntimeError:  # torch.autograd.grad(): the engine returns leaf gradients, never stores them
            return False
    return True


def _start_bucket(flat: torch.Tensor, ax: _Axis, op: str, params: tuple, gs: tuple) -> None:
    """Issue the all-reduce of ``flat`` without waiting; the first bucket of a backward
    queues the callback that finishes them all at its end."""
    task = torch._C._current_graph_task_id()
    started = _STARTED.get(task)
    if started is None:
        started = _STARTED[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_finish_buckets, task))
    reduced = raw_all_reduce(flat, ax, wait=False)
    started.append((reduced, ax.size if op == "avg" else None, params, [(g.shape, g.dtype) for g in gs]))


def _finish_buckets(task: int) -> None:
    """Wait for the buckets started in backward ``task``, in issue order, and add each
    reduced gradient into its parameter's ``.grad``."""
    with torch.no_grad():
        for reduced, divide_by, params, shapes in _STARTED.pop(task, ()):
            flat = _c10d.wait_tensor(reduced)
            if divide_by is not None:
                flat = flat / divide_by
            parts = flat.split([math.prod(shape) for shape, _ in shapes])
            for p, part, (shape, dtype) in zip(params, parts, shapes):
                g = part.view(shape).to(dtype)
                if p.grad is None:
                    # a view of the bucket, as DDP's gradient_as_bucket_view; a copy where the
                    # parameter's strides differ (AccumulateGrad's layout contract)
                    p.grad = g if g.stride() == p.stride() else torch.empty_like(p, dtype=dtype).copy_(g)
                else:
                    p.grad += g


# --------------------------------------------------------------------------- public ops


def _check_op(op: str, name: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"fxshard.{name}: op must be 'sum' or 'avg' (the reduction of a Partial value), got {op!r}")


def all_reduce(x: torch.Tensor, axis: str, op: str = "sum") -> torch.Tensor:
    """``Partial -> Replicate`` on ``axis``.

    Forward: all-reduce over the axis, a sum (``op="sum"``) or a mean (``op="avg"``,
    for ``Partial("avg")``, e.g. a mean over a sharded dim).  Backward: no
    communication: the incoming gradient is already replicated (scaled by ``1/n``
    for a mean, the weight each rank's share had).

    Example: ``y = fxshard.all_reduce(x, "tp")``
    """
    _check_op(op, "all_reduce")
    ax = comm_axis(axis, "all_reduce")
    if ax.size == 1:
        return x
    return _AllReduce.apply(x, ax, op)


def reduce_scatter(x: torch.Tensor, axis: str, dim: int, op: str = "sum") -> torch.Tensor:
    """``Partial -> Shard(dim)`` on ``axis``.

    Forward: reduce-scatter (``op="sum"`` or ``"avg"``) along ``dim``; rank ``i`` keeps
    chunk ``i`` (``torch.chunk``'s piece: unequal where the axis does not divide the dim).
    Backward: all-gather of the gradient along ``dim`` (scaled by ``1/n`` for ``"avg"``).
    """
    _check_op(op, "reduce_scatter")
    ax = comm_axis(axis, "reduce_scatter")
    dim = _norm_dim(x, dim, "reduce_scatter")
    if ax.size == 1:
        return x
    return _ReduceScatter.apply(x, ax, dim, op)


def all_gather(x: torch.Tensor, axis: str, dim: int, grad: str = "replicate", size: int | None = None) -> torch.Tensor:
    """``Shard(dim) -> Replicate`` on ``axis``.

    Forward: all-gather along ``dim`` (rank order).  Backward depends on the layout
    of the incoming gradient: ``grad="replicate"`` takes this rank's chunk of it, no
    communication; ``grad="partial"`` reduce-scatters it along ``dim`` (a grad sync
    folded into the gather, as in Megatron's sequence parallelism).  ``size``: the
    gathered size of ``dim`` in the example where the axis does not divide it: the ranks
    hold unequal ``torch.chunk`` pieces, padded on the wire; their lengths are exchanged
    at run time (one all-gather of an int per rank), so a dynamic dim (batch, sequence)
    gathers right at other lengths than the example's.

    Example: ``logits = fxshard.all_gather(local_logits, "tp", -1, size=50257)``
    """
    if grad not in ("replicate", "partial"):
        raise ValueError(f"fxshard.all_gather: grad must be 'replicate' or 'partial', got {grad!r}")
    ax = comm_axis(axis, "all_gather")
    dim = _norm_dim(x, dim, "all_gather")
    if ax.size == 1:
        return x
    return _AllGather.apply(x, ax, dim, grad == "partial", size)


def shard(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """``Replicate -> Shard(dim)`` on ``axis``.

    Forward: this rank's ``torch.chunk`` piece of ``x`` along ``dim``, no communication
    (smaller on the last ranks where the axis does not divide the dim).  Backward:
    all-gather of the gradient along ``dim``.
    """
    ax = comm_axis(axis, "shard")
    dim = _norm_dim(x, dim, "shard")
    if ax.size == 1:
        return x
    return _Shard.apply(x, ax, dim)


def all_to_all(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int) -> torch.Tensor:
    """``Shard(src_dim) -> Shard(dst_dim)`` on ``axis``.

    Forward: all-to-all; ``x`` is split along ``dst_dim`` into one piece per rank
    (``x.size(dst_dim)`` must be divisible by the axis size), piece ``j`` is sent to
    rank ``j``, and the received pieces are concatenated along ``src_dim`` in rank
    order.  Backward: the reverse all-to-all (``dst_dim -> src_dim``) of the gradient.
    """
    ax = comm_axis(axis, "all_to_all")
    src = _norm_dim(x, src_dim, "all_to_all")
    dst = _norm_dim(x, dst_dim, "all_to_all")
    if src == dst:
        raise ValueError(f"fxshard.all_to_all: src_dim and dst_dim are the same dim ({src_dim}, {dst_dim})")
    _check_divisible(x, dst, ax, "all_to_all")
    if ax.size == 1:
        return x
    return _AllToAll.apply(x, ax, src, dst)


def grad_sync(x: torch.Tensor, axis: str, op: str = "sum", *, replicas: int | None = None) -> torch.Tensor:
    """Gradient sync on ``axis``: the value's gradient is ``Partial`` there.

    Forward: identity, no communication.  Backward: all-reduce (sum) of the
    gradient, so every rank gets the full gradient (Megatron's "copy to region");
    ``op="avg"``: the mean over the axis (FSDP2's convention on its axis).
    ``replicas``: the sum runs over the groups of that many consecutive ranks of the
    axis, each holding the same shard (a replicated KV head, ``colwise(heads=...)``).

    Example: ``wk = fxshard.grad_sync(wk, "tp", replicas=2)``
    """
    _check_op(op, "grad_sync")
    ax = replica_axis(axis, replicas) if replicas else comm_axis(axis, "grad_sync")
    if ax.size == 1:
        return x
    return _GradSync.apply(x, ax, op)


def grad_sync_bucket(xs: list[torch.Tensor], axis: str, op: str = "sum", *,
                     replicas: int | None = None, overlap: bool = False) -> tuple[torch.Tensor, ...]:
    """Gradient sync of several tensors on ``axis`` with one collective (a bucket).

    Forward: identity on each tensor, no communication.  Backward: the gradients are
    flattened into one buffer and all-reduced together (``op="sum"``, or ``"avg"``:
    the mean over the axis), once all of them are complete; each is then the same
    as after its own :func:`grad_sync`.

    ``replicas``: as for :func:`grad_sync`.

    ``overlap=True`` (what ``fxshard.transform`` writes, unless ``overlap_grad_syncs=False``
    or under FSDP2): as DDP, the all-reduce is only *started* when the last gradient is
    ready, and waited on at the end of the backward, so it runs while autograd computes
    the earlier layers' gradients; the reduced gradients are then added into the
    parameters' ``.grad`` (same numbers as without overlap).  It applies where every
    member is a parameter whose ``.grad`` this backward fills (``loss.backward()``); with
    ``torch.autograd.grad``, ``create_graph=True``, a gradient hook on a parameter, or a
    member that is not a parameter (a view, another bucket's output), the bucket waits at
    once.  Under ``torch.compile`` the bucket takes the synchronous path: the compiled
    backward waits where it reduces (inductor may move the wait later with
    ``torch._inductor.config.reorder_for_compute_comm_overlap``).

    Example: ``norm_w, ffn_norm_w = fxshard.grad_sync_bucket([norm_w, ffn_norm_w], "tp", overlap=True)``
    """
    _check_op(op, "grad_sync_bucket")
    ax = replica_axis(axis, replicas) if replicas else comm_axis(axis, "grad_sync_bucket")
    if ax.size == 1 or not xs or not torch.is_grad_enabled():  # no backward (eval): the identity, also for dynamo
        return tuple(xs)
    return _GradSyncBucket.apply(ax, op, bool(overlap), *xs)


_VALUE_OPS = ("sum", "avg", "max", "min")


def reduce_over(x: torch.Tensor, axes=None, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over the mesh (no autograd): a norm's partial sums, a loss or a
    metric to log.  ``axes``: the axis names (default every axis of the bound mesh);
    one all-reduce per axis larger than 1; ``op``: ``"sum"``, ``"avg"``, ``"max"`` or
    ``"min"``.  Every rank gets the result.

    Example: ``fxshard.reduce_over(loss.detach(), op="avg")   # the mean of every rank's loss``
    """
    if op not in _VALUE_OPS:
        raise ValueError(f"fxshard.reduce_over: op must be one of {_VALUE_OPS}, got {op!r}")
    names = list(_BINDING["axes"]) if axes is None and "axes" in _BINDING else ([axes] if isinstance(axes, str) else list(axes or ()))
    if axes is None:
        bound_mesh()
    count = 1
    with torch.no_grad():
        for name in names:
            if mesh_axis(name).size == 1:  # nothing to reduce, also on a MeshSpec (a plan of pipeline parallelism alone)
                continue
            ax = comm_axis(name, "reduce_over")
            x = raw_all_reduce(x, ax, "sum" if op == "avg" else op)
            count *= ax.size
    return x / count if op == "avg" else x


torch.fx.wrap("axis_size")
torch.fx.wrap("local_sizes")
torch.fx.wrap("local_span")
torch.fx.wrap("all_reduce")
torch.fx.wrap("reduce_scatter")
torch.fx.wrap("all_gather")
torch.fx.wrap("shard")
torch.fx.wrap("all_to_all")
torch.fx.wrap("grad_sync")
torch.fx.wrap("grad_sync_bucket")

# Generated code names these ops by their qualified name: ``fxshard.all_reduce`` reads
# as ``fxshard_all_reduce(x, 'tp')`` in ``gm.code`` (the package re-exports them).
for _op in (all_reduce, reduce_scatter, all_gather, shard, all_to_all, grad_sync, grad_sync_bucket, local_sizes, local_span):
    _op.__module__ = "fxshard"
del _op
