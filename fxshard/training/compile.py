"""Regional compile: ``fxshard.compile(sharded)`` compiles one graph per transformer block.

A whole transformed program compiled at once costs compile time in proportion to its
depth, and under FSDP2 dynamo breaks the graph at the hooks of every block.
torchtitan compiles each ``TransformerBlock`` on its own (``torch.compile(block,
fullgraph=True)``): the blocks are the same code, so dynamo compiles it once and reuses
it.  :func:`compile` does that for the blocks :func:`fxshard.transform` splits out
(``transform(..., blocks="auto")``, or ``Plan(fsdp=...)``): each block's ``forward`` is
replaced by a compiled one, so module hooks (FSDP2's unshard and reduce-scatter) run
around the compiled graph, never inside, and FQNs, ``state_dict`` keys and parameters
stay what they were.

Every block is a GraphModule with a class of its own, and dynamo guards on the class of
``self``: blocks whose generated code is the same (same text, same globals) are given
one class, so they share one ``forward`` and one compiled graph, recompiled only where
the guards differ (other shapes or dtypes).  The root program (embedding, head, loss)
stays eager.

Example::

    sharded = fxshard.transform(model, plan, (ids,), blocks="auto")
    fxshard.compile(sharded, backend="inductor")      # one graph for the 16 identical layers
    loss = F.cross_entropy(sharded(ids).flatten(0, 1), targets.flatten())
"""
from __future__ import annotations

import inspect
import re
import types

import torch
import torch.fx as fx

from fxshard.errors import PlanError
from fxshard.meta import pipeline_of, program_meta, programs_of
from fxshard.training.checkpointing import checkpointed

__all__ = ["compile", "compiled_blocks"]


def compile(sharded: fx.GraphModule, **torch_compile_kwargs) -> fx.GraphModule:  # noqa: A001 - fxshard.compile
    """Compile each transformer block of ``sharded`` with ``torch.compile`` (in place;
    returns ``sharded``).  ``torch_compile_kwargs`` go to ``torch.compile``
    (``backend=``, ``mode=``, ``dynamic=``, ...); ``fullgraph=True`` unless given: a
    graph break inside a block raises.  Blocks of the same code share one compiled graph.
    Works before or after :func:`fxshard.fully_shard` (FSDP2's hooks stay outside the
    compiled graphs).  Gradient-sync buckets inside a block wait where they reduce (see
    :func:`fxshard.grad_sync_bucket`); those of the root program stay overlapped.

    A pipelined module (:func:`fxshard.pipeline_transform` with ``blocks="auto"``) has the
    blocks of this rank's stages compiled, the identical ones of all its stages sharing a graph.

    Example: ``fxshard.compile(fxshard.transform(model, plan, (ids,), blocks="auto"), backend="aot_eager")``
    """
    pipelined = pipeline_of(sharded) is not None
    programs = programs_of(sharded)
    if not all(isinstance(p, fx.GraphModule) and program_meta(p).fsdp_units for p in programs):
        what = type(sharded).__name__
        how = "fxshard.pipeline_transform(model, plan, mesh, ..., blocks='auto')" if pipelined else \
            "fxshard.transform(model, plan, ..., blocks='auto') (or an FQN pattern such as blocks='layers.*')"
        raise PlanError(f"fxshard.compile: this {what} has no transformer blocks split out, so there is nothing to compile "
                        f"block by block\n  fix: transform with {how}, or compile the whole program with "
                        f"torch.compile(sharded)")
    kwargs = {"fullgraph": True, **torch_compile_kwargs}
    compiled: dict[tuple[type, str | None], object] = {}  # one compiled forward per block class and checkpointing
    classes: list[fx.GraphModule] = []  # the first block of each distinct code
    for program, fqn in ((p, fqn) for p in programs for fqn in program_meta(p).fsdp_units):
        block = program.get_submodule(fqn)
        if getattr(block, "_fxshard_compiled", None) is not None:
            raise PlanError(f"fxshard.compile: block {fqn!r} is compiled already\n  fix: call fxshard.compile once per program")
        _canonical_names(block, fqn)
        same = next((first for first in classes if _same_code(first, block)), None)
        if same is None:
            classes.append(block)
        elif type(block) is not type(same):
            block.__class__ = type(same)  # one class: dynamo's guard on type(self) holds for every such block
        # a checkpointed block (fxshard.checkpoint_blocks) compiles its checkpointed forward: dynamo's checkpoint op
        key = (type(block), program_meta(block).activation_checkpoint)
        if key not in compiled:
            compiled[key] = torch.compile(checkpointed(key[0].forward, key[1]) if key[1] else key[0].forward, **kwargs)
        block.forward = types.MethodType(compiled[key], block)
        block._fxshard_compiled = compiled[key]
    return sharded


def compiled_blocks(sharded: fx.GraphModule) -> dict[str, int]:
    """Block FQN -> the index of the compiled forward it runs (blocks of one index share
    one compiled graph); ``{}`` before :func:`compile`.

    Example: ``fxshard.compile(sharded); set(compiled_blocks(sharded).values())   # {0}: one graph``
    """
    index: dict[int, int] = {}
    out = {}
    for program, fqn in ((p, fqn) for p in programs_of(sharded) for fqn in program_meta(p).fsdp_units or ()):
        fn = getattr(program.get_submodule(fqn), "_fxshard_compiled", None)
        if fn is not None:
            out[fqn] = index.setdefault(id(fn), len(index))
    return out


def _canonical_names(block: fx.GraphModule, fqn: str) -> None:
    """Give the block's nodes names that do not depend on where it sits: the block's own
    prefix dropped (``layers_3_attention_wq_weight`` -> ``attention_wq_weight``), numbers
    counted within the block, inputs ``x``, ``x_1``, ...  Identical blocks then
    generate the same code text."""
    prefix = fqn.replace(".", "_") + "_"
    old = block.graph
    new = fx.Graph(owning_module=block, tracer_cls=old._tracer_cls, tracer_extras=old._tracer_extras)
    new._codegen = old._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in old.nodes:
        if node.op == "placeholder":  # they come first: x, x_1, ...
            copied = new.placeholder(f"x_{len(env)}" if env else "x", type_expr=node.type, default_value=_default(node))
        else:
            base = node.name[len(prefix):] if node.name.startswith(prefix) else node.name
            copied = new.create_node(node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                                     fx.map_arg(node.kwargs, env.__getitem__), name=re.sub(r"_\d+$", "", base) or node.op,
                                     type_expr=node.type)
        copied.meta = dict(node.meta)
        env[node] = copied
    wrapped = type(block)  # FSDP2's class over the GraphModule's: recompile sets the GraphModule's (fx sets
    block.__class__ = _plain_class(block)  # forward and __call__ on type(self), which would recurse under FSDP's)
    try:
        block.graph = new
    finally:
        block.__class__ = wrapped


def _default(node: fx.Node):
    return node.args[0] if node.args else inspect.Signature.empty


def _same_code(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether blocks ``a`` and ``b`` run the same generated code: the same source text
    and, for every global name it reads, the same object (an op, a constant)."""
    from torch.distributed.fsdp import FSDPModule

    if a.code != b.code or isinstance(a, FSDPModule) != isinstance(b, FSDPModule):
        return False
    fa, fb = _plain_class(a).forward, _plain_class(b).forward
    names = _global_names(fa.__code__)
    return all(fa.__globals__.get(n) is fb.__globals__.get(n) for n in names)


def _plain_class(block: fx.GraphModule) -> type:
    """The GraphModule class that generated ``block.forward`` (FSDP2 puts a class of its own over it)."""
    return next(c for c in type(block).__mro__ if "forward" in vars(c))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names
