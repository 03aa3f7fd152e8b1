"""``fxshard.transform``: the pass pipeline.  ``PIPELINE`` below is the table of contents.

Every pass is ``pass_(gm, ctx) -> None``: it rewrites the graph in place, reading the
plan only through the :class:`~fxshard.meta.PassContext` built once from it, and talks
to later passes only through the ``node.meta`` contract of :mod:`fxshard.meta`.  Each
row names the facts of that contract its pass *requires* of the graph and *ensures*
for later ones (as ``torch.fx.passes.infra.pass_base.PassBase.requires/ensures``); the
runner checks them before and after the pass, and a broken one is an
:class:`~fxshard.errors.InternalError` naming the pass.  The pass's module docstring
says in full what it reads and writes.

Example (stop after a pass, time every pass)::

    timings = {}
    gm = fxshard.transform(model, plan, example_inputs=(ids,), stop_after="propagate", timings=timings)
    print(fxshard.dump(gm))     # the layouts, before any rewrite
    print(timings)              # {"capture": 0.41, "outline_regions": 0.0, ..., "propagate": 0.12}
"""
from __future__ import annotations

import contextlib
import copy
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

from fxshard.errors import InternalError, PlanError, target_name
from fxshard.frontend.capture import flat_inputs
from fxshard.frontend.static_sizes import guard_static_input_sizes
from fxshard.frontend.trace import keep_codegen, keep_non_persistent, trace
from fxshard.markers import is_marker
from fxshard.meta import KEY, PROGRAM_KEY, PassContext, Rewrite, TensorInfo, program_meta
from fxshard.runtime import collectives
from fxshard.runtime.gathered_linears import gathered_linears as gathered_linears_op
from fxshard.plan.plan import Plan
from fxshard.training.batch import guard_equal_pieces
from fxshard.training.checkpointing import checkpoint_blocks, has_checkpointed_layers
from fxshard.state.module_state import add_missing_state, graph_attribute_tensors, named_state
from fxshard.passes.outline_regions import outline_regions
from fxshard.passes.record_shapes import makes_tensor, record_shapes
from fxshard.passes.functionalize_leaves import functionalize_leaves
from fxshard.passes.regions import regions
from fxshard.passes.replicate_heads import replicate_heads
from fxshard.passes.distributed_norm_statistics import distributed_norm_statistics
from fxshard.passes.propagate import propagate
from fxshard.passes.localize import localize
from fxshard.passes.context_parallel_attention import context_parallel_attention
from fxshard.passes.local_regions import local_regions
from fxshard.passes.expert_all_to_all import expert_all_to_all
from fxshard.passes.defer_bias import defer_bias
from fxshard.passes.vocab_parallel_embedding import vocab_parallel_embedding
from fxshard.passes.loss_parallel import loss_parallel
from fxshard.passes.global_mean_loss import global_mean_loss
from fxshard.passes.redistribute import redistribute
from fxshard.passes.insert_grad_syncs import insert_grad_syncs
from fxshard.passes.check_fsdp_axis import check_fsdp_axis
from fxshard.passes.bucket_grad_syncs import DEFAULT_CAP_MB, bucket_grad_syncs
from fxshard.passes.fuse_gathered_linears import fuse_gathered_linears
from fxshard.passes.bind_runtime import bind_runtime
from fxshard.passes.shard_state import shard_state
from fxshard.passes.cleanup import cleanup
from fxshard.passes.split_blocks import split_blocks
from fxshard.passes.register_program import register_program


@dataclass(frozen=True)
class Fact:
    """A fact of the ``node.meta`` contract that a pass requires of the graph before it
    runs, or ensures for later passes.  ``broken(gm)`` is None when the fact holds, else
    what breaks it, naming a node; it reads the graph once, cheaply."""

    name: str
    broken: Callable[[fx.GraphModule], str | None]

    def __repr__(self) -> str:
        return self.name


def _first(gm: fx.GraphModule, wrong: Callable[[fx.Node], bool], what: str) -> str | None:
    node = next((n for n in gm.graph.nodes if wrong(n)), None)
    return None if node is None else f"node `{node.name}` ({target_name(node)}) {what}"


def _info(n: fx.Node):
    return n.meta.get(KEY)


def _holds_tensor(n: fx.Node) -> bool:
    return n.op != "output" and isinstance(n.meta.get("val"), torch.Tensor)


# the predicates test the common case first: a walk of a 1,000-node graph takes about a millisecond
def _unshaped(n: fx.Node) -> bool:
    return "val" not in n.meta and makes_tensor(n)


def _undeclared(n: fx.Node) -> bool:
    planned = n.op == "get_attr" or n.op == "placeholder" and _holds_tensor(n)
    return planned and getattr(_info(n), "declared", None) is None


def _without_layout(n: fx.Node) -> bool:
    if isinstance(getattr(_info(n), "value", None), TensorInfo):
        return False
    if n.op == "call_function" and n.target is getattr:  # an attribute of a region's output: read as its owner is
        return False
    return n.op == "get_attr" or _holds_tensor(n)


_COMMUNICATING = frozenset((collectives.all_reduce, collectives.reduce_scatter, collectives.all_gather, collectives.shard,
                            collectives.all_to_all, collectives.grad_sync, collectives.grad_sync_bucket, gathered_linears_op))


def _unexplained_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _COMMUNICATING and getattr(_info(n), "collective", None) is None


SHAPES = Fact("val", lambda gm: _first(gm, _unshaped, "has no meta['val'] (its global fake value)"))
DECLARED = Fact("declared", lambda gm: _first(gm, _undeclared, "is a parameter, buffer or input without its declared layout "
                                                               "(NodeInfo.declared)"))
LAYOUTS = Fact("value", lambda gm: _first(gm, _without_layout, "holds a tensor but has no layout (NodeInfo.value)"))
MARKERS_GONE = Fact("no markers", lambda gm: _first(gm, is_marker, "is a region marker left in the graph"))
COLLECTIVES = Fact("collective", lambda gm: _first(gm, _unexplained_collective,
                                                   "communicates but does not say what (NodeInfo.collective)"))


def rewritten(*rewrites: Rewrite) -> Fact:
    """No node still asks for one of ``rewrites``: the pass that acts on them has."""

    def asks(n: fx.Node) -> bool:
        rewrite = getattr(_info(n), "rewrite", None)
        return rewrite is not None and rewrite in rewrites

    names = "/".join(rewrites)
    return Fact(f"rewrite {names} done", lambda gm: _first(gm, asks, f"still asks for rewrite {names} (NodeInfo.rewrite)"))


def program(field: str) -> Fact:
    """``ProgramMeta.<field>`` is set (program state, :class:`fxshard.meta.ProgramMeta`)."""
    return Fact(f"ProgramMeta.{field}",
                lambda gm: None if getattr(program_meta(gm), field) is not None else f"ProgramMeta.{field} is not set")


@dataclass(frozen=True)
class Pass:
    """One row of the pipeline: a pass, the facts it requires and ensures, and when it runs.

    ``requires`` / ``ensures``: :class:`Fact` s checked before and after the pass (an
    InternalError names the pass that broke one).  ``when``: runs only if ``when(ctx)``
    (``None``: always).  ``per_rank``: runs under the caller's simulated ranks
    (``LocalTensorMode``), because it makes per-rank values (the bound mesh, each rank's
    shards); every other pass sees one global graph.
    """

    name: str
    run: Callable[[fx.GraphModule, PassContext], None]
    requires: tuple[Fact, ...] = ()
    ensures: tuple[Fact, ...] = ()
    when: Callable[[PassContext], bool] | None = None
    per_rank: bool = False


def _under_fsdp(ctx: PassContext) -> bool:
    return bool(ctx.fsdp_axes)


def _splits_blocks(ctx: PassContext) -> bool:
    return ctx.split_blocks


PIPELINE: tuple[Pass, ...] = (
    # -- the captured graph, with global shapes --------------------------------------------------------
    Pass("outline_regions", outline_regions),
    Pass("record_shapes", record_shapes, ensures=(SHAPES,)),
    # -- the plan, onto the graph ----------------------------------------------------------------------
    Pass("functionalize_leaves", functionalize_leaves),
    Pass("regions", regions, ensures=(DECLARED,)),
    Pass("replicate_heads", replicate_heads, requires=(SHAPES, DECLARED)),
    Pass("distributed_norm_statistics", distributed_norm_statistics, requires=(SHAPES,)),
    # -- layouts ---------------------------------------------------------------------------------------
    Pass("propagate", propagate, requires=(SHAPES, DECLARED), ensures=(LAYOUTS,)),
    # -- the per-rank program: rewrites the layout rules asked for (fxshard.meta.Rewrite) -----------------
    Pass("localize", localize, requires=(LAYOUTS,),
         ensures=(rewritten(Rewrite.ARANGE_OFFSET, Rewrite.NARROW_POSITIONS, Rewrite.WINDOW_ROWS),)),
    Pass("context_parallel_attention", context_parallel_attention, requires=(LAYOUTS,),
         ensures=(rewritten(Rewrite.CONTEXT_PARALLEL), COLLECTIVES)),
    Pass("local_regions", local_regions, requires=(LAYOUTS,), ensures=(COLLECTIVES,)),
    Pass("expert_all_to_all", expert_all_to_all, requires=(LAYOUTS,), ensures=(COLLECTIVES,)),
    Pass("defer_bias", defer_bias, requires=(LAYOUTS,), ensures=(rewritten(Rewrite.DEFER_BIAS), COLLECTIVES)),
    Pass("vocab_parallel_embedding", vocab_parallel_embedding, requires=(LAYOUTS,),
         ensures=(rewritten(Rewrite.VOCAB_PARALLEL_EMBEDDING),)),
    Pass("loss_parallel", loss_parallel, requires=(LAYOUTS,), ensures=(rewritten(Rewrite.LOSS_PARALLEL),)),
    Pass("global_mean_loss", global_mean_loss, ensures=(rewritten(Rewrite.GLOBAL_MEAN),)),
    # -- communication ---------------------------------------------------------------------------------
    Pass("redistribute", redistribute, requires=(LAYOUTS,), ensures=(MARKERS_GONE, COLLECTIVES)),
    Pass("insert_grad_syncs", insert_grad_syncs, requires=(LAYOUTS, COLLECTIVES), ensures=(COLLECTIVES,)),
    Pass("check_fsdp_axis", check_fsdp_axis, requires=(LAYOUTS, COLLECTIVES), when=_under_fsdp),
    Pass("bucket_grad_syncs", bucket_grad_syncs, requires=(COLLECTIVES,), ensures=(COLLECTIVES,)),
    Pass("fuse_gathered_linears", fuse_gathered_linears, requires=(LAYOUTS, COLLECTIVES), ensures=(COLLECTIVES,)),
    # -- the program on this rank ----------------------------------------------------------------------
    Pass("bind_runtime", bind_runtime, ensures=(program("mesh"),), per_rank=True),
    Pass("shard_state", shard_state, requires=(LAYOUTS,), ensures=(program("state"),), per_rank=True),
    Pass("cleanup", cleanup, requires=(COLLECTIVES,), per_rank=True),
    Pass("split_blocks", split_blocks, ensures=(program("fsdp_units"),), when=_splits_blocks, per_rank=True),
    Pass("register_program", register_program, per_rank=True),
)

PASS_NAMES: tuple[str, ...] = tuple(p.name for p in PIPELINE)


def transform(gm_or_module: fx.GraphModule | nn.Module, plan: Plan, example_inputs: Sequence[Any] | None = None,
              example_kwargs: dict | None = None, *, capture: str = "auto", dynamic_shapes=None,
              bucket_cap_mb: float | None = DEFAULT_CAP_MB, overlap_grad_syncs: bool = True, blocks: str | None = None,
              stop_after: str | None = None, timings: dict[str, float] | None = None) -> fx.GraphModule:
    """Rewrite a model into the per-rank program of ``plan``; returns a new GraphModule.

    Example::

        mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))
        plan = fxshard.Plan(mesh, {"w1": fxshard.colwise(), "w2": fxshard.rowwise()})
        sharded = fxshard.transform(model, plan, example_inputs=(x,))
        y_local = sharded(x)          # every rank passes its inputs per plan.inputs

    An HF model is called with keywords, and keeps its output structure::

        plan = fxshard.Plan.from_hf(mesh, model)
        sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels})
        sharded(input_ids=ids, labels=labels).loss.backward()

    ``gm_or_module`` is an ``nn.Module`` (captured with :func:`fxshard.trace`; ``capture``
    and ``dynamic_shapes`` are passed on), a GraphModule from :func:`fxshard.trace`, or
    one from plain ``torch.fx.symbolic_trace`` (then example inputs are required).
    ``example_inputs`` / ``example_kwargs`` are the single-device (global) inputs.  The
    input is never mutated, also when the transform fails.  The plan's mesh is bound for the collectives (see :func:`fxshard.bind_mesh`).
    ``bucket_cap_mb``: gradient syncs of replicated parameters are coalesced into
    all-reduces of at most this many MiB (DDP's default, 25; as DDP's, the first bucket the
    backward completes holds at most 1 MiB, so that its all-reduce starts early); ``None``
    or ``0``: one per parameter.  ``overlap_grad_syncs``: a bucket's all-reduce is started when its last
    gradient is ready and waited on at the end of the backward, as DDP does (see
    :func:`fxshard.grad_sync_bucket`); ``False``: waited on at once.  ``blocks``: the result calls one submodule per
    transformer block (``"auto"``: the items of module lists; or the modules an FQN
    pattern matches, e.g. ``"layers.*"``), for :func:`fxshard.compile` (one graph per
    block) and :func:`fxshard.fully_shard`; buckets stay within a block.  With
    ``Plan(fsdp="dp")`` the blocks are always split (``"auto"`` unless given).
    A model with activation checkpointing on (HF's ``gradient_checkpointing_enable()``,
    torch's ``checkpoint_wrapper``) has its blocks split out and checkpointed again
    (:func:`fxshard.checkpoint_blocks`): the capture traces through the checkpoints.
    ``stop_after``: the name of a pass in :data:`PIPELINE`; the graph right after it is
    returned (for tests and debugging: it is not a runnable program before the last pass).
    ``timings``: a dict that receives the wall time in seconds of the capture
    (``"capture"``) and of every pass that ran, by name.
    """
    if getattr(plan, "pipeline", None) is not None:
        raise PlanError(f"this plan carries a pipeline ({plan.pipeline.axis!r}): its program is cut into stages\n  fix: "
                        f"fxshard.pipeline_transform(model, plan, mesh, example_inputs=..., example_kwargs=...) with the "
                        f"whole mesh, then fxshard.train_step(staged, inputs)")
    if stop_after is not None and stop_after not in PASS_NAMES:
        raise PlanError(f"stop_after={stop_after!r} is not a pass of fxshard.transform; the passes are {list(PASS_NAMES)}")
    # the capture traces through activation checkpointing: it is put back per block (split out for it)
    checkpoint = isinstance(gm_or_module, nn.Module) and has_checkpointed_layers(gm_or_module)
    if checkpoint and blocks is None:
        blocks = "auto"
    with _gc_paused():
        with maybe_disable_local_tensor_mode(), _attributed_to("capture"), _timed("capture", timings):
            gm, shapes = _fresh_copy(gm_or_module, plan, example_inputs, example_kwargs, capture, dynamic_shapes)
        ctx = PassContext.from_plan(plan, blocks=blocks, bucket_cap_mb=bucket_cap_mb, overlap_grad_syncs=overlap_grad_syncs,
                                    example_inputs=shapes,
                                    shapes_recorded=isinstance(gm_or_module, nn.Module) and not isinstance(gm_or_module, fx.GraphModule))
        run_pipeline(gm, ctx, stop_after=stop_after, timings=timings)
    if stop_after is None:
        guard_equal_pieces(gm)  # first: the ranks agree on their pieces before a rank-local size check
        guard_static_input_sizes(gm)
    if checkpoint and stop_after is None:
        checkpoint_blocks(gm)
    return gm


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, *, stop_after: str | None = None,
                 timings: dict[str, float] | None = None) -> fx.GraphModule:
    """Run the passes of :data:`PIPELINE` on ``gm`` in order (in place), up to and including
    ``stop_after``, checking what each requires before it and ensures after it.  An
    exception other than a PlanError inside a pass, or a fact it broke, is an
    :class:`~fxshard.errors.InternalError` that names the pass."""
    for p in PIPELINE:
        if p.when is None or p.when(ctx):
            scope = contextlib.nullcontext() if p.per_rank else maybe_disable_local_tensor_mode()
            with scope, _timed(p.name, timings):
                _check(gm, p, p.requires, "requires")
                with _attributed_to(p.name):
                    p.run(gm, ctx)
                _check(gm, p, p.ensures, "ensures")
        if p.name == stop_after:
            break
    return gm


def _check(gm: fx.GraphModule, p: Pass, facts: tuple[Fact, ...], verb: str) -> None:
    for fact in facts:
        broken = fact.broken(gm)
        if broken is not None:
            when = "before it runs" if verb == "requires" else "after it ran"
            raise InternalError(p.name, f"it {verb} {fact.name!r} (fxshard.transform.PIPELINE), which {when} does not "
                                        f"hold: {broken}")


@contextlib.contextmanager
def _timed(name: str, timings: dict[str, float] | None):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def _attributed_to(name: str):
    """A PlanError leaves ``transform`` as it is: the plan does not fit.  Any other
    exception inside a pass (or the capture) is a bug in fxshard, an InternalError
    naming the pass and the line (``propagate`` names the node itself)."""
    try:
        yield
    except (PlanError, InternalError):
        raise
    except Exception as e:
        raise InternalError.from_exception(name, e) from e


@contextlib.contextmanager
def _gc_paused():
    """The passes allocate many small objects (nodes, metadata) and free few: Python's
    cyclic collector would rescan the whole heap for nothing (measured: +15% at 64
    layers, benchmarks/transform_time.py)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _fresh_copy(obj, plan, example_inputs, example_kwargs, capture, dynamic_shapes) -> tuple[fx.GraphModule, tuple | None]:
    """The graph the passes rewrite, never the caller's, and the flat example inputs its
    shapes are still to be recorded from (``None``: recorded already, or none given)."""
    if isinstance(obj, fx.GraphModule):
        gm = _copy_graph_module(obj)
        shapes = tuple(flat_inputs(gm, example_inputs or (), example_kwargs)) if (example_inputs is not None or example_kwargs) else None
        return _guard_meta_calls(gm), shapes
    if isinstance(obj, nn.Module):
        if example_inputs is None and not example_kwargs:
            raise PlanError("transforming an nn.Module needs example_inputs= or example_kwargs= (the single-device inputs)")
        # capture reads the model and never writes it; the copy is of the captured graph
        captured = trace(obj, plan, example_inputs or (), example_kwargs, capture=capture, dynamic_shapes=dynamic_shapes)
        return _guard_meta_calls(_copy_graph_module(captured)), None
    raise PlanError(f"fxshard.transform expects an nn.Module or fx.GraphModule, got {type(obj).__name__}")


def _guard_meta_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A program transformed on the meta device holds no values until
    ``fxshard.materialize``: give it a pre-hook that says so when it is called on real
    inputs (torch would fail deep inside with "Tensor on device meta is not on the
    expected device").  The hook removes itself on the first call that finds every
    tensor real: no cost on the hot path."""
    if any(t.is_meta for _, t, _ in named_state(gm)):
        gm.register_forward_pre_hook(_MetaGuard(), with_kwargs=True)
    return gm


class _MetaGuard:
    """The pre-hook of :func:`_guard_meta_calls` (a class: a deep copy of the program
    copies it, and it finds itself in the copy's hooks to remove itself)."""

    def __call__(self, module, args, kwargs):
        import torch
        from torch.utils._pytree import tree_leaves

        meta = next((fqn for fqn, t, _ in named_state(module) if t.is_meta), None)
        if meta is None:
            for key, hook in list(module._forward_pre_hooks.items()):
                if hook is self:
                    del module._forward_pre_hooks[key]
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
            return None
        if any(isinstance(x, torch.Tensor) and not x.is_meta for x in tree_leaves((args, kwargs))):
            raise PlanError(f"this program was transformed on the meta device and holds no values yet ({meta} is a meta "
                            f"tensor), but it was called on real inputs\n  fix: call fxshard.materialize(sharded, model, "
                            f"device=...) first (then fxshard.load_hf_checkpoint / fxshard.load for trained weights)")
        return None


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy of the module tree and graph whose parameters and buffers *alias* the
    input's storage (a 70B model is never held twice): ``shard_state`` later gives
    every tensor storage of its own, the rank's shard only.  Node metadata is copied
    shallowly except fxshard's own, which every transform derives afresh."""
    attributes = graph_attribute_tensors(gm)  # plain tensors the graph reads: buffers in the copy
    memo: dict = _aliases(gm, [t for _, t in attributes])  # one memo: tied parameters stay tied in the copy
    holder = nn.Module()
    for name, m in gm.named_children():
        holder.add_module(name, copy.deepcopy(m, memo))
    for name, p in gm.named_parameters(recurse=False):
        holder.register_parameter(name, copy.deepcopy(p, memo))
    for name, b in gm.named_buffers(recurse=False):
        holder.register_buffer(name, copy.deepcopy(b, memo))
    for fqn, t in attributes:
        add_missing_state(holder, [(fqn, memo[id(t)], False)])
    keep_non_persistent(gm, holder)
    for fqn, _ in attributes:  # not in the model's state_dict: non-persistent
        owner = holder.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else holder
        vars(owner).pop(fqn.rpartition(".")[2], None)
        owner._non_persistent_buffers_set.add(fqn.rpartition(".")[2])
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        n.meta.pop(KEY, None)
    captured = program_meta(gm)
    new = fx.GraphModule(holder, graph, captured.model_class or gm.__class__.__name__)
    _keep_unreferenced_state(gm, new, memo)
    keep_non_persistent(holder, new)
    keep_codegen(gm, new)
    new.meta.update({k: v for k, v in gm.meta.items() if k != PROGRAM_KEY})  # torch's own keys
    new.meta[PROGRAM_KEY] = captured.captured()  # the capture's facts, not a former transform's state
    return new


def _aliases(module: nn.Module, attributes: Sequence = ()) -> dict:
    """``deepcopy`` memo mapping each parameter and buffer (and each plain tensor
    attribute in ``attributes``) to a new tensor object on the same storage: the copy's
    passes may replace attributes, never write the data."""
    memo: dict = {}
    for t in attributes:
        memo.setdefault(id(t), t.detach())
    for _, t, is_param in named_state(module):
        if id(t) not in memo:
            alias = t.detach()
            memo[id(t)] = nn.Parameter(alias, requires_grad=t.requires_grad) if is_param else alias
    return memo


def _keep_unreferenced_state(gm: fx.GraphModule, new: fx.GraphModule, memo: dict) -> None:
    """``fx.GraphModule`` copies only the attributes its graph reads; a captured graph
    reads a tied weight under one name (``model.embed_tokens.weight``, not
    ``lm_head.weight``) and no unused parameter at all.  Every FQN of the model stays:
    ``state_dict`` keys and ties are the model's (``memo`` maps to the copies made)."""
    add_missing_state(new, [(n, copy.deepcopy(t, memo), p) for n, t, p in named_state(gm)])
