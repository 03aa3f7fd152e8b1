"""fxshard: tensor and expert parallelism as torch.fx graph passes.

Example::

    import fxshard
    from torch.distributed.tensor import Shard
    plan = fxshard.Plan(mesh, {
        "layers.*.attention.wq": fxshard.colwise(),
        "layers.*.attention.wk": fxshard.colwise(),
        "layers.*.attention.wv": fxshard.colwise(),
        "layers.*.attention.wo": fxshard.rowwise(),
    })
    sharded = fxshard.transform(model, plan, example_inputs=(tokens,))
    print(fxshard.dump(sharded))
"""
import torch as _torch

# torch caches the set of factory functions a ``with torch.device(...)`` block redirects
# the first time one runs under it; transformers' ``from_pretrained`` swaps ``torch.linspace``
# for a wrapper while building a model on meta, and a cache filled then leaves every later
# ``torch.linspace`` on the CPU (a meta model with one CPU table: fxshard's meta-device
# planning and ``materialize`` would see mixed devices). Filled here, before any such swap.
with _torch.device("meta"):
    _torch.empty(0)

from fxshard.errors import InternalError, PlacementMismatchError, PlanError, SignatureMismatchError
from fxshard.plan.mesh import MeshSpec
from fxshard.plan.plan import Plan
from fxshard.plan.specs import ContextParallel, ModuleSpec, colwise, context_parallel, distributed_norm, rowwise, sequence_parallel, vocab_parallel
from fxshard.runtime.collectives import (all_gather, all_reduce, all_to_all, bind_mesh, bound_mesh, grad_sync, grad_sync_bucket, local_sizes,
                      local_span, reduce_over, reduce_scatter, shard)
from fxshard.frontend.trace import trace
from fxshard.planner.auto_plan import auto_plan
from fxshard.transform import transform
from fxshard.training.fsdp import fully_shard
from fxshard.training.compile import compile  # noqa: A004 - fxshard.compile: one graph per transformer block
from fxshard.debug.dump import dump
from fxshard.debug.comm_summary import comm_summary
from fxshard.debug.explain import explain
from fxshard.debug.formats import render, to_dot, to_json, to_networkx
from fxshard.runtime.moe import ExpertList, check_compute_signature, ep_combine, ep_dispatch, ep_exchange_counts, expert_parallel, softmax_topk
from fxshard.runtime.routed_experts import routed_experts
from fxshard.runtime.gathered_linears import gathered_linears
from fxshard.runtime.loss import global_mean_cross_entropy, vocab_parallel_cross_entropy, vocab_parallel_log_softmax, vocab_parallel_nll_loss
from fxshard.runtime.context_parallel_ops import context_parallel_mask, gather_sequence, local_positions, ring_attention, split_sequence
from fxshard.state.full_state import full_state_dict, load_full_state_dict
from fxshard.state.materialize import materialize
from fxshard.state.hf_checkpoint import load_hf_checkpoint
from fxshard.state.checkpoint import latest_checkpoint, load, save
from fxshard.training.grad_norm import clip_grad_norm_, grad_norm
from fxshard.training.batch import shard_inputs
from fxshard.training.accumulate import no_sync
from fxshard.training.checkpointing import checkpoint_blocks, checkpointed_blocks
from fxshard.plan.pipeline import pipeline
from fxshard.pipelining.train_step import pipeline_transform, train_step

__all__ = [
    "Plan", "ModuleSpec", "MeshSpec", "auto_plan", "colwise", "rowwise", "sequence_parallel", "vocab_parallel", "distributed_norm",
    "context_parallel", "ContextParallel", "split_sequence", "gather_sequence",
    "trace", "transform", "fully_shard", "compile", "dump", "comm_summary", "explain", "to_json", "to_networkx", "to_dot", "render", "full_state_dict", "load_full_state_dict", "clip_grad_norm_", "grad_norm", "shard_inputs", "no_sync", "checkpoint_blocks", "checkpointed_blocks", "materialize", "load_hf_checkpoint", "save", "load", "latest_checkpoint", "bind_mesh", "bound_mesh", "reduce_over",
    "pipeline", "pipeline_transform", "train_step",
    "PlanError", "PlacementMismatchError", "SignatureMismatchError", "InternalError",
    "expert_parallel", "routed_experts", "softmax_topk", "ExpertList", "check_compute_signature",
    "ep_exchange_counts", "ep_dispatch", "ep_combine",
    "vocab_parallel_cross_entropy", "vocab_parallel_log_softmax", "vocab_parallel_nll_loss", "global_mean_cross_entropy",
    "ring_attention", "context_parallel_mask", "local_positions",
    # runtime collectives called by the generated code
    "all_reduce", "reduce_scatter", "all_gather", "shard", "all_to_all", "grad_sync", "grad_sync_bucket", "gathered_linears",
    "local_sizes", "local_span",  # this rank's part sizes of an uneven fused projection
]

# fxshard.plan_parallelism (fxshard/planner, docs/planning.md) builds the trainer's plans, and the
# trainer imports fxshard: the planner is loaded on first use
__all__ += ["plan_parallelism"]


def __getattr__(name: str):
    if name == "plan_parallelism":
        import importlib

        return importlib.import_module("fxshard.planner").plan_parallelism
    raise AttributeError(f"module 'fxshard' has no attribute {name!r}")
