"""The ``node.meta["fxshard"]`` contract: the only way passes talk to each other.

Every pass documents which fields it reads and writes.  Summary:

=================  ==================================================  =============
field              meaning                                             written by
=================  ==================================================  =============
``region``         FQN of the innermost planned module of the node     regions
``declared``       what the plan says about this node (see below)      regions
``value``          :class:`TensorInfo` / :class:`SizeInfo` / tuple      propagate
``rule``           name of the layout rule that produced ``value``     propagate
``redistribute``   ``(src, dst)`` layouts on a boundary marker         propagate
``rewrite``        :class:`Rewrite`: a graph rewrite the node needs    propagate (the layout rules)
``collective``     :class:`Collective` on a communication node         redistribute, insert_grad_syncs,
                                                                       bucket_grad_syncs
=================  ==================================================  =============

``declared`` is a complete layout on ``get_attr`` and ``placeholder`` nodes, a
:class:`Boundary` on ``region_input`` / ``region_output`` markers, and a
:class:`LocalRegion` on the ``call_module`` node of an opaque local region
(``ModuleSpec(local=True)``, ``fxshard.expert_parallel``).  ``extra["splits"]``
on a ``get_attr`` node: the part sizes of a fused parameter (``colwise(splits=...)``);
``extra["heads"]`` (written by ``regions``): the head count of ``colwise(heads=...)``, and
``extra["head_replicas"]`` (written by ``replicate_heads``, read by ``insert_grad_syncs`` and
``shard_state``): a :class:`fxshard.layout.placements.HeadReplicas` where the axis has more ranks than
heads (the node's ``val`` then has the shape with each head stored once per replica).
``extra["pattern"]`` (written by ``regions``, read by :func:`fxshard.explain`): the plan
entry that applies to the node: on a ``get_attr`` the entry whose ``params=`` declared
its layout, elsewhere the entry of the node's ``region``.
On a local region's ``call_module`` (written by ``local_regions`` / ``expert_all_to_all``):
``extra["region"]`` is ``"carved"`` (its module is now a sub-GraphModule, whose nodes
carry this same metadata) or ``"as is: <why fx could not trace it>"``;
``extra["expert_parallel"]`` says where the all-to-alls went.  Inside a carved region
``extra["local"]`` is ``(local shape, dtype)`` of a tensor, from one run on zeros.
``extra["context_parallel"]`` / ``extra["context_parallel_module"]`` (written by ``regions``):
the :class:`fxshard.plan.specs.ContextParallel` and FQN of the innermost context-parallel module
around a node; ``extra["mean_axes"]`` (written by the cross-entropy rule): the
context-parallel axes a mean loss is taken over (``global_mean_loss``, ``loss_parallel``).
``extra["distributed_norm"]`` (written by ``regions``, read by ``distributed_norm_statistics``): the
axis of the ``fxshard.distributed_norm`` module around a node; that pass's statistic
markers are ``region_output`` nodes whose :class:`Boundary` has kind ``"statistic"``.
``rewrite`` is a :class:`Rewrite`: each value names the one pass that acts on it.

Fake tensors with the *global* shapes live in ``node.meta["val"]`` (written by
``fxshard.trace`` / ``record_shapes``, as torch.fx's FakeTensorProp does).

The program-level contract: what a program carries as a whole (its mesh, each tensor's
global layout and shape, its blocks, the capture's facts, what makes a module pipelined)
is one :class:`ProgramMeta`, under the one key ``meta[PROGRAM_KEY]`` of the GraphModule (of a
block's or carved region's sub-GraphModule, of a pipelined module), read and written only
through :func:`program_meta` (no string key of ``gm.meta`` is read elsewhere:
``tests/test_meta.py``).  :func:`pipeline_of` is the one answer to "is this a pipelined
module", :func:`programs_of` the programs it runs; both live here so that the layers below
``fxshard.pipelining`` (training, state, debug) never import it.

Example::

    program_meta(sharded).state["layers.0.attention.wq.weight"]   # ({"tp": Shard(0)}, (64, 64))
    for program in programs_of(staged): ...                       # a pipelined module's stages
"""
from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping, TypedDict

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from fxshard.plan.plan import Plan

KEY = "fxshard"


@dataclass
class TensorInfo:
    """A tensor value: layout per mesh axis, global and local shape.

    ``blocks``: for the output of a fused projection (``colwise(splits=...)``), the
    global sizes of the parts its sharded dim is made of; each rank holds its slice of
    every part, so a ``split`` into exactly these parts is legal.
    """

    layout: dict
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    blocks: tuple[int, ...] | None = None


@dataclass
class SizeInfo:
    """A Python int (or tuple of ints, like ``x.shape``) read from a tensor at run time.

    ``value`` is the global value seen while tracing.  ``axes`` says on which mesh
    axes the tensor dim it came from was sharded: at run time the int is the *local*
    size, so it may only size a dim sharded the same way.  ``None`` means the int was
    combined in a way fxshard cannot follow (e.g. ``seqlen + 1`` of a sharded dim).
    """

    value: Any
    axes: Any  # frozenset[str] | None, or a tuple of those for a tuple value


@dataclass
class Boundary:
    """A module boundary declared by the plan, attached to a marker node.

    Its layouts hold only the axes the plan names; on the other axes the value keeps
    the layout it arrives with.
    """

    fqn: str
    name: str  # argument name (inputs) or output name
    kind: str  # "input" | "output" | "statistic" (a distributed_norm mean: dst applies where it is Partial)
    required: dict | None = None  # input: layout required on entry
    expected: dict | None = None  # input: layout the preset says arrives (checked)
    src: dict | None = None  # output: layout the module produces (checked)
    dst: dict | None = None  # output: layout on exit


@dataclass
class LocalRegion:
    """An opaque region (``ModuleSpec(local=True)``): one ``call_module`` node that runs
    on local tensors.  Its output layout is declared, never derived.

    ``outs`` is the ``out_src`` layout of its output, holding the axes the plan names
    (a tuple of layouts, by position, for a module returning a tuple).  ``params`` holds the complete layout of
    every parameter and buffer the region owns, by absolute FQN (Replicate unless the
    plan or the preset says otherwise).  ``owners`` maps the FQN of each child that
    lives on one rank only (module-list experts) to ``(axis, index)``: the child stays
    on the rank whose coordinate on ``axis`` is ``index``.  ``compute`` is the user's
    function replacing the forward; ``experts`` is the
    :class:`fxshard.runtime.moe.ExpertParallelSpec` of an expert-parallel region, or the
    :class:`fxshard.runtime.routed_experts.RoutedExpertsSpec` of routed experts.  ``blocks``
    maps the FQN of a packed parameter to its :class:`fxshard.layout.placements.DimBlocks`.
    """

    fqn: str
    pattern: str
    outs: Any  # dict | tuple[dict, ...]
    params: dict = field(default_factory=dict)
    owners: dict = field(default_factory=dict)
    compute: Any = None
    experts: Any = None
    style: str | None = None
    blocks: dict = field(default_factory=dict)


@dataclass
class Collective:
    """A communication node: what it does forward and backward, on which axis."""

    op: str
    axis: str
    fwd: str
    bwd: str
    purpose: str = ""  # e.g. "redistribute layers.0.attention.wo output" / "grad sync"


class Rewrite(StrEnum):
    """A graph rewrite a layout rule asks for (``NodeInfo.rewrite``), and the pass that makes it.

    A layout rule decides layouts and never edits the graph.  Where the layout it decides
    is right only once the graph changes (the bias of a row-parallel linear added after
    the reduction, a lookup into a vocab-sharded table masked), the rule asks for the
    change by name (``ctx.request_rewrite``) and the pass in ``pass_name`` makes it; the
    rule is the one place that knows *when*, the pass the one that knows *how*.  Every
    value is acted on by exactly that pass, whose row in ``fxshard.transform.PIPELINE``
    ensures no request of its kind is left (``tests/test_transform.py`` checks that every
    value written is a member, asked for by a rule, and read by its pass).  A member is a
    ``str``: ``info(node).rewrite == "defer_bias"`` holds.

    Example::

        if info(node).rewrite == Rewrite.DEFER_BIAS:    # in passes/defer_bias.py
            ...
        Rewrite.DEFER_BIAS.pass_name                    # "defer_bias"
    """

    def __new__(cls, value: str, pass_name: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.pass_name = pass_name
        return member

    # NAME = value, the pass that acts on it  # the rule that asks for it (fxshard/layout/op_rules/), and when
    DEFER_BIAS = "defer_bias", "defer_bias"  # matmul.linear: a Partial output with a bias
    VOCAB_PARALLEL_EMBEDDING = "vocab_parallel_embedding", "vocab_parallel_embedding"  # indexing.embedding: Shard(0) table
    LOSS_PARALLEL = "loss_parallel", "loss_parallel"  # reductions.softmax (log), reductions.cross_entropy: sharded classes
    GLOBAL_MEAN = "global_mean", "global_mean_loss"  # reductions.cross_entropy: a mean over a context-parallel axis
    CONTEXT_PARALLEL = "context_parallel", "context_parallel_attention"  # attention.sdpa: q/k/v sharded on the sequence
    ARANGE_OFFSET = "arange_offset", "localize"  # factories.factory: arange(n) of a sharded size, this rank's positions
    NARROW_POSITIONS = "narrow_positions", "localize"  # reshapes.narrow: a table narrowed to a context-parallel length
    WINDOW_ROWS = "window_rows", "localize"  # attention.sliding_window_mask: this rank's rows of the mask


@dataclass
class NodeInfo:
    region: str | None = None
    declared: Any = None
    value: Any = None
    rule: str | None = None
    redistribute: tuple[dict, dict] | None = None
    rewrite: Rewrite | None = None
    collective: Collective | None = None
    extra: NodeExtra = field(default_factory=dict)  # type: ignore[assignment]


def info(node: fx.Node) -> NodeInfo:
    """The node's fxshard metadata, created empty on first access."""
    meta = node.meta.get(KEY)
    if meta is None:
        meta = node.meta[KEY] = NodeInfo()
    return meta


def tensor_info(node: Any) -> TensorInfo | None:
    """TensorInfo of a node argument, or None for non-tensors."""
    if isinstance(node, fx.Node):
        v = node.meta.get(KEY)
        v = v.value if v is not None else None
        return v if isinstance(v, TensorInfo) else None
    return None


class NodeExtra(TypedDict, total=False):
    """The keys of ``NodeInfo.extra``: facts a pass records on a node for a later pass or
    for the debugging tools.  Writer -> readers on each line."""

    splits: tuple[int, ...]  # get_attr of a fused parameter: its part sizes (regions -> propagate, localize)
    heads: int  # get_attr of colwise(heads=n): the head count (regions -> replicate_heads)
    head_replicas: Any  # fxshard.layout.placements.HeadReplicas (replicate_heads -> grad_sync, shard_state)
    pattern: str  # the plan entry that applies to the node (regions -> explain)
    region: str  # local region call: "carved" or "as is: <why>" (local_regions, expert_all_to_all -> dump)
    expert_parallel: str  # where the all-to-alls went (expert_all_to_all -> dump)
    local: tuple  # inside a carved region: (local shape, dtype) from one run on zeros (local_regions)
    context_parallel: Any  # fxshard.plan.specs.ContextParallel around the node (regions -> propagate, cp pass)
    context_parallel_module: str  # FQN of that module (regions -> context_parallel_attention)
    gathered: Any  # gathered_linears call: the TensorInfo of the whole input it gathers (fuse_gathered_linears -> comm_summary)
    mean_axes: tuple[str, ...]  # cp axes a mean loss is taken over (propagate -> global_mean_loss, loss_parallel)
    distributed_norm: str  # axis of the distributed_norm module around the node (regions -> distributed_norm_statistics)


PROGRAM_KEY = "fxshard_program"  # the one key fxshard keeps in a program's ``meta``: its ProgramMeta


@dataclass
class PipelineInfo:
    """What makes a module pipelined (``ProgramMeta.pipeline``, written by
    ``fxshard.pipelining.PipelinedModule``): ``spec`` the :class:`fxshard.plan.pipeline.PipelineSpec`,
    this rank's ``stage_ids`` of ``num_stages``, its place ``pp_rank`` on the ``pp_size`` ranks.

    The module it is found on (:func:`pipeline_of`) holds this rank's stage GraphModules in
    ``.stages`` (:func:`programs_of`), and offers ``sync_stage_state()`` / ``adopt_stage_state()``
    (its tensors into the stages / the stages' into it), ``owned_parameters()`` (a tied
    parameter on its first pipeline rank only) and ``pp_group``: what ``fxshard.training``
    needs of it without importing ``fxshard.pipelining`` (a higher layer)."""

    spec: Any
    stage_ids: list[int]
    num_stages: int
    pp_size: int
    pp_rank: int


@dataclass
class StageInfo:
    """``ProgramMeta.pipeline_stage`` of a pipeline stage's GraphModule: its index and the
    transformer blocks it holds (``fxshard.pipelining.stages`` -> grad_norm, tests)."""

    stage: int
    blocks: list[str]


@dataclass
class ProgramMeta:
    """The state fxshard keeps on a program (a GraphModule from the capture or the transform,
    a block's or carved region's sub-GraphModule, a pipelined module), for the later passes,
    the runtime, the state and the debugging tools: one object under ``meta[PROGRAM_KEY]``,
    read and written through :func:`program_meta`.  ``GraphModule.__deepcopy__`` and pickling
    keep ``meta`` (so copies keep it); ``fx.GraphModule(root, graph)`` starts an empty ``meta``:
    who builds a program that way copies what it keeps (``transform._copy_graph_module``:
    :meth:`captured`; ``pipelining.stages``).  Writer -> readers on each line."""

    # -- the capture (fxshard.frontend): kept by the transform (captured()) ----------------------------
    captured_by: str | None = None  # "torch.export" | "torch.fx" (frontend.capture, frontend.trace -> error messages)
    model_class: str | None = None  # class name of the captured model (frontend -> GraphModule name, guards' messages)
    model_type: str | None = None  # HF config.model_type, if any (frontend.trace -> state.hf_checkpoint)
    module_dicts: list | None = None  # FQNs of nn.ModuleDict containers (frontend.trace -> split_blocks)
    static_input_dims: list | None = None  # [(placeholder, dim, size)]: input dims export kept static, the model's
    #   code fixing them (frontend.capture -> frontend.static_sizes: the transformed program's input check)
    input_dim_ranges: list | None = None  # [(placeholder, dim, low, high, fixed, bounds)]: symbolic input dims whose
    #   range export narrowed, a size derived from them fixed by the model's code (frontend.static_sizes -> its check)
    capture_blocks: str | None = None  # "stamped 29 of 32 blocks of model.layers from 3 captured" or
    #   "captured in full: <why>" (frontend.repeated_blocks, frontend.capture -> benchmarks, tests)
    # -- the transform ------------------------------------------------------------------------------
    mesh: dict[str, int] | None = None  # axis sizes (bind_runtime -> dump, comm_summary, shards, grad_norm, batch)
    context_parallel: dict | None = None  # {axis: {"method", "load_balance"}} (bind_runtime -> batch, runtime)
    state: dict | None = None  # {fqn: (global layout, global shape)} of every tensor (shard_state -> state/*,
    #   grad_norm, batch); None: not a transformed program
    blocks: dict = field(default_factory=dict)  # {fqn: DimBlocks} of packed parameters (shard_state -> state/*)
    heads: dict = field(default_factory=dict)  # {fqn: HeadReplicas} of KV heads held by several ranks
    #   (shard_state -> state/*, grad_norm)
    fsdp: tuple[str, ...] | None = None  # the axes FSDP2 must still be applied on (register_program -> training.fsdp)
    fsdp_mesh: dict | None = None  # {FSDP2 mesh dim: the plan axes it spans} ("dp_cp": ("dp", "cp")), once applied
    #   (training.fsdp -> state.shards: which ranks hold FSDP2's distinct pieces)
    fsdp_units: list | None = None  # block FQNs, in order (split_blocks -> training.fsdp, compile, checkpointing)
    block: str | None = None  # on a block's sub-GraphModule: its FQN (split_blocks -> debug.graph_walk)
    activation_checkpoint: str | None = None  # on a block's sub-GraphModule: its forward runs checkpointed, "full"
    #   or "selective" (training.checkpointing.checkpoint_blocks -> training.compile, checkpointed_blocks)
    region: str | None = None  # on a carved local region's sub-GraphModule: its FQN (local_regions -> dump)
    lifted: Any = None  # on a carved region: the constants its trace lifted to inputs (local_regions, on a re-transform)
    # -- pipelining ----------------------------------------------------------------------------------
    pipeline_stage: StageInfo | None = None  # on a pipeline stage (pipelining.stages -> grad_norm)
    pipeline: PipelineInfo | None = None  # on a PipelinedModule (pipelining.train_step -> pipeline_of)

    def captured(self) -> "ProgramMeta":
        """A new ProgramMeta with this one's capture fields only (what a re-built program keeps)."""
        return ProgramMeta(**{f: getattr(self, f) for f in CAPTURE_FIELDS})


CAPTURE_FIELDS = ("captured_by", "model_class", "model_type", "module_dicts", "static_input_dims", "input_dim_ranges",
                  "capture_blocks")


class _Unset(ProgramMeta):
    """What :func:`program_meta` answers for a module that carries none: every field empty,
    and writing one raises (it would be lost: write with ``program_meta(m, create=True)``)."""

    def __setattr__(self, name, value):
        raise AttributeError(f"this module carries no ProgramMeta: write ProgramMeta.{name} through "
                             f"program_meta(module, create=True)")


def program_meta(module: Any, create: bool = False) -> ProgramMeta:
    """The :class:`ProgramMeta` of a program: a GraphModule, a block's or region's
    sub-GraphModule, a pipelined module, or any module that carries one.  A module that
    carries none gets an empty read-only one, or (``create=True``) a new one, stored.

    Example::

        program_meta(sharded).state            # {fqn: (layout, shape)}; None if not transformed
        program_meta(gm, create=True).mesh = dict(ctx.axes)
    """
    meta = getattr(module, "meta", None)
    found = meta.get(PROGRAM_KEY) if isinstance(meta, dict) else None
    if found is not None:
        return found
    if not create:
        empty = object.__new__(_Unset)
        for f in fields(ProgramMeta):
            object.__setattr__(empty, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)
        return empty
    if not isinstance(meta, dict):
        if meta is not None:
            raise TypeError(f"{type(module).__name__}.meta is a {type(meta).__name__}, not a dict: it cannot carry a ProgramMeta")
        meta = {}
        module.meta = meta
    found = meta[PROGRAM_KEY] = ProgramMeta()
    return found


def pipeline_of(module: Any) -> PipelineInfo | None:
    """The one answer to "is this a pipelined module" (``fxshard.pipeline_transform``'s
    result): its :class:`PipelineInfo`, or None."""
    return program_meta(module).pipeline


def programs_of(module: Any) -> list:
    """The programs a module runs: a pipelined module's stages on this rank, else ``[module]``."""
    return list(module.stages) if pipeline_of(module) is not None else [module]


@dataclass(frozen=True)
class PassContext:
    """Everything a pass is given besides the graph: the plan and what follows from it,
    derived once by :meth:`from_plan`.  Every pass is ``pass_(gm, ctx) -> None``.

    Example::

        ctx = PassContext.from_plan(plan)
        ctx.axes        # {"dp": 2, "tp": 4}
        PassContext(axes={"tp": 2})   # enough for a pass that reads only the axes (tests)
        ctx.cp_axes     # {"cp": ContextParallel(method="allgather", load_balance=True)}
    """

    plan: "Plan | None" = None
    mesh: Any = None  # DeviceMesh, or a MeshSpec when planning offline
    axes: Mapping[str, int] = field(default_factory=dict)  # mesh axis -> size, in mesh order
    fsdp_axes: tuple[str, ...] = ()  # the axes FSDP2 owns (Plan(fsdp=...)), or ()
    cp_axes: Mapping[str, Any] = field(default_factory=dict)  # axis -> ContextParallel: the sequence is sharded there
    load_balanced: tuple[str, ...] = ()  # cp axes whose sequence is split load-balanced
    block_pattern: re.Pattern | None = None  # which modules are the transformer blocks (None: module-list items)
    split_blocks: bool = False  # one sub-GraphModule per block (FSDP2, transform(blocks=...)); buckets stay within one
    bucket_cap_bytes: int | None = None  # gradient-sync bucket size (None: one sync per parameter)
    overlap_grad_syncs: bool = False  # buckets wait at the end of the backward, not at once
    example_inputs: tuple | None = None  # flat single-device inputs: the graph's shapes are still to record
    shapes_recorded: bool = False  # the capture recorded every node's global shape already

    @property
    def fsdp_mean_axes(self) -> tuple[str, ...]:
        """The FSDP2 axes whose gradients are averaged (FSDP2's convention): all but the
        context-parallel ones, whose ranks' gradient shares are summed as fxshard's are."""
        return tuple(a for a in self.fsdp_axes if a not in self.cp_axes)

    @classmethod
    def from_plan(cls, plan: "Plan", *, blocks: str | None = None, bucket_cap_mb: float | None = 25,
                  overlap_grad_syncs: bool = False, example_inputs: tuple | None = None,
                  shapes_recorded: bool = False) -> "PassContext":
        from fxshard.plan.specs import pattern_regex

        cp_axes = plan.context_parallel_axes()
        return cls(plan=plan, mesh=plan.mesh, axes=dict(plan.axes), fsdp_axes=tuple(plan.fsdp_axes),
                   cp_axes=cp_axes, load_balanced=tuple(a for a, cp in cp_axes.items() if cp.load_balance),
                   block_pattern=pattern_regex(blocks) if blocks and blocks != "auto" else None,
                   split_blocks=bool(blocks or plan.fsdp),
                   bucket_cap_bytes=int(bucket_cap_mb * 2**20) if bucket_cap_mb else None,
                   overlap_grad_syncs=overlap_grad_syncs, example_inputs=example_inputs,
                   shapes_recorded=shapes_recorded)


_BLOCK_ITEM = re.compile(r"(^|\.)\d+$")


def block_of(node: fx.Node, pattern: re.Pattern | None = None) -> str:
    """FQN of the transformer block ``node`` was traced in (by ``nn_module_stack``), or ``""``
    outside every block.  A block is the outermost item of a module list or dict (``layers.3``,
    ``model.layers.0``), or the outermost module ``pattern`` matches (``PassContext.block_pattern``)."""
    for qualname, _ in (node.meta.get("nn_module_stack") or {}).values():
        if qualname and (pattern.match(qualname) if pattern is not None else _BLOCK_ITEM.search(qualname)):
            return qualname
    return ""
