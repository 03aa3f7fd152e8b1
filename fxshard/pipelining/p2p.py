"""The communication of one pipelined training step, seen statically: what ``fxshard.comm_summary``
answers for a :class:`~fxshard.pipelining.PipelinedModule`.

Per micro-batch, for each stage this rank holds (docs/pipeline.md, "What crosses a cut"):

- **forward**: a ``recv`` from the previous stage's rank of every value its stage takes, its
  stage's own collectives (a tensor-parallel all-reduce, ...), a ``send`` of every value it
  gives the next stage.  A size (a batch or sequence length) crosses as an empty tensor of
  that length (0 bytes): torch's stages make their buffers from the shapes they receive.
- **backward**: a ``recv`` of the gradients of the values it sent that require grad, its
  stage's backward collectives, a ``send`` of the gradients of the values it received that
  require grad.  The loss (cut out of the last stage) adds its own collectives (loss
  parallelism) to the last stage's rows.

Adjacent stages on one rank (the turn of a V schedule) pass their values without p2p, as
torch's runtime does.  Once per step: the batch's count of scored tokens summed over the
axes that share the batch (the model's own loss), the loss broadcast from the last stage's
rank over the pipeline axis and summed over those axes, and each tied parameter's gradient
summed between the ranks holding its copies.

Sizes are those of the example inputs given to ``pipeline_transform``, taken as ONE
micro-batch (as ``torch.distributed.pipelining.pipeline(mb_args=...)`` takes its example):
a step on a batch of ``microbatches`` times the example's rows sends exactly these rows.
FSDP2's own all-gathers and reduce-scatters (``fxshard.fully_shard``) are not listed.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from fxshard.debug.comm_summary import CommRow, CommSummary, graph_rows
from fxshard.meta import KEY, SizeInfo, TensorInfo, program_meta

__all__ = ["pipeline_comm_summary"]

_SIZE_DTYPE = torch.int64


def pipeline_comm_summary(staged, region: str | None = None) -> CommSummary:
    """This rank's rows of one ``fxshard.train_step(staged, ...)`` (see the module docstring).

    Example::

        s = fxshard.comm_summary(staged)
        s.count("forward", "send") == staged.spec.microbatches * len(values_crossing_the_cut)
        print(s)                      # one row per micro-batch and value, with its peer rank

    ``region``: a module pattern; keep the stages' collectives of matching modules only (the
    p2p rows and the step's rows are kept).
    """
    spec, pp = staged.spec, staged.pp_size
    me = staged.pp_rank
    axis = spec.axis
    mesh = {axis: pp}
    for st in staged.stages:
        mesh.update(program_meta(st).mesh or {})
    last = staged.num_stages - 1
    forward: list[CommRow] = []
    backward: list[CommRow] = []
    for st, s in zip(staged.stages, staged.stage_ids):
        inputs = [n for n in st.graph.nodes if n.op == "placeholder"]
        outputs = _outputs(st)
        received = s > 0 and spec.rank_of_stage(s - 1, pp) != me
        sent = s < last and spec.rank_of_stage(s + 1, pp) != me
        where = f"stage {s}"
        prev_rank = spec.rank_of_stage(s - 1, pp) if s > 0 else None
        next_rank = spec.rank_of_stage(s + 1, pp) if s < last else None
        inputs_grad = [s > 0 and _carries_grad(n) for n in inputs]
        fwd, bwd = graph_rows(st, mesh, region, inputs_grad)
        if s == last and staged.loss_program is not None:
            loss_fwd, loss_bwd = _loss_rows(staged.loss_program.summed, outputs, mesh, region)
            fwd, bwd = fwd + loss_fwd, bwd + loss_bwd
        stage_fwd: list[CommRow] = []
        stage_bwd: list[CommRow] = []
        if received:
            stage_fwd += [_p2p("forward", "recv", axis, pp, n, where, prev_rank, f"from stage {s - 1}") for n in inputs]
        stage_fwd += fwd
        if sent:
            stage_fwd += [_p2p("forward", "send", axis, pp, n, where, next_rank, f"to stage {s + 1}") for n in outputs]
            stage_bwd += [_p2p("backward", "recv", axis, pp, n, where, next_rank, f"gradient from stage {s + 1}")
                          for n in outputs if _carries_grad(n)]
        stage_bwd += bwd[::-1]
        if received:
            stage_bwd += [_p2p("backward", "send", axis, pp, n, where, prev_rank, f"gradient to stage {s - 1}")
                          for n in inputs if _carries_grad(n)]
        forward.append(stage_fwd)
        backward.append(stage_bwd)
    rows: list[CommRow] = _step_rows(staged, mesh, "forward")
    for mb in range(spec.microbatches):
        rows += [dataclasses.replace(r, microbatch=mb) for stage_rows in forward for r in stage_rows]
    for mb in range(spec.microbatches):
        rows += [dataclasses.replace(r, microbatch=mb) for stage_rows in reversed(backward) for r in stage_rows]
    rows += _step_rows(staged, mesh, "backward")
    return CommSummary(mesh, rows)


def _outputs(st: fx.GraphModule) -> list[fx.Node]:
    out = next(n for n in reversed(st.graph.nodes) if n.op == "output")
    args = out.args[0]
    return [a for a in (args if isinstance(args, (tuple, list)) else (args,)) if isinstance(a, fx.Node)]


def _info(n: fx.Node):
    return getattr(n.meta.get(KEY), "value", None)


def _carries_grad(n: fx.Node) -> bool:
    """A value whose gradient comes back across the cut: a floating-point tensor computed
    from parameters (torch's stage sends the gradients of the inputs that require grad)."""
    info = _info(n)
    return isinstance(info, TensorInfo) and info.requires_grad and (info.dtype.is_floating_point or info.dtype.is_complex)


def _p2p(phase: str, kind: str, axis: str, pp: int, n: fx.Node, where: str, peer: int, purpose: str) -> CommRow:
    if n.op == "call_method" and n.target == "new_empty" and isinstance(n.args[1][0], fx.Node):
        n = n.args[1][0]  # a size the stage sends as an empty [s, 0] tensor: named and sized by the size
    info = _info(n)
    if isinstance(info, TensorInfo):
        shape, dtype = tuple(info.local_shape), info.dtype
    else:  # a size: an empty tensor of that length (its value as traced; 0 bytes either way)
        value = info.value if isinstance(info, SizeInfo) and isinstance(info.value, int) else 0
        shape, dtype = (value, 0), _SIZE_DTYPE
    return CommRow(phase, kind, axis, pp, n.name, "p2p", where, shape, dtype, math.prod(shape) * _itemsize(dtype),
                   purpose, peer=peer)


def _loss_rows(summed: fx.GraphModule, outputs: list[fx.Node], mesh: dict, region: str | None):
    """The collectives of the model's loss on the last stage (a vocab-parallel cross-entropy)."""
    grads = [_carries_grad(n) for n in outputs]
    n_inputs = sum(1 for n in summed.graph.nodes if n.op == "placeholder")
    inputs_grad = (grads + [False] * n_inputs)[:n_inputs - 1] + [False]  # the target last
    fwd, bwd = graph_rows(summed, mesh, region, inputs_grad)
    return [dataclasses.replace(r, region=r.region or "<loss>") for r in fwd], \
        [dataclasses.replace(r, region=r.region or "<loss>") for r in bwd]


def _step_rows(staged, mesh: dict, phase: str) -> list[CommRow]:
    """Once a step: the token count before the micro-batches (forward), the loss broadcast and
    sums and the tied gradients' sums after them (backward)."""
    spec, pp, axis = staged.spec, staged.pp_size, staged.spec.axis
    scalar = ((), torch.float32, 4)
    own_loss = staged.loss_program is not None
    loss_axes = staged.loss_axes if own_loss else staged.batch_axes
    rows: list[CommRow] = []
    if phase == "forward":
        if own_loss:
            rows += [CommRow("forward", "all_reduce", a, mesh.get(a, 0), "token_count", "reduce_over", "<loss>", *scalar,
                             "the batch's scored tokens") for a in staged.loss_axes if mesh.get(a, 1) > 1]
        return rows
    if pp > 1:
        root = spec.rank_of_stage(staged.num_stages - 1, pp)
        rows.append(CommRow("backward", "broadcast", axis, pp, "loss", "broadcast", "<loss>", *scalar,
                            f"the loss from the last stage's rank ({axis}={root})", peer=None))
    rows += [CommRow("backward", "all_reduce", a, mesh.get(a, 0), "loss", "reduce_over", "<loss>", *scalar,
                     "the loss over the ranks sharing the batch") for a in loss_axes if mesh.get(a, 1) > 1]
    params = dict(staged.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    for fqn, stages in sorted(staged.tied_stages.items()):
        ranks = sorted({spec.rank_of_stage(s, pp) for s in stages})
        p = params.get(fqn)
        if len(ranks) < 2 or staged.pp_rank not in ranks or p is None or id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard
        rows.append(CommRow("backward", "all_reduce", axis, len(ranks), fqn, "tied_grad_sum", "<tied>", tuple(local.shape),
                            local.dtype, local.numel() * local.element_size(),
                            f"tied gradient summed between stages {stages}"))
    return rows


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
