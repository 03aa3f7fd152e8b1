"""What each part of a program costs a pipeline stage, and the balanced cut: one function for
:func:`fxshard.pipelining.cut_stages` (so for ``pipeline_transform`` and the trainer) and for
the planner (``fxshard.planner``), so that the planner predicts the stages the pipeline makes.

A program is read as *units*: ``"<before>"`` (everything before the first transformer
block: the embedding, rotary tables, masks), each block in model order, and ``"<after>"``
(everything after the last block: the final norm, the head, and the loss the schedule runs
on the last stage's output).  A unit's :class:`StageCost` is

- ``flops``: forward FLOPs from each node's recorded *global* shapes (``meta["val"]``): a
  linear ``2 * out * in``, a matmul or grouped matmul ``2 * out * k``, attention ``4 * q * keys``,
  any other node its output's elements;
- ``param_bytes``: the bytes of the parameters and buffers it reads, at their global shapes
  (``ProgramMeta.state``: what a rank holds depends on the axes, a stage holds the same share
  of each), each once per unit; a block's own (its FQN under the block's) always the block's,
  wherever a gradient sync's bucket reads it;
- ``activation_bytes``: the bytes of the values its nodes make (what a backward may keep).

The same whatever wraps a block: a block the transform split out into a submodule
(``Plan(fsdp=...)`` for FSDP2, ``transform(blocks=...)`` for activation checkpointing and
``fxshard.compile``) is one ``call_module`` node in the program, and is costed by the nodes
of its own graph; an opaque region inside a block (``ModuleSpec(local=True)``: the routed
experts of an expert-parallel plan) by its parameters and 2 FLOPs per parameter per token it
is applied to (a region whose weights are stacked per expert, ``E`` on dim 0, with an integer
``[tokens, k]`` routing input applies ``k`` of them per token).  Collectives of tp / cp / ep
are nodes like others.  A program without its loss in the graph (the trainer's: the loss is
the schedule's ``loss_fn``) has a cross-entropy over its output counted in ``"<after>"``: 4
FLOPs and an fp32 log-probability (4 bytes) per logit.

:func:`cost_shares` turns costs into one number per unit, the mean of its shares of all
FLOPs (time), of all parameter bytes (memory held) and of all activation bytes (memory per
micro-batch in flight); :func:`balance` cuts the blocks into contiguous stages minimizing the
largest stage's share, the first stage charged ``"<before>"`` and the last ``"<after>"``.

Example::

    costs = unit_costs(fxshard.transform(model, plan, example_kwargs=kw))
    stage_of_block = balance(cost_shares(costs), 4)    # [0, 0, 1, 1, 2, 2, 3, 3] for 8 alike blocks
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Iterable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxshard.meta import block_of, program_meta

BEFORE, AFTER = "<before>", "<after>"

# a cross-entropy over the last stage's output, per logit: max, subtract-and-exp, sum, log-and-pick;
# it keeps the fp32 log-probabilities for the backward
LOSS_FLOPS_PER_LOGIT = 4
LOSS_BYTES_PER_LOGIT = 4


@dataclasses.dataclass
class StageCost:
    """The cost of one unit: a block, or the part before the first / after the last."""

    name: str
    param_bytes: int = 0
    flops: int = 0
    activation_bytes: int = 0  # bytes of the values its nodes make (what a backward may keep), at the example's shapes

    def scaled(self, rows: float) -> "StageCost":
        """The cost at ``rows`` times the example's rows: FLOPs and activations grow with the
        rows of a micro-batch, parameters do not (the planner measures at a few rows)."""
        return StageCost(self.name, self.param_bytes, round(self.flops * rows), round(self.activation_bytes * rows))

    def renamed(self, name: str) -> "StageCost":
        return dataclasses.replace(self, name=name)


def node_block(n: fx.Node) -> str:
    """The transformer block a node of a program belongs to (``""``: none): by its
    ``nn_module_stack``, or, for a block the transform split out into a submodule
    (``ProgramMeta.fsdp_units``), the ``call_module`` node of its FQN.

    Example: ``{node_block(n) for n in gm.graph.nodes} - {""}`` is the program's blocks."""
    if n.op == "call_module" and n.target in (program_meta(n.graph.owning_module).fsdp_units or ()):
        return n.target
    return block_of(n)


def program_blocks(gm: fx.GraphModule) -> list[str]:
    """The program's transformer blocks in the order its graph runs them.

    Example: ``program_blocks(gm)`` -> ``["model.layers.0", "model.layers.1"]``"""
    blocks: list[str] = []
    for n in gm.graph.nodes:
        b = node_block(n) if n.op not in ("placeholder", "get_attr", "output") else ""
        if b and b not in blocks:
            blocks.append(b)
    return blocks


def unit_costs(gm: fx.GraphModule, blocks: list[str] | None = None, *, loss_nodes: Iterable[fx.Node] = (),
               loss_on_output: bool | None = None) -> list[StageCost]:
    """The cost of each unit of the program ``gm`` (see the module docstring): ``"<before>"``,
    each of ``blocks`` (default :func:`program_blocks`), ``"<after>"``, in that order.

    ``loss_nodes``: nodes of the model's own loss in ``gm`` (counted in ``"<after>"``, where the
    loss runs).  ``loss_on_output``: count a cross-entropy over the program's outputs in
    ``"<after>"`` (the loss a schedule's ``loss_fn`` runs on the last stage); by default when
    ``loss_nodes`` is empty.

    Example::

        [(c.name, c.flops) for c in unit_costs(gm)]   # [("<before>", ...), ("layers.0", ...), ..., ("<after>", ...)]
    """
    blocks = program_blocks(gm) if blocks is None else list(blocks)
    loss_nodes = set(loss_nodes)
    if loss_on_output is None:
        loss_on_output = not loss_nodes
    units = {name: StageCost(name) for name in (BEFORE, *blocks, AFTER)}
    walker = _Walker(gm, units)
    current = BEFORE
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            if loss_on_output:
                for a in flat_args(n.args[0]):
                    walker.loss_on(units[AFTER], a)
            continue
        b = node_block(n)
        unit = b or (BEFORE if current == BEFORE else AFTER)
        if b:
            current = b
        if n in loss_nodes:
            unit = AFTER
        walker.add(units[unit], gm, n, "")
    return list(units.values())


def cost_shares(costs: list[StageCost]) -> list[float]:
    """Each unit's balance cost: the mean of its shares of all FLOPs (time), of all parameter
    bytes (memory held) and of all activation bytes (memory per micro-batch in flight); they
    add up to 1.

    Example: ``cost_shares(unit_costs(gm))`` -> ``[0.05, 0.11, ..., 0.11, 0.07]``"""
    flops = sum(c.flops for c in costs) or 1
    params = sum(c.param_bytes for c in costs) or 1
    activations = sum(c.activation_bytes for c in costs) or 1
    return [(c.flops / flops + c.param_bytes / params + c.activation_bytes / activations) / 3 for c in costs]


def balance(share: list[float], num_stages: int) -> list[int]:
    """The stage of each block (``share``: ``"<before>"``, the blocks..., ``"<after>"``, as
    :func:`cost_shares` gives) minimizing the largest stage's share: contiguous stages of one
    block at least, the first charged ``"<before>"``, the last ``"<after>"`` (a small dynamic
    program).  Of equally good cuts, the one that ends each stage earliest.

    Example: ``balance([0.1] + [0.1] * 8 + [0.1], 2)`` -> ``[0, 0, 0, 0, 1, 1, 1, 1]``"""
    blocks = share[1:-1]
    n = len(blocks)
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(i, j, s):  # blocks i..j-1 in stage s
        return prefix[j] - prefix[i] + (share[0] if s == 0 else 0) + (share[-1] if s == num_stages - 1 else 0)

    best = {(0, 0): (0.0, None)}  # (stages done, blocks done) -> (max cost, previous blocks done)
    for s in range(num_stages):
        for i in range(n):
            if (s, i) not in best:
                continue
            for j in range(i + 1, n - (num_stages - s - 1) + 1):
                value = max(best[(s, i)][0], cost(i, j, s))
                if (s + 1, j) not in best or value < best[(s + 1, j)][0] - 1e-12:
                    best[(s + 1, j)] = (value, i)
    stage_of_block = [0] * n
    j = n
    for s in range(num_stages, 0, -1):
        i = best[(s, j)][1]
        for b in range(i, j):
            stage_of_block[b] = s - 1
        j = i
    return stage_of_block


def balanced_stages(costs: list[StageCost], num_stages: int) -> list[int]:
    """``balance(cost_shares(costs), num_stages)``: the stage of each block.

    Example: ``balanced_stages(unit_costs(gm), 2)`` -> ``[0, 0, 0, 0, 1, 1, 1, 1]``"""
    return balance(cost_shares(costs), num_stages)


def node_flops(n: fx.Node) -> int:
    """Forward FLOPs of a node from its recorded global shapes: a linear ``2 * out * in``, a
    matmul or grouped matmul (routed experts) ``2 * out * k``, attention ``4 * q * keys``,
    anything else its output's elements.

    Example: ``node_flops(linear_node)`` -> ``2 * 4 * 16 * 64 * 64`` for ``[4, 16, 64] @ W[64, 64]``"""
    out = n.meta.get("val")
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]
    if n.op == "call_function" and n.target is F.linear and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return 2 * _numel(out) * _hint(args[1].shape[-1])
    if n.target in (torch.matmul, operator.matmul, torch.bmm, "matmul", "bmm") and args and isinstance(args[0], torch.Tensor):
        return 2 * _numel(out) * _hint(args[0].shape[-1])
    if n.op == "call_function" and "grouped_mm" in getattr(n.target, "__name__", "") and args and isinstance(args[0], torch.Tensor):
        return 2 * _numel(out) * _hint(args[0].shape[-1])  # routed experts: each row through its expert's weight
    if n.target is F.scaled_dot_product_attention and len(args) > 1 and all(isinstance(a, torch.Tensor) for a in args[:2]):
        return 4 * _numel(args[0]) * _hint(args[1].shape[-2])
    return _numel(out)


class _Walker:
    """Adds nodes' costs to a unit, looking into submodules the program calls."""

    def __init__(self, gm: fx.GraphModule, units: dict[str, StageCost]):
        self.state = program_meta(gm).state or {}  # {fqn: (global layout, global shape)}
        self.units = units
        self.seen: dict[str, set[str]] = {}  # per unit: the tensors already counted

    def add(self, cost: StageCost, owner: nn.Module, n: fx.Node, prefix: str) -> None:
        if n.op == "call_module":
            sub = owner.get_submodule(n.target)
            fqn = prefix + n.target
            if isinstance(sub, fx.GraphModule):  # a split-out block (FSDP2, checkpointing, compile) or carved region
                for inner in sub.graph.nodes:
                    if inner.op not in ("placeholder", "get_attr", "output"):
                        self.add(cost, sub, inner, fqn + ".")
                return
            self.region(cost, sub, n, fqn)
            return
        cost.flops += node_flops(n)
        cost.activation_bytes += _bytes(n.meta.get("val"))
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                self.tensor(cost, prefix + str(a.target), a.meta.get("val"))

    def tensor(self, cost: StageCost, fqn: str, t) -> None:
        """A parameter or buffer read by a node of ``cost``'s unit.  One of a block's own (its
        FQN under the block's) is the block's wherever it is read: a gradient sync's bucket
        (``grad_bucket``, outside every block) reads the weights of several blocks' norms, and
        the stage holding a block holds its parameters."""
        parts = fqn.split(".")
        owner = next((".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1) if ".".join(parts[:k]) in self.units), None)
        if owner is not None and owner not in (BEFORE, AFTER):
            cost = self.units[owner]
        seen = self.seen.setdefault(cost.name, set())
        if fqn in seen or not isinstance(t, torch.Tensor):
            return
        seen.add(fqn)
        cost.param_bytes += self.global_numel(fqn, t) * t.element_size()

    def global_numel(self, fqn: str, t: torch.Tensor) -> int:
        entry = self.state.get(fqn)
        return math.prod(_hint(d) for d in entry[1]) if entry is not None else _numel(t)

    def region(self, cost: StageCost, module: nn.Module, n: fx.Node, fqn: str) -> None:
        """An opaque region (an nn.Module fxshard runs as it is: routed experts): its tensors,
        its output, and 2 FLOPs per parameter per token it applies them to."""
        elements, stacked = 0, set()
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            self.tensor(cost, f"{fqn}.{name}", t)
            if isinstance(t, nn.Parameter):
                entry = self.state.get(f"{fqn}.{name}")
                shape = tuple(_hint(d) for d in entry[1]) if entry is not None else tuple(t.shape)
                elements += math.prod(shape)
                if len(shape) == 3:  # [experts, out, in]: a weight stacked per expert
                    stacked.add(shape[0])
        inputs = [a.meta.get("val") for a in n.all_input_nodes]
        routing = [t for t in inputs if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2]
        hidden = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2]
        experts = next(iter(stacked)) if len(stacked) == 1 else None
        if routing and experts:  # each token through k of the E stacked experts
            applied = _numel(routing[0]) * elements / experts
        else:
            applied = (_numel(hidden[0]) // max(1, _hint(hidden[0].shape[-1]))) * elements if hidden else 0
        cost.flops += round(2 * applied)
        cost.activation_bytes += _bytes(n.meta.get("val"))

    def loss_on(self, cost: StageCost, out) -> None:
        """A cross-entropy over an output of the program (its logits) on the last stage."""
        t = out.meta.get("val") if isinstance(out, fx.Node) else None
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2:
            cost.flops += LOSS_FLOPS_PER_LOGIT * _numel(t)
            cost.activation_bytes += LOSS_BYTES_PER_LOGIT * _numel(t)


def _bytes(val) -> int:
    """A tensor's bytes; a tuple's parts are counted where ``getitem`` takes them."""
    return _numel(val) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _hint(d) -> int:
    """A size, or the example's value of a symbolic one."""
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


def _numel(t) -> int:
    return math.prod(_hint(d) for d in t.shape) if isinstance(t, torch.Tensor) else 0


def flat_args(x) -> list:
    """The leaves of a node's nested arguments (tuples, lists, dicts): ``flat_args(out_node.args[0])``."""
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in flat_args(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in flat_args(item)]
    return [x]


__all__ = ["StageCost", "flat_args", "BEFORE", "AFTER", "node_block", "program_blocks", "unit_costs", "cost_shares", "balance",
           "balanced_stages", "node_flops", "LOSS_FLOPS_PER_LOGIT", "LOSS_BYTES_PER_LOGIT"]
