"""``fxshard.transform``: the pass pipeline.  This list is the table of contents."""
from __future__ import annotations

import contextlib
import copy
import gc
import traceback
from typing import Any, Sequence

import torch.fx as fx
import torch.nn as nn
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import KEY
from fxshard.plan.plan import Plan
from fxshard.frontend.capture import flat_inputs
from fxshard.state.module_state import add_missing_state, graph_attribute_tensors, named_state
from fxshard.frontend.trace import keep_codegen, keep_non_persistent, record_shapes, trace
from fxshard.passes.outline_regions import outline_regions
from fxshard.passes.normalize import normalize
from fxshard.passes.regions import regions
from fxshard.passes.replicate_heads import replicate_heads
from fxshard.passes.distributed_norm import distributed_norm
from fxshard.passes.propagate import propagate
from fxshard.passes.localize import localize
from fxshard.passes.local_regions import local_regions
from fxshard.passes.expert_parallel import expert_parallel
from fxshard.passes.defer_bias import defer_bias
from fxshard.passes.vocab_parallel_embedding import vocab_parallel_embedding
from fxshard.passes.loss_parallel import loss_parallel
from fxshard.passes.context_parallel import context_parallel
from fxshard.passes.global_mean_loss import global_mean_loss
from fxshard.passes.redistribute import redistribute
from fxshard.passes.grad_sync import grad_sync
from fxshard.passes.bucket_grad_syncs import DEFAULT_CAP_MB, bucket_grad_syncs
from fxshard.passes.shard_state import shard_state
from fxshard.passes.cleanup import cleanup
from fxshard.passes.split_blocks import block_of, split_blocks
from fxshard.training.fsdp import check_fsdp_axis, require_fully_shard
from fxshard.training.grad_norm import track_parameters
from fxshard.plan.specs import pattern_regex


def transform(gm_or_module: fx.GraphModule | nn.Module, plan: Plan, example_inputs: Sequence[Any] | None = None,
              example_kwargs: dict | None = None, *, capture: str = "auto", dynamic_shapes=None,
              bucket_cap_mb: float | None = DEFAULT_CAP_MB, blocks: str | None = None) -> fx.GraphModule:
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
    ``example_inputs`` / ``example_kwargs`` are the single-device (global) inputs.  The input is never mutated, also when the transform fails.  The
    plan's mesh is bound for the collectives (see :func:`fxshard.bind_mesh`).
    ``bucket_cap_mb``: gradient syncs of replicated parameters are coalesced into
    all-reduces of at most this many MiB (DDP's default, 25); ``None`` or ``0``: one
    per parameter.  With ``Plan(fsdp="dp")`` the result calls one submodule per
    transformer block (items of module lists, or the modules ``blocks`` matches, e.g.
    ``"layers.*"``) for :func:`fxshard.fully_shard`, and buckets stay within a block.
    """
    with _gc_paused(), _only_plan_errors():
        with maybe_disable_local_tensor_mode():
            gm = _fresh_copy(gm_or_module, plan, example_inputs, example_kwargs, capture, dynamic_shapes)
            axes = plan.axes
            fsdp_axes = (plan.fsdp,) if plan.fsdp else ()
            cp_axes = plan.context_parallel_axes()  # {axis: ContextParallel}: the sequence is sharded there
            load_balanced = tuple(a for a, cp in cp_axes.items() if cp.load_balance)
            block_rx = pattern_regex(blocks) if blocks else None
            normalize(gm, plan)
            regions(gm, plan)
            replicate_heads(gm, axes)
            distributed_norm(gm)
            propagate(gm, axes, fsdp_axes, tuple(cp_axes))
            localize(gm, axes, load_balanced)
            context_parallel(gm, axes, cp_axes)
            local_regions(gm, axes)
            expert_parallel(gm)
            defer_bias(gm)
            vocab_parallel_embedding(gm, axes)
            loss_parallel(gm, axes)
            global_mean_loss(gm)
            redistribute(gm, axes)
            grad_sync(gm, fsdp_axes)
            if plan.fsdp:
                check_fsdp_axis(gm, plan.fsdp)
            # under FSDP2 a block's parameters exist (unsharded) only while it runs: no bucket spans two
            bucket_grad_syncs(gm, int(bucket_cap_mb * 2**20) if bucket_cap_mb else None,
                              (lambda n: block_of(n, block_rx)) if plan.fsdp else (lambda n: ""))
        collectives.bind_mesh(plan.mesh)
        collectives.bind_replica_groups(gm)  # process groups are made now, on every rank, never while tracing
        shard_state(gm, plan.mesh)  # under LocalTensorMode: per-rank shards
        cleanup(gm)
        gm.meta["fxshard_mesh"] = dict(axes)
        gm.meta["fxshard_context_parallel"] = {a: {"method": cp.method, "load_balance": cp.load_balance}
                                               for a, cp in plan.context_parallel_axes().items()}
        if plan.fsdp:
            split_blocks(gm, block_rx)
            require_fully_shard(gm, plan.fsdp)
        track_parameters(gm)  # fxshard.clip_grad_norm_ on a list of them; torch's own caught
    return gm


@contextlib.contextmanager
def _only_plan_errors():
    """No exception but PlanError leaves ``transform``: a failure inside a pass is
    reported as one, naming the pass (``propagate`` names the node itself)."""
    try:
        yield
    except PlanError:
        raise
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/passes/" in f.filename or "/fxshard/" in f.filename]
        where = f" in {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        raise PlanError(f"internal error{where}: {type(e).__name__}: {e}\n  fix: this is a bug in fxshard, please "
                        f"report it with this message") from e


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


def _fresh_copy(obj, plan, example_inputs, example_kwargs, capture, dynamic_shapes) -> fx.GraphModule:
    if isinstance(obj, fx.GraphModule):
        gm = _copy_graph_module(obj)
        outline_regions(gm, plan)  # before shapes: MoE routing cannot run on fake tensors
        if example_inputs is not None or example_kwargs:
            record_shapes(gm, flat_inputs(gm, example_inputs or (), example_kwargs))
        elif any("val" not in n.meta for n in gm.graph.nodes if _makes_tensor(n)):
            raise PlanError("this GraphModule has no recorded shapes: pass example_inputs= (the single-device inputs) "
                            "to fxshard.transform, or trace it with fxshard.trace(model, plan, example_inputs)")
        return _guard_meta_calls(gm)
    if isinstance(obj, nn.Module):
        if example_inputs is None and not example_kwargs:
            raise PlanError("transforming an nn.Module needs example_inputs= or example_kwargs= (the single-device inputs)")
        # capture reads the model and never writes it; the copy is of the captured graph
        captured = trace(obj, plan, example_inputs or (), example_kwargs, capture=capture, dynamic_shapes=dynamic_shapes)
        return _guard_meta_calls(_copy_graph_module(captured))
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


_NON_TENSOR_ATTRS = frozenset({"device", "dtype", "layout", "is_cuda", "is_sparse", "is_meta", "is_quantized"})


def _makes_tensor(n: fx.Node) -> bool:
    """Must ``n`` carry a recorded ``val``?  Shape recording (FakeTensorProp) leaves none on
    values without a shape: a tensor's ``.device``/``.dtype`` (``torch.arange(T,
    device=ids.device)``) and a placeholder left at its non-tensor default (``targets=None``)."""
    import builtins

    import torch

    if n.op in ("output", "get_attr"):
        return False
    if n.op == "call_function" and n.target is builtins.getattr and len(n.args) > 1 and n.args[1] in _NON_TENSOR_ATTRS:
        return False
    if n.op == "placeholder" and n.args and not isinstance(n.args[0], torch.Tensor):
        return False  # its default value is used when no example is given for it
    return True


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
    new = fx.GraphModule(holder, graph, gm.meta.get("model_class", gm.__class__.__name__))
    _keep_unreferenced_state(gm, new, memo)
    keep_non_persistent(holder, new)
    keep_codegen(gm, new)
    new.meta.update({k: v for k, v in gm.meta.items() if not k.startswith("fxshard")})
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
