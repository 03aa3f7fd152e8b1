"""Static communication summary: every collective a transformed graph runs, forward
and backward, with its size for the example shapes.  No process group is needed.

Example::

    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan()), (ids,))
    summary = fxshard.comm_summary(sharded)
    print(summary)                                    # one row per collective + totals
    summary.count("forward", "all_reduce")            # -> 4 for a 2-layer Llama
    summary.nbytes("backward", axis="tp")             # bytes all-reduced by the grad syncs

The rows come from the autograd table of :mod:`fxshard.runtime` (docs/design.md §6),
read from ``node.meta["fxshard"].collective`` of each communication node:

==================  =================  ==========================================
fxshard op          forward            backward
==================  =================  ==========================================
``all_reduce``      all-reduce         --
``reduce_scatter``  reduce-scatter     all-gather
``all_gather``      all-gather         reduce-scatter if ``grad="partial"``, else --
``shard``           --                 all-gather
``all_to_all``      all-to-all         all-to-all
``grad_sync``       --                 all-reduce
``grad_sync_bucket``  --               one all-reduce of the members' gradients
``gathered_linears``  all-gather       all-gather (the kept shard, again), reduce-scatter
``ring_attention``  n-1 ring shifts    2n-1 ring shifts (K, V with dK, dV)
==================  =================  ==========================================

The loss-parallel functions of :mod:`fxshard.loss` communicate inside; their rows
(all-reduces of one value per token) are listed under the loss node.  Local regions
(sub-GraphModules, e.g. expert-parallel MoE blocks) are walked where they are called;
their dispatch/combine all-to-alls move as many tokens as the router sends, so their
sizes (``exact=False``, ``~`` in the table) are those of the example inputs.

A backward collective is listed only when gradient flows through the node: its input
depends on a parameter that requires grad (or on a floating-point graph input, with
``inputs_require_grad=True``).  An op on an axis of size 1 communicates nothing.

``bytes`` is the size of the larger buffer of the collective on one rank, as
``nccl-tests`` counts it: the tensor of an all-reduce or all-to-all, the gathered
output of an all-gather, the unscattered input of a reduce-scatter.  ``wire_bytes``
is what one rank sends with ring algorithms (``2 (n-1)/n`` of that for an
all-reduce, ``(n-1)/n`` for the others).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.fx as fx

from fxshard.debug.graph_walk import module_prefixes, block_module, module_path
from fxshard.meta import KEY, TensorInfo, pipeline_of, program_meta
from fxshard.plan.specs import pattern_regex
from fxshard.state.module_state import attribute

__all__ = ["CommRow", "CommTotal", "CommSummary", "comm_summary", "graph_rows", "in_region", "C10D_OPS", "P2P_OPS",
           "fmt_bytes"]

# The torch.ops._c10d_functional op each kind of collective runs (what torch.compile sees).
C10D_OPS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
    "ring_shift": "all_to_all_single",  # one block to the next rank of the ring (context parallelism)
}

# Point-to-point and process-group ops of a pipelined step (torch's ``c10d`` ops, not functional):
# a stage's activations sent to the next stage, their gradients sent back, the loss broadcast.
P2P_OPS = {"send": "send", "recv": "recv_", "broadcast": "broadcast_"}

PHASES = ("forward", "backward")
KINDS = (*C10D_OPS, *P2P_OPS)

# fxshard op -> (forward kind, backward kind); None: no communication in that phase.
_AUTOGRAD_TABLE = {
    "all_reduce": ("all_reduce", None),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "all_gather": ("all_gather", None),  # backward: reduce-scatter when grad="partial"
    "shard": (None, "all_gather"),
    "all_to_all": ("all_to_all", "all_to_all"),
    "grad_sync": (None, "all_reduce"),
    "grad_sync_bucket": (None, "all_reduce"),
}


@dataclass(frozen=True)
class CommRow:
    """One collective call of one phase (forward or backward) of a training step."""

    phase: str  # "forward" | "backward"
    kind: str  # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all"
    axis: str
    axis_size: int
    node: str  # name of the fxshard communication node
    op: str  # fxshard op of that node (all_reduce, grad_sync, shard, ...)
    region: str  # innermost module FQN of the node ("" at top level)
    shape: tuple[int, ...]  # local shape of the larger buffer
    dtype: torch.dtype
    bytes: int
    purpose: str = ""
    exact: bool = True  # False: a data-dependent size (MoE dispatch), shown for the example's shapes
    microbatch: int | None = None  # under pipeline parallelism: the micro-batch it runs for (None: once a step)
    peer: int | None = None  # a send / recv: the other rank, its coordinate on ``axis``

    @property
    def c10d_op(self) -> str:
        """The op this row runs: ``torch.ops._c10d_functional.<op>``, or ``torch.ops.c10d.<op>``
        for a point-to-point send / recv and a broadcast."""
        return C10D_OPS[self.kind] if self.kind in C10D_OPS else P2P_OPS[self.kind]

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends with a ring algorithm."""
        n = self.axis_size
        if n < 1:  # axis size unknown (a graph without ProgramMeta.mesh)
            return self.bytes
        if self.kind in ("ring_shift", "send", "broadcast"):
            return self.bytes  # the whole block goes to one neighbour (a broadcast: from its root, with a tree less)
        if self.kind == "recv":
            return 0
        factor = 2 * (n - 1) / n if self.kind == "all_reduce" else (n - 1) / n
        return int(round(self.bytes * factor))


@dataclass(frozen=True)
class CommTotal:
    """Count and bytes of the rows of one (phase, axis, kind)."""

    phase: str
    axis: str
    kind: str
    count: int
    bytes: int


@dataclass
class CommSummary:
    """Rows in execution order: forward in graph order, then backward in reverse graph order."""

    mesh: dict[str, int]
    rows: list[CommRow] = field(default_factory=list)

    def select(self, phase: str | None = None, kind: str | None = None, axis: str | None = None,
               region: str | None = None) -> list[CommRow]:
        """Rows matching every given filter; ``region`` is a module pattern (:func:`in_region`)."""
        for name, value, allowed in (("phase", phase, PHASES), ("kind", kind, KINDS)):
            if value is not None and value not in allowed:
                raise ValueError(f"comm summary: {name} must be one of {allowed}, got {value!r}")
        return [r for r in self.rows
                if (phase is None or r.phase == phase) and (kind is None or r.kind == kind)
                and (axis is None or r.axis == axis) and (region is None or in_region(r.region, region))]

    def count(self, phase: str | None = None, kind: str | None = None, axis: str | None = None,
              region: str | None = None) -> int:
        """Number of collective calls matching the filters (see :meth:`select`)."""
        return len(self.select(phase, kind, axis, region))

    def nbytes(self, phase: str | None = None, kind: str | None = None, axis: str | None = None,
               region: str | None = None) -> int:
        """Total ``bytes`` of the collective calls matching the filters."""
        return sum(r.bytes for r in self.select(phase, kind, axis, region))

    @property
    def forward(self) -> list[CommRow]:
        return self.select("forward")

    @property
    def backward(self) -> list[CommRow]:
        return self.select("backward")

    @property
    def totals(self) -> list[CommTotal]:
        """One :class:`CommTotal` per (phase, axis, kind) that occurs."""
        keys: dict[tuple[str, str, str], list[CommRow]] = {}
        for r in self.rows:
            keys.setdefault((r.phase, r.axis, r.kind), []).append(r)
        order = {a: i for i, a in enumerate(self.mesh)}
        return [CommTotal(p, a, k, len(rs), sum(r.bytes for r in rs))
                for (p, a, k), rs in sorted(keys.items(), key=lambda kv: (PHASES.index(kv[0][0]), order.get(kv[0][1], 99), kv[0][2]))]

    def by_region(self) -> dict[str, list[CommTotal]]:
        """Totals per module region (innermost module FQN of the communication node)."""
        regions: dict[str, list[CommRow]] = {}
        for r in self.rows:
            regions.setdefault(r.region, []).append(r)
        return {reg: CommSummary(self.mesh, rows).totals for reg, rows in regions.items()}

    def headline(self) -> str:
        """One line: calls and bytes per phase, e.g. ``forward 4 (16.0 KiB)  backward 4 (16.0 KiB)``."""
        parts = [f"{p} {self.count(p)} ({fmt_bytes(self.nbytes(p))})" for p in PHASES]
        return "  ".join(parts)

    def __str__(self) -> str:
        mesh = " ".join(f"{a}={n}" for a, n in self.mesh.items()) or "?"
        header = ["phase", "axis", "collective", "node", "op", "module", "local shape", "dtype", "bytes"]
        pipelined = any(r.microbatch is not None for r in self.rows)
        if pipelined:
            header.insert(0, "mb")
        # a group of an axis (the ranks sharing a replicated head) shows its size: tp/2
        body = [[r.phase, r.axis if r.axis_size in (0, self.mesh.get(r.axis)) else f"{r.axis}/{r.axis_size}",
                 r.kind if r.peer is None else f"{r.kind} {'to' if r.kind == 'send' else 'from'} {r.peer}",
                 r.node, r.op, r.region or "<top>", _fmt_shape(r.shape),
                 str(r.dtype).replace("torch.", ""), ("" if r.exact else "~") + fmt_bytes(r.bytes)] for r in self.rows]
        if pipelined:
            body = [["" if r.microbatch is None else str(r.microbatch), *row] for r, row in zip(self.rows, body)]
        lines = [f"fxshard comm summary  mesh: {mesh}  {self.headline()}"]
        if body:
            lines += _table(header, body)
        else:
            lines.append("(no communication)")
        if not all(r.exact for r in self.rows):
            lines.append("~ data-dependent size (expert-parallel dispatch), for the example's shapes")
        totals = [[t.phase, t.axis, t.kind, f"x{t.count}", fmt_bytes(t.bytes)] for t in self.totals]
        if totals:
            lines.append("totals")
            lines += ["  " + line for line in _table(["phase", "axis", "collective", "calls", "bytes"], totals)]
        return "\n".join(lines)


def comm_summary(gm: fx.GraphModule, region: str | None = None, *, inputs_require_grad: bool = False) -> CommSummary:
    """The collectives ``gm`` (a :func:`fxshard.transform` result) runs in one training step.

    Example::

        s = fxshard.comm_summary(sharded)
        assert s.count("forward", "all_reduce", axis="tp") == 2 * n_layers

    A pipelined module (:func:`fxshard.pipeline_transform`) answers with this rank's
    rows of one ``fxshard.train_step``: every micro-batch's sends and receives between
    stages and its stages' collectives, and the step's loss broadcast and tied-gradient
    sums (``PipelinedModule.comm_summary``, docs/pipeline.md).

    ``region``: a module pattern (``"layers.0"``, ``"layers.*.attention"``); keep only the
    collectives of the matching modules and their children.
    ``inputs_require_grad``: count backward collectives that only the gradient of a
    floating-point graph input would run (off by default: inputs are data).
    """
    if pipeline_of(gm) is not None:
        return gm.comm_summary(region)  # a pipelined module: its stages and what crosses between them
    mesh = dict(program_meta(gm).mesh or {})
    fwd_rows, bwd_rows = graph_rows(gm, mesh, region, [inputs_require_grad] * _n_inputs(gm))
    return CommSummary(mesh, fwd_rows + bwd_rows[::-1])


def graph_rows(gm: fx.GraphModule, mesh: dict, region: str | None, inputs_grad: list[bool], prefix: str = ""
               ) -> tuple[list[CommRow], list[CommRow]]:
    """The rows of ``gm``: (forward rows, backward rows), both in graph order; local regions
    (sub-GraphModules such as MoE blocks) are walked where they are called.
    ``inputs_grad``: whether each graph input requires grad (a pipeline stage's received
    activations do)."""
    grad = _requires_grad(gm, inputs_grad)
    dead = grad - _reaches_output(gm, grad)
    fwd_rows: list[CommRow] = []
    bwd_rows: list[CommRow] = []
    for node in gm.graph.nodes:
        reg = _join(prefix, module_path(node))
        sub = _local_region(gm, node)
        if sub is not None:
            inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
            bound = list(node.args) + [node.kwargs.get(ph.target) for ph in inputs[len(node.args):]]
            inner_grad = [isinstance(a, fx.Node) and a in grad for a in bound]
            f, b = graph_rows(sub, mesh, region, inner_grad, node.target)
            fwd_rows += f
            bwd_rows += b
            continue
        if region is not None and not in_region(reg, region):
            continue
        for phase, kind, axis, buffer, op, purpose in _calls(node):
            size = node.kwargs.get("replicas") or mesh.get(axis, 0)  # replicated heads: a group of the axis
            if size == 1:
                continue  # the runtime returns its input unchanged
            carrier = node.args[0] if node.args else None
            if op == "gathered_linears" and kind == "all_gather":  # gathered again for the weights' gradients too
                carrier = [node.args[0], *node.args[3]]
            if phase == "backward" and (not _carries_grad(carrier, grad) or node in dead):
                continue  # no gradient flows through this node, or none comes back to it
            shape, dtype = tuple(buffer.local_shape), buffer.dtype
            row = CommRow(phase, kind, axis, size, node.name, op, reg, shape, dtype,
                          math.prod(shape) * _itemsize(dtype), purpose, exact=op not in _DATA_DEPENDENT)
            (fwd_rows if phase == "forward" else bwd_rows).append(row)
    return fwd_rows, bwd_rows


def _carries_grad(arg, grad: set) -> bool:
    if isinstance(arg, (list, tuple)):  # a bucket: any member
        return any(_carries_grad(a, grad) for a in arg)
    return isinstance(arg, fx.Node) and arg in grad


def _local_region(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The sub-GraphModule an opaque local region runs (``ProgramMeta.region``),
    or a transformer block split out for FSDP2 (``ProgramMeta.block``)."""
    if node.op != "call_module":
        return None
    sub = gm.get_submodule(node.target)
    if isinstance(sub, fx.GraphModule) and program_meta(sub).region == node.target:
        return sub
    return block_module(gm, node)


def _join(prefix: str, fqn: str) -> str:
    if not prefix or fqn == prefix or fqn.startswith(prefix + "."):
        return fqn or prefix
    return f"{prefix}.{fqn}" if fqn else prefix


def _n_inputs(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "placeholder")


# --------------------------------------------------------------------------- helpers


def _calls(node: fx.Node) -> list[tuple]:
    """``(phase, kind, axis, buffer TensorInfo, op, purpose)`` of every collective the
    node runs, forward then backward."""
    meta = node.meta.get(KEY)
    coll = getattr(meta, "collective", None)
    if coll is not None and coll.op == "grad_sync_bucket":  # one flat buffer of all members
        members = [_tensor(a) for a in node.args[0]]
        flat = TensorInfo({}, (sum(math.prod(m.shape) for m in members),), (sum(math.prod(m.local_shape) for m in members),),
                          members[0].dtype)
        return [("backward", "all_reduce", coll.axis, flat, coll.op, coll.purpose)]
    if coll is not None and coll.op == "ring_attention":
        return _ring_calls(node, coll)
    if coll is not None and coll.op == "gathered_linears":  # the linears' input: gathered, and again backward
        whole = node.meta[KEY].extra["gathered"]
        return [("forward", "all_gather", coll.axis, whole, coll.op, coll.purpose),  # backward rows: listed reversed
                ("backward", "reduce_scatter", coll.axis, whole, coll.op, coll.purpose),
                ("backward", "all_gather", coll.axis, whole, coll.op, coll.purpose)]
    if coll is not None:
        src, out = _tensor(node.args[0] if node.args else None), _tensor(node)
        buffers = [v for v in (src, out) if v is not None]
        if not buffers:
            return []
        big = max(buffers, key=lambda t: math.prod(t.local_shape))  # the gathered / unscattered side
        fwd, bwd = _kinds(node, coll)
        return [(phase, kind, coll.axis, big, coll.op, coll.purpose)
                for phase, kind in (("forward", fwd), ("backward", bwd)) if kind is not None]
    if node.op == "call_function":
        calls = _INSIDE.get(getattr(node.target, "__name__", None))
        if calls is not None and getattr(node.target, "__module__", "") == "fxshard":
            return calls(node)
    return []


def _kinds(node: fx.Node, coll) -> tuple[str | None, str | None]:
    """(forward kind, backward kind) of a communication node."""
    if coll.op in _AUTOGRAD_TABLE:
        fwd, bwd = _AUTOGRAD_TABLE[coll.op]
        if coll.op == "all_gather" and node.kwargs.get("grad", "replicate") == "partial":
            bwd = "reduce_scatter"
        return fwd, bwd
    # An op this module does not know: read what its Collective says it does.
    return _kind_of_text(coll.fwd), _kind_of_text(coll.bwd)


# -- functions that communicate inside (fxshard.loss): not collective nodes, same rows.
# Keep in step with fxshard/runtime/loss.py; tests/test_comm_summary.py counts the real calls.


def _per_row(x: TensorInfo, class_dim: int, keepdim: bool) -> TensorInfo:
    shape = list(x.local_shape)
    if keepdim:
        shape[class_dim] = 1
    else:
        shape = [math.prod(shape) // shape[class_dim]]
    return TensorInfo({}, tuple(shape), tuple(shape), x.dtype)


def _cross_entropy_calls(node: fx.Node) -> list[tuple]:
    x, axis = _tensor(node.args[0]), node.args[2] if len(node.args) > 2 else node.kwargs.get("axis", "tp")
    if x is None:
        return []
    c = 1 if len(x.local_shape) > 1 else 0
    rows = _per_row(x, c, keepdim=False)
    calls = ["max of the logits", "sum of exponentials", "target logit"]
    if node.kwargs.get("label_smoothing", 0.0):
        calls.append("sum of the logits (label smoothing)")
    name = node.target.__name__
    return [("forward", "all_reduce", axis, rows, name, what) for what in calls] + _mean_calls(node, x.dtype)


def _mean_calls(node: fx.Node, dtype) -> list[tuple]:
    """A mean over tokens sharded on context-parallel axes: the loss sum and the token
    count, one all-reduce each per axis (``fxshard.runtime.loss._global_mean``)."""
    axes = node.kwargs.get("mean_axes") or ()
    if node.kwargs.get("reduction", "mean") != "mean":
        return []
    one = TensorInfo({}, (), (), dtype)
    return [("forward", "all_reduce", a, one, node.target.__name__, what) for a in axes for what in ("loss sum", "token count")]


def _global_mean_calls(node: fx.Node) -> list[tuple]:
    x = _tensor(node.args[0])
    axes = node.args[2] if len(node.args) > 2 else node.kwargs.get("axes", ())
    one = TensorInfo({}, (), (), x.dtype if x is not None else torch.float32)
    return [("forward", "all_reduce", a, one, node.target.__name__, what) for a in axes for what in ("loss sum", "token count")]


def _log_softmax_calls(node: fx.Node) -> list[tuple]:
    x = _tensor(node.args[0])
    if x is None:
        return []
    axis = node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    per_row = _per_row(x, dim % len(x.local_shape), keepdim=True)
    name = node.target.__name__
    return [("forward", "all_reduce", axis, per_row, name, "max of the logits"),
            ("forward", "all_reduce", axis, per_row, name, "sum of exponentials"),
            ("backward", "all_reduce", axis, per_row, name, "grad sync of the log-sum-exp")]


def _nll_loss_calls(node: fx.Node) -> list[tuple]:
    x = _tensor(node.args[0])
    if x is None:
        return []
    rows = _per_row(x, 1 if len(x.local_shape) > 1 else 0, keepdim=False)
    return [("forward", "all_reduce", node.args[2], rows, node.target.__name__, "target log-probability")] + \
        _mean_calls(node, x.dtype)


def _ring_calls(node: fx.Node, coll) -> list[tuple]:
    """``fxshard.ring_attention``: ``n-1`` hops of the K and V blocks forward; backward
    ``n-1`` hops of K, V and ``n`` of their gradient accumulators (float32, the kernel's
    accumulation dtype)."""
    n = (program_meta(node.graph.owning_module).mesh or {}).get(coll.axis, 0)
    k, v = _tensor(node.args[1]), _tensor(node.args[2])
    if k is None or v is None or n < 2:
        return []
    k32, v32 = (TensorInfo({}, t.shape, t.local_shape, torch.float32) for t in (k, v))
    rows = []
    for _ in range(n - 1):
        rows += [("forward", "ring_shift", coll.axis, k, coll.op, "K block"),
                 ("forward", "ring_shift", coll.axis, v, coll.op, "V block")]
    for hop in range(n):
        if hop < n - 1:
            rows += [("backward", "ring_shift", coll.axis, k, coll.op, "K block"),
                     ("backward", "ring_shift", coll.axis, v, coll.op, "V block")]
        rows += [("backward", "ring_shift", coll.axis, k32, coll.op, "dK accumulator"),
                 ("backward", "ring_shift", coll.axis, v32, coll.op, "dV accumulator")]
    return rows


# Expert-parallel all-to-alls move as many tokens as the router sends: their sizes are
# those of the example, assuming an even spread over the ranks.
_DATA_DEPENDENT = {"ep_dispatch", "ep_combine"}

_INSIDE = {
    "vocab_parallel_cross_entropy": _cross_entropy_calls,
    "vocab_parallel_log_softmax": _log_softmax_calls,
    "vocab_parallel_nll_loss": _nll_loss_calls,
    "global_mean_cross_entropy": _global_mean_calls,
}


def _kind_of_text(text: str) -> str | None:
    for kind in C10D_OPS:
        if kind.replace("_", "-") in (text or ""):
            return kind
    return None


def _tensor(node) -> TensorInfo | None:
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get(KEY)
    v = getattr(meta, "value", None)
    return v if isinstance(v, TensorInfo) else None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _differentiable(node: fx.Node) -> bool:
    """Whether the node's value can carry a gradient (floating point or complex)."""
    v = getattr(node.meta.get(KEY), "value", None)
    infos = [v] if isinstance(v, TensorInfo) else [t for t in v if isinstance(t, TensorInfo)] if isinstance(v, tuple) else []
    if not infos:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.dtype.is_floating_point or val.dtype.is_complex
        local = getattr(node.meta.get(KEY), "extra", {}).get("local")  # inside a local region: one run on zeros
        if local is not None:
            return local[1].is_floating_point or local[1].is_complex
        # nothing recorded (a region's input added after that run): the caller's argument decides
        return val is None
    return any(t.dtype.is_floating_point or t.dtype.is_complex for t in infos)


def _requires_grad(gm: fx.GraphModule, inputs_grad: list[bool]) -> set[fx.Node]:
    """Nodes whose value requires grad at run time (autograd's own rule, replayed);
    ``inputs_grad``: whether each graph input requires grad."""
    out: set[fx.Node] = set()
    placeholders = iter(inputs_grad)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            needs = next(placeholders, False)
        elif node.op == "get_attr":
            attr = attribute(gm, node.target, None)
            needs = isinstance(attr, torch.Tensor) and attr.requires_grad
        elif node.op == "output" or (node.op == "call_method" and node.target == "detach"):
            needs = False
        else:
            needs = any(a in out for a in node.all_input_nodes)
            if node.op == "call_module":  # an opaque module: its own parameters count too
                needs = needs or any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
        if needs and _differentiable(node):
            out.add(node)
    return out


def _reaches_output(gm: fx.GraphModule, grad: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``grad`` whose gradient autograd computes: a differentiable path
    leads from them to the graph's output.  A value that only feeds integer results
    (the indices of a top-k that selects tokens, a sparse-attention indexer) gets no
    gradient, and a collective on it runs no backward.  A node without users counts
    as reaching the output: it may write into a tensor read later (``copy_``, setitem)."""
    live: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node in grad and (not node.users or any(u.op == "output" or u in live for u in node.users)):
            live.add(node)
    return live


def in_region(fqn: str, pattern: str | None) -> bool:
    """Whether module ``fqn`` is inside the modules matched by ``pattern`` (the
    :func:`fxshard.dump` convention: ``*`` matches one name, a match of the module or of
    any parent counts, so ``"layers.0"`` and ``"layers.0.*"`` both take the whole layer)."""
    if pattern is None or pattern in ("", "*"):
        return True
    rx = pattern_regex(pattern[:-2] if pattern.endswith(".*") else pattern)
    return any(rx.match(p) for p in module_prefixes(fqn))


def fmt_bytes(n: int) -> str:
    """``4096 -> '4.0 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
