"""Cutting a transformed program into pipeline stages.

``fxshard.transform`` gives one flat GraphModule per rank whose nodes carry
``nn_module_stack``; ``fxshard.meta.block_of`` names the transformer block
of each node.  :func:`cut_stages` assigns every node a stage at block boundaries (stage 0
also holds everything before the first block: the embedding, rotary tables, masks; the
last stage everything after the last block: the final norm and the head) and builds one
GraphModule per stage whose inputs and outputs are the tensors that cross the cut.
Without ``split=`` the stages are balanced by :mod:`.stage_costs` (a block's FLOPs, parameter
and activation bytes whatever wraps it; the embedding on the first stage, the head and the
loss on the last), the function the planner predicts the cut with.

- Parameters and buffers (``get_attr``) and what is computed from them alone are copied
  into every stage that reads them: a tied weight (GPT-2's embedding and head) is held by
  both stages (``StageCut.tied`` lists them; their gradients are summed after backward).
- Non-tensor values that cross a cut (a batch or sequence size read from ``input_ids``,
  a device) are not sent: the later stage reads them from a tensor it receives (the dim of
  a received activation whose symbolic size is the same), so every stage runs at the
  micro-batch's sizes.
- The model's own loss (the nodes that depend on a target input such as HF ``labels``)
  is no stage: it becomes :class:`LossProgram`, which torch's schedule calls on the last
  stage's output as ``loss_fn(output, target)``.  A mean cross-entropy is rewritten to a
  sum over the micro-batch's tokens, divided by the count of scored tokens of the whole
  batch (:attr:`LossProgram.count`), so micro-batch losses add up to the global mean.

Reads: ``nn_module_stack``, ``val`` (shapes of values that cross), ``fxshard`` (layouts,
to read sizes only from dims no axis shards).  Writes: new GraphModules; the input is not
modified.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxshard.errors import PlanError
from fxshard.meta import StageInfo, program_meta

from fxshard.state.module_state import add_missing_state, named_state

from fxshard.plan.pipeline import PipelineSpec

from .stage_costs import StageCost, balanced_stages, flat_args, cost_shares, node_block, program_blocks, unit_costs

FREE = -1  # a stage index meaning "computed from parameters and constants alone: copied where used"
LOSS = 1 << 30  # a stage index meaning "part of the loss (depends on a target input)"

# ops between the cross-entropy and the loss output that do not change a sum into something else
_TRANSPARENT_METHODS = {"to", "float", "double", "type_as", "clone", "contiguous", "view", "reshape", "squeeze"}


@dataclasses.dataclass
class LossProgram:
    """The model's loss, cut out of the last stage.

    ``summed(*outputs, target)``: the micro-batch's summed token loss (the model's mean
    cross-entropy with ``reduction="sum"``); ``count(target)``: how many tokens it scores
    (targets other than ``ignore_index``), so ``summed / count(whole batch)`` adds up to the
    model's mean over the batch.
    """

    summed: fx.GraphModule
    count: fx.GraphModule
    target: str  # the placeholder name of the target input


@dataclasses.dataclass
class StageCut:
    """The stages of a program (:func:`cut_stages`)."""

    stages: list[fx.GraphModule]
    blocks: list[list[str]]  # the block FQNs of each stage
    costs: list[StageCost]  # per unit: "<before>", the blocks in order, "<after>"
    stage_costs: list[float]  # the balance cost of each stage (a share of the whole)
    inputs: list[str]  # stage 0's placeholders: the model's inputs it takes, in order
    loss: LossProgram | None
    tied: dict[str, list[int]]  # parameter FQN -> the stages holding it, where more than one
    boundaries: list[list[tuple[str, tuple, torch.dtype]]]  # per cut s | s+1: (name, global shape, dtype) sent
    loss_axes: tuple[str, ...] = ()  # the axes the loss's target is sharded on (the batch on dp)
    batch_axes: tuple[str, ...] = ()  # the axes any input is sharded on
    batch_ranks: int = 1  # how many ranks share the batch (the product of their sizes)
    fsdp_ranks: int = 1  # the size of the axis given to FSDP2 (which averages gradients where fxshard sums)

    def describe(self) -> str:
        lines = []
        for s, (blocks, cost) in enumerate(zip(self.blocks, self.stage_costs)):
            sent = ", ".join(f"{n} {list(shape)}" for n, shape, _ in self.boundaries[s]) if s < len(self.boundaries) else ""
            span = f"{blocks[0]} .. {blocks[-1]}" if len(blocks) > 1 else blocks[0]
            lines.append(f"stage {s}: {span} ({len(blocks)} blocks, cost {cost:.2f})" + (f"; sends {sent}" if sent else ""))
        return "\n".join(lines)


def cut_stages(gm: fx.GraphModule, spec: PipelineSpec, num_stages: int, targets: Sequence[str] = ("labels",),
               with_loss: bool = True) -> StageCut:
    """Cut the transformed program ``gm`` into ``num_stages`` stage GraphModules (see the module docstring).

    Example::

        cut = cut_stages(fxshard.transform(model, plan, example_kwargs=kw), fxshard.pipeline("pp"), 2)
        print(cut.describe())            # stage 0: model.layers.0 .. model.layers.1 (2 blocks, ...); sends ...
        cut.stages[1](*activations)      # the last stage's output: what the loss reads

    ``targets``: the inputs only the loss reads (HF ``labels``); with ``with_loss`` and one
    of them among the program's inputs, the model's loss becomes :attr:`StageCut.loss`,
    else the last stage returns the program's outputs.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    target_nodes = [n for n in placeholders if n.target in targets] if with_loss else []
    loss_nodes = _dependents(target_nodes)
    blocks = program_blocks(gm)
    if len(blocks) < num_stages:
        raise PlanError(f"pipeline: {num_stages} stages ({spec.axis} x virtual={spec.virtual}) but the model has only "
                        f"{len(blocks)} transformer blocks ({', '.join(blocks) or 'none found'}); a stage holds whole blocks"
                        f"\n  fix: a smaller {spec.axis!r} axis or virtual, or a model with at least {num_stages} blocks")
    # the costs of the balance (stage_costs): a block's whatever wraps it, the loss where it runs (the last stage)
    costs = unit_costs(gm, blocks, loss_nodes=loss_nodes)
    stage_of_node = _assign(nodes, blocks, loss_nodes, _block_stages(costs, blocks, spec, num_stages))
    stage_blocks = [[b for b in blocks if stage_of_node[b] == s] for s in range(num_stages)]
    share = cost_shares(costs)
    stage_costs = [0.0] * num_stages
    for i, c in enumerate(costs):
        s = 0 if i == 0 else num_stages - 1 if i == len(costs) - 1 else stage_of_node[c.name]
        stage_costs[s] += share[i]

    out_node = next(n for n in reversed(nodes) if n.op == "output")
    loss = None
    if loss_nodes:
        final_outputs, loss = _loss_program(gm, out_node, loss_nodes, stage_of_node, target_nodes)
    else:
        final_outputs = [a for a in flat_args(out_node.args[0])]
        for a in final_outputs:
            if not (isinstance(a, fx.Node) and _is_tensor(a)):
                raise PlanError(f"pipeline: the program's output {a} is not a tensor; the last stage sends tensors only\n"
                                f"  fix: return tensors from the model, or give the loss input (targets=) so fxshard cuts "
                                f"the loss out")
    # the tensors live across each cut: defined at or before stage s, read after it
    uses: dict[fx.Node, int] = {}
    for n in nodes:
        s = stage_of_node[n.name]
        if s in (FREE, LOSS) or n.op == "output":
            continue
        for a in n.all_input_nodes:
            if _is_sent(a) and stage_of_node[a.name] not in (FREE,) and stage_of_node[a.name] < s:
                uses[a] = max(uses.get(a, -1), s)
    for a in final_outputs:
        if stage_of_node[a.name] != FREE:
            uses[a] = max(uses.get(a, -1), num_stages)
    # the values crossing each cut in an order every rank agrees on: each rank captures the model itself,
    # and HF code that iterates a set of strings (Beam's, Gemma-4's rotary tables per layer type) traces
    # in an order that follows the process's string hashing, which differs between processes
    order = {n: i for i, n in enumerate(nodes)}
    fingerprint = _fingerprints(nodes)
    live = [[a for a in sorted(uses, key=lambda a: (fingerprint[a], order[a])) if stage_of_node[a.name] <= s < uses[a]]
            for s in range(num_stages - 1)]
    inputs = [n for n in placeholders if n not in target_nodes]
    stages = []
    for s in range(num_stages):
        ins = inputs if s == 0 else live[s - 1]
        outs = live[s] if s < num_stages - 1 else final_outputs
        stages.append(_build(gm, nodes, stage_of_node, s, ins, outs, f"stage{s}", stage_blocks[s]))
    tied: dict[str, list[int]] = {}
    for s, st in enumerate(stages):
        for fqn, p in st.named_parameters(remove_duplicate=False):
            tied.setdefault(fqn, []).append(s)
    tied = {fqn: ss for fqn, ss in tied.items() if len(ss) > 1}
    boundaries = [[(a.name, tuple(a.meta["val"].shape), a.meta["val"].dtype) if _is_tensor(a) else (a.name, ("size",), None)
                   for a in cut] for cut in live]
    return StageCut(stages, stage_blocks, costs, stage_costs, [n.target for n in inputs], loss, tied, boundaries)


# ----------------------------------------------------------------------------- assignment


def _fingerprints(nodes: list[fx.Node]) -> dict[fx.Node, tuple[int, str]]:
    """Per node, its depth (the longest path from an input or parameter: roughly the graph's order)
    and a digest of what it computes (its op, target and inputs' digests; a parameter or buffer by
    FQN, an input by name), neither of its name nor of its place in the graph: the same on every
    rank whatever order the capture met the nodes in.  Two nodes with one digest compute one value."""
    digest: dict[fx.Node, str] = {}
    depth: dict[fx.Node, int] = {}
    for n in nodes:
        depth[n] = max((depth[a] + 1 for a in n.all_input_nodes), default=0)
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__qualname__", None) or str(n.target)
        module = "" if isinstance(n.target, str) else getattr(n.target, "__module__", "") or ""
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: digest[a])
        digest[n] = hashlib.sha1(repr((n.op, module, target, args)).encode()).hexdigest()
    return {n: (depth[n], digest[n]) for n in nodes}


def _dependents(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(u for u in n.users if u.op != "output")
    return seen


def _block_stages(costs: list[StageCost], blocks: list[str], spec: PipelineSpec, num_stages: int) -> list[int]:
    """The stage of each block: ``spec.split`` names the first block of each stage after the first,
    else the stages are balanced by cost (``stage_costs.balanced_stages``)."""
    if spec.split is None:
        return balanced_stages(costs, num_stages)
    if len(spec.split) != num_stages - 1:
        raise PlanError(f"pipeline: split={list(spec.split)} names {len(spec.split)} cut points, but {num_stages} stages need "
                        f"{num_stages - 1} (the first block of each stage after the first)\n  fix: split= one block FQN per "
                        f"stage after the first, e.g. {blocks[len(blocks) // num_stages]!r}")
    starts = []
    for name in spec.split:
        hits = [i for i, b in enumerate(blocks) if b == name or b.endswith("." + name)]
        if len(hits) != 1:
            parts = name.split(".")
            prefixes = [".".join(parts[:k]) for k in range(1, len(parts))]  # "layers.2" of "layers.2.mlp"
            inner = [b for b in blocks if any(b == p or b.endswith("." + p) for p in prefixes)]
            if inner:
                raise PlanError(f"pipeline: split point {name!r} is inside block {inner[0]!r}; a stage holds whole blocks\n"
                                f"  fix: split at the block, e.g. split=[..., {inner[0]!r}, ...]")
            why = "matches several blocks" if hits else "is no transformer block of the model"
            raise PlanError(f"pipeline: split point {name!r} {why} (blocks: {', '.join(blocks)})\n  fix: name the first "
                            f"block of each stage after the first by its FQN, e.g. split=[{blocks[len(blocks) // num_stages]!r}]")
        starts.append(hits[0])
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise PlanError(f"pipeline: split={list(spec.split)} must name blocks in model order, after the first block "
                        f"({blocks[0]!r} starts stage 0)\n  fix: split=[{', '.join(repr(blocks[i]) for i in sorted(set(starts) - {0}))}]")
    stage_of_block, s = [], 0
    for i in range(len(blocks)):
        if s < len(starts) and i == starts[s]:
            s += 1
        stage_of_block.append(s)
    return stage_of_block


def _assign(nodes, blocks, loss_nodes, stage_of_block: list[int]) -> dict[str, int]:
    """Stage per node name (and per block FQN): a block's nodes go to its stage; a node
    outside every block to the latest stage of its inputs (0 for the inputs, FREE for
    values of parameters and constants alone); the loss's nodes to LOSS."""
    stage: dict[str, int] = {b: s for b, s in zip(blocks, stage_of_block)}
    for n in nodes:
        if n.op == "output":
            stage[n.name] = LOSS
        elif n in loss_nodes:
            stage[n.name] = LOSS
        elif n.op == "get_attr":
            stage[n.name] = FREE
        elif n.op == "placeholder":
            stage[n.name] = 0
        else:
            s = max((stage[a.name] for a in n.all_input_nodes), default=FREE)
            b = node_block(n)
            if b:
                if s > stage[b]:
                    raise PlanError(f"pipeline: node {n.name} of block {b} (stage {stage[b]}) reads a value of a later "
                                    f"stage ({s}); the blocks do not run in model order\n  fix: a split that keeps the "
                                    f"blocks in the order the model calls them")
                s = stage[b]
            stage[n.name] = s
    return stage


def _dead_code_out(graph: fx.Graph, gm: fx.GraphModule) -> None:
    """``graph.eliminate_dead_code()`` for a graph that calls ``gm``'s submodules (fx asks the
    owning module whether a ``call_module`` is pure)."""
    graph.owning_module = gm
    graph.eliminate_dead_code()


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _contiguous(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_contiguous())
    except Exception:  # noqa: BLE001 - a stride that cannot be decided statically: copy to be sure
        return False


def _is_size(n: fx.Node) -> bool:
    """An int read at run time (a batch or sequence size): sent across a cut as the shape
    of an empty tensor (:meth:`_StageBuilder.sent`), since it changes with the micro-batch."""
    val = n.meta.get("val")
    return isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool) and n.op != "get_attr"


def _negative(n: fx.Node) -> bool:
    """A size that is negative at the example's shapes (``-seq_len``): it crosses a cut as ``[-s, 0]``."""
    return _is_size(n) and _hint(n.meta["val"]) < 0


def _is_sent(n: fx.Node) -> bool:
    return _is_tensor(n) or _is_size(n)


def _hint(d) -> int:
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


# ----------------------------------------------------------------------------- building a stage


class _StageBuilder:
    """Copies nodes into a new graph; a value from elsewhere is a placeholder (a tensor that
    crossed), a copy (parameters and what is computed from them alone), or read again from a
    tensor at hand (a size, a device)."""

    def __init__(self, gm, stage_of_node, stage: int, inputs: list[fx.Node], where: str):
        self.gm, self.stage_of_node, self.stage, self.where = gm, stage_of_node, stage, where
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.tensors: list[tuple[fx.Node, fx.Node]] = []  # (original, new) tensors at hand, for sizes
        self.received: dict[fx.Node, fx.Node] = {}  # a size received as a tensor: its placeholder
        for n in inputs:
            p = self.graph.placeholder(n.name if n.op != "placeholder" else n.target)
            p.meta = dict(n.meta)
            if _is_size(n) and n.op != "placeholder":
                p.meta["val"] = torch.empty((1, 0))
                self.received[n] = p
                size = self.graph.call_method("size", (p, 0))
                self.env[n] = self.graph.call_function(operator.neg, (size,)) if _negative(n) else size
                continue
            self.env[n] = p
            if _is_tensor(n):
                self.tensors.append((n, p))

    def sent(self, n: fx.Node) -> fx.Node:
        """The value of ``n`` as this stage sends it; a size ``s`` as an empty tensor of shape
        ``[s, 0]``: torch's pipeline sends shapes ahead of values (its buffers are made from
        them), and none of the values of an empty tensor are read."""
        if not _is_size(n):
            value = self.value(n)
            if _is_tensor(n) and not _contiguous(n.meta["val"]):
                # c10d sends and receives contiguous tensors only, and torch's stage makes the next stage's
                # receive buffer with the strides of this output: a strided view (a transpose) is sent as a copy
                value = self.graph.call_method("contiguous", (value,))
                value.meta = dict(n.meta)
            return value
        if n in self.received:
            return self.received[n]
        value = self.value(n)
        if _negative(n):  # a shape holds no negative size (a slice's -seq_len): its magnitude is sent
            value = self.graph.call_function(operator.neg, (value,))
        return self.graph.call_method("new_empty", (self.tensors[0][1], (value, 0)))

    def value(self, n: fx.Node) -> fx.Node:
        if n in self.env:
            return self.env[n]
        s = self.stage_of_node[n.name]
        if s == self.stage or s == FREE:
            new = self.graph.node_copy(n, self.value)
            self.env[n] = new
            if _is_tensor(n) and s == self.stage:
                self.tensors.append((n, new))
            return new
        if not _is_tensor(n):
            new = self._reread(n)
            self.env[n] = new
            return new
        raise PlanError(f"pipeline ({self.where}): node {n.name} (stage {s}) is needed here but was not sent; this is a bug "
                        f"in fxshard's stage cut\n  fix: please report it with this message")

    def _reread(self, n: fx.Node) -> fx.Node:
        """A non-tensor value of another stage that is the same for every micro-batch (a
        device, a dtype), read again here."""
        val = n.meta.get("val")
        if isinstance(val, (torch.dtype, str, float, bool)) or val is None and n.op == "call_function" and \
                n.target is getattr and n.args[1] == "dtype":
            if val is not None:
                return val
        if n.op == "call_function" and n.target is getattr and len(n.args) > 1 and n.args[1] == "device" and self.tensors:
            return self.graph.call_function(getattr, (self.tensors[0][1], "device"))
        return self._no_reread(n)

    def _no_reread(self, n: fx.Node):
        raise PlanError(f"pipeline ({self.where}): node {n.name} ({n.format_node()}) is a non-tensor value made in another "
                        f"stage, and no tensor this stage receives has it as a size\n  fix: compute it inside the block that "
                        f"uses it, or move the split so that producer and user are in one stage")


def _build(gm, nodes, stage_of_node, stage: int, inputs: list[fx.Node], outputs: list[fx.Node], name: str,
           blocks: list[str]) -> fx.GraphModule:
    b = _StageBuilder(gm, stage_of_node, stage, inputs, name)
    for n in nodes:
        if stage_of_node[n.name] == stage and n.op not in ("placeholder", "output"):
            b.value(n)
    outs = [b.sent(o) for o in outputs]
    b.graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    _dead_code_out(b.graph, gm)
    stage_gm = fx.GraphModule(gm, b.graph, f"{gm.__class__.__name__}Stage{stage}")
    for prefix, m in stage_gm.named_modules():  # fx.GraphModule copies buffers, not whether they persist
        source = gm.get_submodule(prefix) if prefix else gm
        m._non_persistent_buffers_set.update(b for b in source._non_persistent_buffers_set if b in m._buffers)
    _copy_meta(gm, stage_gm)
    program_meta(stage_gm, create=True).pipeline_stage = StageInfo(stage=stage, blocks=list(blocks))
    return stage_gm


def _has_submodule(module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def _copy_meta(gm, new) -> None:
    """The program's state on a stage (``fx.GraphModule(gm, graph)`` starts an empty ``meta``):
    the layouts of the tensors it holds, its blocks; not the capture's input checks (the
    pipelined module makes them)."""
    held = {fqn for fqn, _ in new.named_parameters(remove_duplicate=False)} | {fqn for fqn, _ in new.named_buffers(remove_duplicate=False)}
    program = program_meta(gm)
    mine = program_meta(new, create=True)
    for f in dataclasses.fields(program):
        if f.name not in ("captured_by", "model_type", "static_input_dims", "input_dim_ranges", "capture_blocks"):
            setattr(mine, f.name, getattr(program, f.name))
    if program.state is not None:
        mine.state = {fqn: x for fqn, x in program.state.items() if fqn in held}
    if program.fsdp_units is not None:  # the blocks FSDP2 wraps one by one: this stage's
        mine.fsdp_units = [fqn for fqn in program.fsdp_units if fqn in new._modules or _has_submodule(new, fqn)]


# ----------------------------------------------------------------------------- the loss


def split_loss(gm: fx.GraphModule, targets: Sequence[str] = ("labels",)) -> tuple[fx.GraphModule, LossProgram | None]:
    """Cut the model's own loss (the nodes that depend on a ``targets`` input) out of a
    captured program, before the transform: returns the program without it (its inputs
    the others, its outputs the tensors the loss reads, e.g. the logits) and the loss as a
    :class:`LossProgram`, or ``gm`` itself and ``None`` when no target is an input.

    The transform then never sees the loss: a batch sharded on ``dp`` keeps a loss that is
    summed per rank and divided by the count of scored tokens of the whole batch.

    Example::

        model_gm, loss = split_loss(fxshard.trace(model, plan, example_kwargs=kw))
        sharded = fxshard.transform(model_gm, plan, example_kwargs={"input_ids": ids})
    """
    nodes = list(gm.graph.nodes)
    target_nodes = [n for n in nodes if n.op == "placeholder" and n.target in targets]
    loss_nodes = _dependents(target_nodes)
    if not loss_nodes:
        return gm, None
    stage_of_node = {n.name: LOSS if n in loss_nodes else FREE if n.op == "get_attr" else 0 for n in nodes}
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    from_model, loss = _loss_program(gm, out_node, loss_nodes, stage_of_node, target_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "output" or n in loss_nodes:
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    outs = [env[a] for a in from_model]
    graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    _dead_code_out(graph, gm)
    model_gm = fx.GraphModule(gm, graph, gm.__class__.__name__)
    add_missing_state(model_gm, named_state(gm))  # a tied head's other name, unused parameters: the model's FQNs
    for prefix, m in model_gm.named_modules():
        source = gm.get_submodule(prefix) if prefix else gm
        m._non_persistent_buffers_set.update(b for b in source._non_persistent_buffers_set if b in m._buffers)
    model_gm.meta.update(gm.meta)
    return model_gm, loss


def _loss_program(gm, out_node, loss_nodes, stage_of_node, target_nodes) -> tuple[list[fx.Node], LossProgram]:
    """The tensors the loss reads from the last stage, and the loss as a program of them and the target."""
    outs = [a for a in flat_args(out_node.args[0]) if isinstance(a, fx.Node)]
    losses = [a for a in outs if a in loss_nodes and _is_tensor(a) and a.meta["val"].dim() == 0]
    if len(losses) != 1:
        raise PlanError(f"pipeline: found {len(losses)} scalar outputs that depend on {[t.target for t in target_nodes]}; "
                        f"fxshard cuts out the model's own loss only when there is exactly one\n  fix: pass "
                        f"loss_fn=lambda output, target: ... to fxshard.train_step")
    loss = losses[0]
    ce = loss
    while ce.op == "call_method" and ce.target in _TRANSPARENT_METHODS:
        ce = ce.args[0]
    if not (ce.op == "call_function" and ce.target is F.cross_entropy):
        raise PlanError(f"pipeline: the model's loss {loss.name} ({loss.format_node()}) is not a mean cross-entropy; "
                        f"micro-batch losses could not be weighted into the batch's mean\n  fix: pass loss_fn=lambda "
                        f"output, target: ... to fxshard.train_step (a mean over the micro-batch)")
    kwargs = dict(ce.kwargs)
    reduction = kwargs.get("reduction", ce.args[7] if len(ce.args) > 7 else "mean")
    weight = kwargs.get("weight", ce.args[2] if len(ce.args) > 2 else None)
    if reduction != "mean" or weight is not None or len(ce.args) > 3:
        raise PlanError(f"pipeline: the model's cross-entropy {ce.name} has reduction={reduction!r}"
                        f"{', class weights' if weight is not None else ''}; fxshard weights micro-batches of a plain "
                        f"mean cross-entropy only\n  fix: pass loss_fn= to fxshard.train_step")
    ignore_index = kwargs.get("ignore_index", -100)
    target = ce.args[1]
    # what the loss reads from outside itself: tensors of the last stage (the logits), and
    # non-tensor values (sizes, a device) that it reads again from the tensors at hand
    from_model = []
    for n in loss_nodes:
        for a in n.all_input_nodes:
            if a not in loss_nodes and _is_sent(a) and stage_of_node[a.name] != FREE and a not in from_model:
                from_model.append(a)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    from_model.sort(key=order.get)
    (target_node,) = [t for t in target_nodes if t in _ancestors(target)] or target_nodes[:1]
    summed_stage = dict(stage_of_node)
    for n in loss_nodes:
        summed_stage[n.name] = LOSS
    b = _StageBuilder(gm, summed_stage, LOSS, [*from_model, target_node], "loss")
    for n in gm.graph.nodes:
        if n in loss_nodes and n not in target_nodes:
            if n is ce:
                new_ce = b.graph.node_copy(n, b.value)
                new_ce.kwargs = {**new_ce.kwargs, "reduction": "sum"}
                b.env[n] = new_ce
            else:
                b.value(n)
    b.graph.output(b.value(loss))
    _dead_code_out(b.graph, gm)
    summed = fx.GraphModule(gm, b.graph, "LossSum")
    # the count: nodes of the target alone (the shift, the view) and a comparison
    c = _StageBuilder(gm, summed_stage, LOSS, [target_node], "loss count")
    t = c.value(target)
    scored = c.graph.call_function(operator.ne, (t, ignore_index))
    c.graph.output(c.graph.call_method("sum", (scored,)))
    _dead_code_out(c.graph, gm)
    count = fx.GraphModule(gm, c.graph, "LossCount")
    if any(n.op == "get_attr" for n in count.graph.nodes) or any(n.op == "placeholder" and n.target != target_node.target
                                                               for n in count.graph.nodes):
        raise PlanError(f"pipeline: the cross-entropy's target {target.name} depends on more than the input "
                        f"{target_node.target!r}; fxshard cannot count the scored tokens\n  fix: pass loss_fn= to "
                        f"fxshard.train_step")
    return from_model, LossProgram(summed, count, target_node.target)


def _ancestors(n: Any) -> set:
    seen, todo = set(), [n] if isinstance(n, fx.Node) else []
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo.extend(x.all_input_nodes)
    return seen
