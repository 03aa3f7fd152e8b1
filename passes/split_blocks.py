"""split_blocks: one submodule per transformer block, for FSDP2 and ``fxshard.compile``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) works per module: a forward pre-hook
all-gathers a module's parameters, a backward hook reduce-scatters their gradients.
The passes work on one flat graph, which calls no submodule; this last stage moves
the nodes of each transformer block (found by ``nn_module_stack``) into a
sub-GraphModule at the block's FQN and calls it, so ``sharded.layers[0]`` is the
block again, with its parameters under their own names (``state_dict`` keys do not
change).  The nodes keep their metadata, so dumps and the comm summary walk into the
blocks (``ProgramMeta.block`` on each).

A block is, by default, an item of a module list or dict: the outermost module in a
node's stack whose last name is a number (``layers.0``, ``model.layers.3``,
``transformer.h.11``); ``pattern`` (an FQN pattern such as ``"layers.*"``) picks
others.  Runs under ``Plan(fsdp=...)`` and with ``transform(blocks=...)``.  No node outside a block may read a value made inside it and hand it back
(``fxshard.transform`` keeps gradient-sync buckets within a block when it splits);
such a graph is a PlanError naming the node.

Reads:  ``nn_module_stack``; ``ProgramMeta.module_dicts`` (written by ``fxshard.trace``).
Writes: the block submodules; ``ProgramMeta.fsdp_units`` (block FQNs, in order).
"""
from __future__ import annotations


import torch.fx as fx
import torch.nn as nn

from fxshard.errors import PlanError
from fxshard.state.module_state import add_missing_state, named_state

from fxshard.passes.outline_regions import outline
from fxshard.meta import PassContext, block_of, program_meta  # noqa: F401 - block_of: the blocks this pass splits out

def split_blocks(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Outline every block into a sub-GraphModule called once (in place)."""
    pattern = ctx.block_pattern
    blocks: dict[str, str] = {}
    for node in gm.graph.nodes:
        fqn = block_of(node, pattern)
        if fqn and fqn not in blocks:
            blocks[fqn] = _class_name(node, fqn)
    if not blocks and (pattern is not None or not ctx.fsdp_axes):  # asked for blocks (FSDP2 alone may have none)
        which = f"no module's FQN matches the blocks= pattern (as a regex: {pattern.pattern})" if pattern is not None else (
            "blocks='auto' found no item of a module list or dict")
        raise PlanError(f"fxshard.transform: {which}, so there is no transformer block to split out\n  fix: pass the "
                        f"blocks' FQN pattern, e.g. blocks='layers.*' (the modules that repeat), or leave blocks= out")
    program = program_meta(gm, create=True)
    mesh = program.mesh
    for fqn, class_name in blocks.items():
        holder = gm.get_submodule(fqn)
        state = named_state(holder)
        non_persistent = {name: set(m._non_persistent_buffers_set) for name, m in holder.named_modules()}
        outline(gm, fqn, fqn, class_name)
        block = gm.get_submodule(fqn)
        add_missing_state(block, state)  # a GraphModule keeps only what its graph reads
        for name, m in block.named_modules():
            m._non_persistent_buffers_set.update(non_persistent.get(name, ()))
        block_program = program_meta(block, create=True)
        block_program.block = fqn
        if mesh is not None:
            block_program.mesh = dict(mesh)
    dicts = set(program.module_dicts or ())
    for parent in {fqn.rpartition(".")[0] for fqn in blocks}:
        _as_container(gm, parent, dict_=parent in dicts)
    program.fsdp_units = list(blocks)
    return


def _as_container(gm: fx.GraphModule, fqn: str, dict_: bool) -> None:
    """A GraphModule rebuilds the module tree from plain ``nn.Module`` s; the blocks'
    parent becomes the model's container again (``nn.ModuleDict`` where the model had
    one, as torchtitan does; else ``nn.ModuleList`` when its children are ``0 .. n-1``),
    so ``sharded.layers[i]`` / ``sharded.layers.items()`` work as on the model."""
    parent = gm.get_submodule(fqn) if fqn else gm
    names = list(parent._modules)
    if type(parent) is not nn.Module or parent._parameters or parent._buffers:
        return
    if dict_:
        container = nn.ModuleDict(parent._modules)
    elif names == [str(i) for i in range(len(names))]:
        container = nn.ModuleList(parent._modules.values())
    else:
        return
    owner, _, name = fqn.rpartition(".")
    setattr(gm.get_submodule(owner) if owner else gm, name, container)


def _class_name(node: fx.Node, fqn: str) -> str:
    for qualname, mtype in (node.meta.get("nn_module_stack") or {}).values():
        if qualname == fqn:
            name = mtype if isinstance(mtype, str) else getattr(mtype, "__name__", "Block")
            return name.rsplit(".", 1)[-1].strip("'>")
    return "Block"
