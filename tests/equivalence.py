"""Equivalence checkers: a sharded program against the single-device one.

"Equivalence is the only test that matters" (docs/design.md §9): the sharded
program must give the single-device output, input gradients and parameter gradients
(each rank's shard against the matching slice of the full gradient), and the same
outputs after SGD steps.  Every model-family test uses these checkers::

    from equivalence import check_simulated, check_real

    def make_model():                       # top level: check_real pickles it
        return llama(n_heads=8, n_kv_heads=4)

    def make_plan(mesh):
        return fxshard.Plan(mesh, llama_plan("tp"))

    check_simulated(make_model, make_plan, (ids,), {"tp": 4}, loss_fn=ce, targets=(tgt,))
    check_real(2, make_model, make_plan, (ids,), {"tp": 2}, loss_fn=ce, targets=(tgt,))

What the sharded program optimizes
----------------------------------
Every rank computes ``loss_fn(local_output, *local_targets)`` and calls backward on
it.  A value that is ``Replicate`` on an axis has a replicated gradient, so ranks
that hold the same slice of the output compute the same loss once; ranks that hold
different slices (the output ``Shard(d)`` on an axis: a batch sharded on ``"dp"``,
or a column-parallel output left sharded) each add theirs.  The single-device
reference therefore optimizes the *sum of the per-slice losses*
(:func:`sliced_objective`); over a batch-sharded axis gradients are summed, as
docs/design.md §6 says.  ``targets`` are sliced like the output's leading dims
(cross-entropy targets ``[B, S]`` for logits ``[B, S, V]``).

Ranks sit on the mesh in row-major order (``init_device_mesh``): rank ``r`` of a
``{"dp": 2, "tp": 2}`` mesh has coordinate ``{"dp": r // 2, "tp": r % 2}``.  A
tensor with a layout is sliced mesh axis by mesh axis, outer axes first, exactly as
``DTensor`` does; :func:`slice_for` does that independently of fxshard.

Inputs are bound by name, never by identity
-------------------------------------------
The transform never sees the tensors the program then runs with: it gets copies in
which inputs of one shape and dtype are the *same tensor object*
(:func:`aliased_examples`, as in ``example_kwargs={"input_ids": ids, "labels": ids}``),
and the run inputs must be distinct tensors with distinct values, HF ``labels`` with
-100 padding (:func:`check_run_inputs`).  A capture that keeps one placeholder for two
arguments computes from the wrong one at run time, and the comparison sees it.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard.meta import KEY, TensorInfo, program_meta

try:
    from harness import make_mesh, plain, rank_map, rank_value, simulated, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, plain, rank_map, rank_value, simulated, spawn

__all__ = [
    "Case", "Reference", "reference", "check_simulated", "check_real", "check_real_cases",
    "weighted_sum", "cross_entropy", "slice_for", "coords_of", "sliced_objective", "output_layout", "sgd_step",
    "aliased_examples", "example_inputs_for", "check_run_inputs",
]

ATOL = 1e-5
RTOL = 1e-5


# ----------------------------------------------------------------------------- losses


def weighted_sum(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(out * weights).sum()``: a loss whose gradient is ``weights``, for any output.
    Pass ``targets=(torch.randn(global_output_shape),)``."""
    return (out * weights).sum()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy, mean over the tokens (of the slice a rank holds)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


# ----------------------------------------------------------------------------- layouts


def coords_of(rank: int, mesh_shape: dict[str, int]) -> dict[str, int]:
    """Coordinate of ``rank`` on a row-major mesh (as ``init_device_mesh`` lays it out)."""
    coord, r = {}, rank
    for axis, size in reversed(list(mesh_shape.items())):
        coord[axis] = r % size
        r //= size
    return {a: coord[a] for a in mesh_shape}


def slice_for(t: torch.Tensor, layout: dict | None, coord: dict[str, int], mesh_shape: dict[str, int],
              blocks: tuple[int, ...] | None = None, balanced: frozenset = frozenset(), heads=None) -> torch.Tensor:
    """The local piece of global ``t`` that a rank at ``coord`` holds in ``layout``.

    Axes in mesh order (outer first), ``Shard(d)`` takes chunk ``coord[axis]`` of dim
    ``d``; ``Replicate`` keeps the tensor.  ``Partial`` has no slice: ValueError.
    ``blocks``: part sizes of a fused parameter (``colwise(splits=...)``): each part of
    the sharded dim is chunked on its own; a ``DimBlocks`` names the one dim they cut.  ``balanced``: load-balanced context-parallel
    axes, where ``Shard(d)`` takes chunks ``i`` and ``2n-1-i`` of ``2n``.  ``heads``: a
    ``HeadReplicas`` (fewer heads than ranks on its axis): the rank takes head
    ``coord // (size // heads)``, the one its query heads use.
    """
    packed_dim = None
    if blocks is not None and hasattr(blocks, "sizes"):  # DimBlocks: the parts of one dim (HF's fused experts)
        packed_dim, blocks = blocks.dim, tuple(blocks.sizes)
    for axis, size in mesh_shape.items():
        p = (layout or {}).get(axis, Replicate())
        if isinstance(p, Shard) and heads is not None and heads.axis == axis and size > heads.heads:
            d = p.dim % t.dim()
            n = t.shape[d] // heads.heads
            t = t.narrow(d, coord[axis] // (size // heads.heads) * n, n)
        elif isinstance(p, Shard):
            d = p.dim % t.dim()
            if packed_dim is not None and d != packed_dim:
                t = t.narrow(d, coord[axis] * (t.shape[d] // size), t.shape[d] // size)
                continue
            parts = t.split(list(blocks), d) if blocks else (t,)
            pieces = []
            for part in parts:
                if part.shape[d] % size and axis not in balanced:  # torch.chunk: the last ranks hold less
                    step = -(-part.shape[d] // size)
                    start = min(coord[axis] * step, part.shape[d])
                    pieces.append(part.narrow(d, start, min(step, part.shape[d] - start)))
                    continue
                assert part.shape[d] % size == 0, f"dim {d} of {tuple(part.shape)} does not divide by {axis}={size}"
                n = part.shape[d] // size
                if axis in balanced:
                    c, i = n // 2, coord[axis]
                    pieces.append(torch.cat([part.narrow(d, i * c, c), part.narrow(d, (2 * size - 1 - i) * c, c)], d))
                    continue
                pieces.append(part.narrow(d, coord[axis] * n, n))
            t = torch.cat(pieces, d) if blocks else pieces[0]
            blocks = tuple(b // size for b in blocks) if blocks else blocks  # the next axis chunks local parts
        elif isinstance(p, Partial):
            raise ValueError(f"a Partial value on axis {axis!r} has no slice to compare")
    return t


def _leading(layout: dict, ndim: int, out_ndim: int) -> dict:
    """``layout`` restricted to the first ``ndim`` dims of an ``out_ndim``-dim tensor
    (how targets follow the output they score)."""
    out = {}
    for axis, p in layout.items():
        if isinstance(p, Shard) and p.dim % out_ndim < ndim:
            out[axis] = Shard(p.dim % out_ndim)
    return out


def output_layout(gm: fx.GraphModule, select: Callable | None = None) -> dict:
    """Layout of the (single tensor) output of a transformed GraphModule, or of the
    output ``select`` picks from a structured one (an HF ``ModelOutput``)."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = out.args[0]
    spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
    if spec is not None and spec.is_leaf() and isinstance(value, (tuple, list)):
        (value,) = value  # a captured graph returning one tensor returns it flat, as a 1-list
    if select is not None:
        spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
        if spec is not None:  # a captured graph returns its outputs flat: rebuild the structure
            from torch.utils import _pytree as pytree

            value = value[select(pytree.tree_unflatten(list(range(len(value))), spec))]
        else:
            value = select(value)
    meta = value.meta.get(KEY) if isinstance(value, fx.Node) else None
    ti = meta.value if meta is not None else None
    if not isinstance(ti, TensorInfo):
        raise TypeError(f"the checkers compare one output tensor; the graph returns {value!r}")
    if any(isinstance(p, Partial) for p in ti.layout.values()):
        raise ValueError(f"the graph output is Partial ({ti.layout}); give the last module an output layout")
    return dict(ti.layout)


def input_layouts(gm: fx.GraphModule, plan) -> list[dict]:
    """Per positional input: its plan layout (``Plan(inputs={name: layout})``)."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return [plan.inputs.get(name, {}) for name in names]


def load_balanced(gm: fx.GraphModule) -> frozenset:
    """The load-balanced context-parallel axes of a transformed graph."""
    return frozenset(a for a, cp in (program_meta(gm).context_parallel or {}).items() if cp["load_balance"])


def sliced_objective(loss_fn: Callable, out_layout: dict, mesh_shape: dict[str, int], balanced: frozenset = frozenset()) -> Callable:
    """The single-device objective of a sharded run: the sum of ``loss_fn`` over the
    distinct output slices the ranks hold (see module docstring)."""
    sharded = [a for a in mesh_shape if isinstance(out_layout.get(a), Shard)]
    blocks = [dict(zip(sharded, c)) for c in itertools.product(*(range(mesh_shape[a]) for a in sharded))]

    def objective(out, *targets):
        total = 0
        for block in blocks:
            coord = {a: block.get(a, 0) for a in mesh_shape}
            lay = {a: out_layout[a] for a in sharded}
            ts = [slice_for(t, _leading(lay, t.dim(), out.dim()), coord, mesh_shape, balanced=balanced) for t in targets]
            total = total + loss_fn(slice_for(out, lay, coord, mesh_shape, balanced=balanced), *ts)
        return total

    return objective


# ----------------------------------------------------------------------------- reference


@dataclasses.dataclass
class Reference:
    """Single-device values of a training run.

    ``outputs[k]`` is the output before SGD step ``k`` (``outputs[steps]`` after the
    last step); ``losses``, ``input_grads`` (``None`` for non-float inputs) and
    ``param_grads`` (by FQN) are per step.
    """

    outputs: list[torch.Tensor]
    losses: list[float]
    input_grads: list[list[torch.Tensor | None]]
    param_grads: list[dict[str, torch.Tensor | None]]
    params: dict[str, torch.Tensor]  # after the last step


def sgd_step(params, lr: float) -> None:
    """Plain SGD, ``p -= lr * p.grad``, then clear the grads."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def _leaf_inputs(inputs: Sequence[Any]) -> list[Any]:
    return [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs]


def reference(model: nn.Module, inputs: Sequence[Any], loss_fn: Callable, steps: int = 2, lr: float = 0.05,
              targets: Sequence[torch.Tensor] = (), kwargs: dict | None = None, select: Callable | None = None) -> Reference:
    """Train a copy of ``model`` on one device for ``steps`` SGD steps.

    Example::

        ref = reference(mlp(), (x,), lambda out: out.sum(), steps=2, lr=0.1)
        ref.param_grads[0]["fc1.weight"]      # gradient at the first step

    Float inputs get ``requires_grad`` (their gradients are recorded per step);
    ``loss_fn(output, *targets)`` is the objective.  ``kwargs`` are keyword inputs (an
    HF model's ``input_ids=``, ``labels=``); ``select(output)`` picks the tensor that is
    compared (``lambda o: o.logits``); ``loss_fn`` sees the whole output.
    """
    model = copy.deepcopy(model)
    xs = _leaf_inputs(inputs)
    kw = dict(kwargs or {})
    select = select or (lambda o: o)
    ref = Reference([], [], [], [], {})
    for _ in range(steps):
        out = model(*xs, **kw)
        loss = loss_fn(out, *targets)
        loss.backward()
        ref.outputs.append(select(out).detach().clone())
        ref.losses.append(float(loss.detach()))
        ref.input_grads.append([x.grad.clone() if isinstance(x, torch.Tensor) and x.grad is not None else None for x in xs])
        ref.param_grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        for x in xs:
            if isinstance(x, torch.Tensor):
                x.grad = None
        sgd_step(model.parameters(), lr)
    with torch.no_grad():
        ref.outputs.append(select(model(*xs, **kw)).detach().clone())
    ref.params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return ref


# ----------------------------------------------------------------------------- the check


@dataclasses.dataclass
class Case:
    """One equivalence check (picklable when its factories are top-level functions
    or ``functools.partial`` of them).

    model_factory():       the single-device model (deterministic: every rank builds it).
    plan_factory(mesh):    the fxshard.Plan for that mesh.
    inputs:                single-device (global) inputs; inputs with a layout in
                           ``plan.inputs`` are sliced per rank.
    mesh_shape:            ``{axis: size}``.
    loss_fn(out, *targets): per-rank loss (default :func:`weighted_sum` with random weights).
    example_inputs:        inputs to transform with, if different from ``inputs``
                           (checks that the graph runs at other batch/sequence sizes).
                           Either way the transform sees new tensors, those of one shape
                           and dtype aliased as one object (:func:`aliased_examples`),
                           while the run inputs stay distinct (:func:`check_run_inputs`).
    post(sharded, mesh, rank, world_size): extra check run on real ranks after the
                           equivalence check (top-level function).
    kwargs:                keyword inputs (HF: ``{"input_ids": ids, "labels": labels}``),
                           sliced per ``plan.inputs`` by name like positional ones.
    example_kwargs:        keyword inputs to transform with, if different from ``kwargs``.
    select(output):        the tensor of the output that is compared (``lambda o: o.logits``).
    replicated_loss:        ``loss_fn`` reads a loss the model computes itself (``o.loss``):
                           it is replicated, so the objective is not summed over slices.
    """

    model_factory: Callable[[], nn.Module]
    plan_factory: Callable[[Any], Any]
    inputs: tuple
    mesh_shape: dict
    loss_fn: Callable | None = None
    targets: tuple = ()
    steps: int = 2
    lr: float = 0.05
    atol: float = ATOL
    rtol: float = RTOL
    example_inputs: tuple | None = None
    post: Callable | None = None
    name: str = ""
    kwargs: dict = dataclasses.field(default_factory=dict)
    example_kwargs: dict | None = None
    select: Callable | None = None
    replicated_loss: bool = False

    def pick(self, out):
        return self.select(out) if self.select is not None else out


def _resolve_loss(case: Case, ref_model: nn.Module) -> tuple[Callable, tuple]:
    if case.loss_fn is not None:
        return case.loss_fn, tuple(case.targets)
    with torch.no_grad():
        shape = case.pick(ref_model(*case.inputs, **case.kwargs)).shape
    # scaled like a mean over the output, so SGD steps stay small and stable
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1234), dtype=torch.float32) / math.sqrt(math.prod(shape))
    return weighted_sum, (w,)


def _close(got, want, case: Case, what: str) -> None:
    assert got is not None, f"{case.name}: {what}: no gradient"
    torch.testing.assert_close(got, want, atol=case.atol, rtol=case.rtol, msg=lambda m: f"{case.name}: {what}: {m}")


def _prepare(case: Case):
    """The single-device model and the per-rank loss with its global targets."""
    model = case.model_factory()
    loss_fn, targets = _resolve_loss(case, model)
    return model, loss_fn, targets


def _run_sharded(sharded: fx.GraphModule, local_inputs: list, local_targets: list, loss_fn: Callable, steps: int, lr: float,
                 local_kwargs: dict | None = None, select: Callable | None = None):
    """Train the sharded program; record what :class:`Reference` records, per rank."""
    rec = Reference([], [], [], [], {})
    kw = dict(local_kwargs or {})
    select = select or (lambda o: o)
    for _ in range(steps):
        out = sharded(*local_inputs, **kw)
        loss = loss_fn(out, *local_targets)
        loss.backward()
        rec.outputs.append(select(out).detach())
        rec.losses.append(loss.detach())
        rec.input_grads.append([x.grad if isinstance(x, torch.Tensor) else None for x in local_inputs])
        rec.param_grads.append({n: p.grad for n, p in sharded.named_parameters(remove_duplicate=False)})
        for x in local_inputs:
            if isinstance(x, torch.Tensor):
                x.grad = None
        sgd_step(sharded.parameters(), lr)
    with torch.no_grad():
        rec.outputs.append(select(sharded(*local_inputs, **kw)).detach())
    return rec


def _compare_rank(case: Case, ref: Reference, rec: Reference, sharded: fx.GraphModule, in_layouts, out_layout,
                  rank: int, coord: dict[str, int]) -> None:
    mesh = case.mesh_shape
    lb = load_balanced(sharded)
    state = program_meta(sharded).state
    where = f"rank {rank} {coord}"
    for k in range(case.steps + 1):
        step = f"step {k}" if k < case.steps else f"after {case.steps} SGD steps"
        _close(rank_value(rec.outputs[k], rank), slice_for(ref.outputs[k], out_layout, coord, mesh, balanced=lb), case, f"{where} {step}: output")
        if k == case.steps:
            break
        for i, (g, want) in enumerate(zip(rec.input_grads[k], ref.input_grads[k])):
            if want is not None:
                _close(rank_value(g, rank), slice_for(want, in_layouts[i], coord, mesh, balanced=lb), case, f"{where} {step}: grad of input {i}")
        lost = {n for n in set(ref.param_grads[k]) - set(rec.param_grads[k]) if not _on_other_rank(sharded, n)}
        extra = set(rec.param_grads[k]) - set(ref.param_grads[k])
        assert not lost and not extra, f"{case.name}: parameter FQNs differ from the model's: lost {sorted(lost)}, new {sorted(extra)}"
        for fqn, g in rec.param_grads[k].items():
            layout, global_shape = state.get(fqn, ({}, None))
            want = ref.param_grads[k][fqn]
            if global_shape is not None:
                assert tuple(global_shape) == tuple(ref.params[fqn].shape), f"{case.name}: {fqn}: global shape {global_shape}"
            if want is None:
                assert g is None or not rank_value(g, rank).any(), f"{case.name}: {where}: {fqn} has a gradient, single device has none"
                continue
            blocks = program_meta(sharded).blocks.get(fqn)
            heads = program_meta(sharded).heads.get(fqn)
            _close(None if g is None else rank_value(g, rank), slice_for(want, layout, coord, mesh, blocks, heads=heads), case,
                   f"{where} {step}: grad of {fqn}")


def _on_selected(case: Case, loss_fn: Callable) -> Callable:
    return lambda out, *targets: loss_fn(case.pick(out), *targets)


def _on_other_rank(sharded: fx.GraphModule, fqn: str) -> bool:
    """Is ``fqn`` under a child that lives on one rank only (module-list experts of a
    local region, ``LocalRegion.owners``), deleted by design on the others?"""
    from fxshard.meta import LocalRegion

    for node in sharded.graph.nodes:
        region = node.meta.get(KEY).declared if node.meta.get(KEY) is not None else None
        if isinstance(region, LocalRegion) and any(fqn.startswith(child + ".") for child in region.owners):
            return True
    return False


def _local_inputs(inputs, layouts, coord_of_rank: Callable[[int], dict], mesh_shape, balanced=frozenset()):
    """Per-rank inputs (rank_map: a LocalTensor under simulated ranks, this rank's
    tensor in a real one); float inputs require grad."""
    out = []
    for x, layout in zip(inputs, layouts):
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        t = rank_map(lambda r, x=x, layout=layout: slice_for(x, layout, coord_of_rank(r), mesh_shape, balanced=balanced).clone())
        out.append(t.requires_grad_() if t.is_floating_point() else t)
    return out


def _local_targets(targets, out_layout, out_ndim, coord_of_rank, mesh_shape, balanced=frozenset()):
    return [rank_map(lambda r, t=t: slice_for(t, _leading(out_layout, t.dim(), out_ndim), coord_of_rank(r), mesh_shape,
                                              balanced=balanced).clone())
            for t in targets]


def _check_outputs_move(case: Case, ref: Reference) -> None:
    """The SGD steps must change the output, or comparing after them proves nothing."""
    if case.steps:
        assert not torch.allclose(ref.outputs[0], ref.outputs[-1], atol=100 * case.atol), \
            f"{case.name}: {case.steps} SGD steps at lr={case.lr} do not change the output; raise lr"


def aliased_examples(inputs: Sequence[Any], kwargs: dict) -> tuple[tuple, dict]:
    """Copies of ``inputs`` and ``kwargs`` to transform with, where tensors of the same
    shape, dtype and device are *one tensor object* (aliased on purpose).

    The run inputs stay distinct tensors with other values, so a capture that binds an
    input by tensor identity instead of by argument name (the README's
    ``example_kwargs={"input_ids": ids, "labels": ids}``) computes from the wrong input
    at run time and the comparison fails.  Each group takes the values of its first
    tensor with no negative entry (ids rather than labels holding -100), so the
    example stays a valid input.

    Example::

        ex, ex_kw = aliased_examples((), {"input_ids": ids, "labels": labels})
        assert ex_kw["labels"] is ex_kw["input_ids"] and ex_kw["input_ids"] is not ids
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    tensors = [x for x in (*inputs, *kwargs.values()) if isinstance(x, torch.Tensor)]
    for x in tensors:
        groups.setdefault((tuple(x.shape), x.dtype, x.device), []).append(x)
    shared = {}
    for key, members in groups.items():
        valid = [x for x in members if x.is_floating_point() or x.dtype == torch.bool or x.numel() == 0 or int(x.min()) >= 0]
        shared[key] = (valid or members)[0].detach().clone()

    def example(x):
        return shared[(tuple(x.shape), x.dtype, x.device)] if isinstance(x, torch.Tensor) else x

    return tuple(example(x) for x in inputs), {k: example(v) for k, v in kwargs.items()}


def example_inputs_for(case: Case) -> tuple[tuple, dict]:
    """What ``case`` is transformed with: its ``example_inputs`` / ``example_kwargs``
    (else its run inputs), as :func:`aliased_examples` (new tensors, same-shaped ones
    aliased), so no example tensor is a run tensor."""
    pos = case.example_inputs if case.example_inputs is not None else case.inputs
    kw = case.example_kwargs if case.example_kwargs is not None else case.kwargs
    return aliased_examples(tuple(pos), dict(kw or {}))


def check_run_inputs(case: Case) -> None:
    """The run inputs must let the oracle see an input bound by identity: no two share
    storage or equal values at the same shape and dtype, and HF ``labels`` differ from
    ``input_ids`` and carry -100 padding (what a real batch has: the prompt masked)."""
    named = [(f"input {i}", x) for i, x in enumerate(case.inputs)] + list(case.kwargs.items())
    named = [(n, x) for n, x in named if isinstance(x, torch.Tensor)]
    for (a, x), (b, y) in itertools.combinations(named, 2):
        assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr(), \
            f"{case.name}: run inputs {a} and {b} share storage; pass distinct tensors"
        if x.shape == y.shape and x.dtype == y.dtype:
            assert not torch.equal(x, y), f"{case.name}: run inputs {a} and {b} are equal; give them different values"
    labels = case.kwargs.get("labels")
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        assert (labels == -100).any(), f"{case.name}: labels carry no -100 padding (fxshard.testing.hf_tiny.tiny_inputs has it)"


def _equivalence(case: Case, mesh, model, loss_fn, targets, ranks: list[int], coord_of_rank: Callable[[int], dict]):
    """Transform, train on the sharded graph and compare ``ranks`` (runs under a mesh)."""
    plan = case.plan_factory(mesh)
    with plain():
        check_run_inputs(case)
        example, example_kw = example_inputs_for(case)
    sharded = fxshard.transform(model, plan, example_inputs=example, example_kwargs=example_kw or None)
    out_layout = output_layout(sharded, case.select)
    in_layouts = input_layouts(sharded, plan)
    lb = load_balanced(sharded)
    with plain():
        with torch.no_grad():
            out_ndim = case.pick(model(*case.inputs, **case.kwargs)).dim()
        # a replicated loss reads the whole output (``o.loss``); any other the selected tensor
        objective = loss_fn if case.replicated_loss else _on_selected(case, sliced_objective(loss_fn, out_layout, case.mesh_shape, lb))
        ref = reference(model, case.inputs, objective, case.steps, case.lr, targets, case.kwargs, case.select)
    _check_outputs_move(case, ref)
    local_in = _local_inputs(case.inputs, in_layouts, coord_of_rank, case.mesh_shape, lb)
    kw_layouts = [plan.inputs.get(name, {}) for name in case.kwargs]
    local_kw = dict(zip(case.kwargs, _local_inputs(list(case.kwargs.values()), kw_layouts, coord_of_rank, case.mesh_shape, lb)))
    local_tg = _local_targets(targets, out_layout, out_ndim, coord_of_rank, case.mesh_shape, lb)
    rank_loss = loss_fn if case.replicated_loss else _on_selected(case, loss_fn)
    rec = _run_sharded(sharded, local_in, local_tg, rank_loss, case.steps, case.lr, local_kw, case.select)
    for r in ranks:
        with plain():
            _compare_rank(case, ref, rec, sharded, in_layouts, out_layout, r, coord_of_rank(r))
    return sharded, ref


def check_simulated(model_factory, plan_factory, inputs, mesh_shape, **kw) -> fx.GraphModule:
    """Check a plan under simulated ranks (one process); returns the sharded graph.

    Example::

        check_simulated(lambda: mlp(), lambda mesh: Plan(mesh, {...}), (x,), {"tp": 4})

    Keyword arguments are the fields of :class:`Case` (``loss_fn``, ``targets``,
    ``steps``, ``lr``, ``atol``, ``rtol``, ``example_inputs``, ``name``).  Every rank's
    output, input gradients and parameter gradients are compared with the matching
    slice of the single-device values, at every step and after the last SGD step.
    """
    case = Case(model_factory, plan_factory, tuple(inputs), dict(mesh_shape), **kw)
    case.name = case.name or f"simulated {mesh_shape}"
    model, loss_fn, targets = _prepare(case)
    world = math.prod(case.mesh_shape.values())
    with simulated(case.mesh_shape) as mesh:
        sharded, _ = _equivalence(case, mesh, model, loss_fn, targets, list(range(world)),
                                  lambda r: coords_of(r, case.mesh_shape))
    return sharded


def _real_worker(rank: int, world_size: int, cases: list[Case]) -> None:
    for case in cases:
        if math.prod(case.mesh_shape.values()) != world_size:
            raise ValueError(f"{case.name}: mesh {case.mesh_shape} does not fill the world of {world_size}")
        mesh = make_mesh(case.mesh_shape)
        coord = dict(zip(case.mesh_shape, mesh.get_coordinate()))
        assert coord == coords_of(rank, case.mesh_shape), f"mesh is not row-major: rank {rank} at {coord}"
        model, loss_fn, targets = _prepare(case)
        sharded, _ = _equivalence(case, mesh, model, loss_fn, targets, [rank], lambda r, coord=coord: coord)
        if case.post is not None:
            case.post(sharded, mesh, rank, world_size)


def check_real_cases(world_size: int, cases: Sequence[Case]) -> None:
    """Run several :class:`Case` s in one spawn of ``world_size`` gloo processes
    (spawning costs seconds: batch the checks)."""
    cases = list(cases)
    for i, c in enumerate(cases):
        c.name = c.name or f"real case {i} {c.mesh_shape}"
    spawn(_real_worker, world_size, cases)


def check_real(world_size: int, model_factory, plan_factory, inputs, mesh_shape, **kw) -> None:
    """:func:`check_simulated` in ``world_size`` real gloo processes.  The factories,
    ``loss_fn`` and ``post`` must be picklable (top-level functions or partials)."""
    check_real_cases(world_size, [Case(model_factory, plan_factory, tuple(inputs), dict(mesh_shape), **kw)])


def expected_local(sharded, mesh, full: torch.Tensor, fqn: str) -> torch.Tensor:
    """The shard of a global state tensor ``full`` that ``sharded`` (an offline
    transform at ``mesh``'s coordinate) holds under ``fqn``: fused parts cut one by one."""
    from fxshard.state.shards import local_slice

    layout, _ = program_meta(sharded).state.get(fqn, (None, None))
    return (local_slice(full, layout, mesh, program_meta(sharded).blocks.get(fqn), program_meta(sharded).heads.get(fqn))
            if layout else full)
