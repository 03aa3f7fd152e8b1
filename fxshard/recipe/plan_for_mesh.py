"""The plan of each mesh: what the trainer transforms and the planner predicts.

:func:`plan_for_mesh` turns a model and its :class:`~fxshard.recipe.parallel_dims.ParallelDims`
into the plan over the mesh's axes other than pp:

* ``tp`` / ``ep``: the model's own plan (``Plan.from_hf``, ``Plan.from_torchtitan``), under tp
  Megatron's: sequence-parallel norms, residuals and dropout between the tp regions, and a
  loss-parallel head whose logits stay vocab shards (:func:`sharded_logits`);
* ``cp``: every attention module context-parallel, the token input sharded on its sequence
  dim (load-balanced; contiguous when the sequence is gathered before the head: under pp,
  the final norm's output gathered so the last stage scores whole sequences);
* ``dp`` (and ``dp_replicate``): the token input sharded on its batch dim, FSDP2's axes
  (``ParallelDims.fsdp_axes``);
* ``pp``: :func:`pipeline_spec`, the pipeline part of the plan (``--microbatches``,
  ``--schedule``, ``--virtual-stages``).

Example::

    dims = ParallelDims(tp=2, spec="tp=2")
    plan = plan_for_mesh(model, dims, mesh, log=print)
    sharded_logits(plan, model)        # ('tp', 32000): the loss is vocab-parallel
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

import torch
import torch.nn as nn

from fxshard.errors import PlanError
from fxshard.plan.pipeline import PipelineSpec, pipeline
from fxshard.plan.plan import Plan
from fxshard.plan.specs import ModuleSpec, context_parallel, pattern_regex
from fxshard.recipe.parallel_dims import MeshError, ParallelDims


def is_torchtitan(model: nn.Module) -> bool:
    """Whether ``model`` is torchtitan's (its own plan; its token input is ``tokens``).

    Example: ``is_torchtitan(tiny_llama3())`` -> ``True``
    """
    return type(model).__module__.startswith("torchtitan")


def input_name(model: nn.Module) -> str:
    """The keyword of the token input: ``tokens`` for torchtitan's models, ``input_ids`` for HF's.

    Example: ``input_name(hf_model)`` -> ``'input_ids'``
    """
    return "tokens" if is_torchtitan(model) else "input_ids"


def attention_pattern(model: nn.Module) -> str:
    """The FQN pattern of the attention module of every block (``model.layers.*.self_attn``).

    Example: ``attention_pattern(llama)`` -> ``'model.layers.*.self_attn'``
    """
    found = set()
    for name, m in model.named_modules():
        if re.search(r"\.\d+\.[^.]+$", name) and type(m).__name__.endswith("Attention"):
            found.add(re.sub(r"\.\d+\.", ".*.", name))
    if len(found) != 1:
        raise MeshError(f"--mesh cp=...: cannot tell the attention module of each block of {type(model).__name__} "
                        f"(found {sorted(found) or 'none'})", "a model whose blocks hold one '*Attention' module "
                        "(HF decoders do), or no cp axis")
    return found.pop()


def final_norm_name(model: nn.Module) -> str:
    """The norm after the last block (``model.norm``): under pp x cp its output is gathered.

    Example: ``final_norm_name(llama)`` -> ``'model.norm'``
    """
    for name in ("model.norm", "norm", "transformer.ln_f", "model.final_layernorm"):
        try:
            model.get_submodule(name)
            return name
        except AttributeError:
            continue
    raise MeshError(f"--mesh pp=..,cp=..: no final norm found in {type(model).__name__} (model.norm)",
                    "drop pp or cp for this model")


def pipeline_spec(dims: ParallelDims, microbatches: int = 1, schedule: str = "1F1B",
                  virtual_stages: int | None = None) -> PipelineSpec | None:
    """The pipeline part of the plan under pp (``None`` without): ``virtual_stages`` stages
    per rank, by default 2 for a multi-stage schedule (``Interleaved1F1B``), else 1.

    Example: ``pipeline_spec(ParallelDims(pp=2), microbatches=4)`` -> ``PipelineSpec('pp', 4, '1F1B', 1)``
    """
    if dims.pp == 1:
        return None
    virtual = virtual_stages or (2 if multi_stage(schedule) else 1)
    return pipeline("pp", microbatches=microbatches, schedule=schedule, virtual=virtual)


def multi_stage(schedule: str) -> bool:
    """Whether torch's ``schedule`` runs several stages per rank (a MeshError if torch has no such schedule).

    Example: ``multi_stage("Interleaved1F1B")`` -> ``True``
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    try:
        return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)
    except ValueError as e:
        raise MeshError(f"--schedule {schedule}: {e}") from None


def plan_for_mesh(model: nn.Module, dims: ParallelDims, mesh, *, pipeline: PipelineSpec | None = None,
                  gather_sequence_before_head: bool | None = None,
                  log: Callable[[str], None] | None = None) -> Plan | None:
    """The plan over ``mesh``'s axes other than pp (``None`` when there are none), with
    ``pipeline`` (:func:`pipeline_spec`) in it.

    Under tp the plan is Megatron's: the model's own plan with sequence parallelism (norms,
    residuals and dropout on sequence shards between the tp regions: reduce-scatter /
    all-gather where plain TP all-reduces) and loss parallelism (the LM head's logits stay
    vocab-sharded; the loop takes the loss on the shards, :func:`sharded_logits`).  A model
    whose structure sequence parallelism cannot cover falls back to plain TP, said by ``log``.
    ``gather_sequence_before_head``: cp's recipe under pp (contiguous pieces, the final norm's
    output gathered); by default ``dims.gathers_sequence_before_head``.  The planner, which
    plans one stage's program for every pp, names it.

    Example::

        plan = plan_for_mesh(model, ParallelDims(tp=2, cp=2), mesh, gather_sequence_before_head=True)
    """
    plan_axes = dims.plan_axes
    if not plan_axes:
        return None
    gather = dims.gathers_sequence_before_head if gather_sequence_before_head is None else gather_sequence_before_head
    gather = gather and dims.cp > 1
    sub = mesh[tuple(plan_axes)] if len(plan_axes) > 1 else mesh[next(iter(plan_axes))]
    name = type(model).__name__
    if is_torchtitan(model):
        if dims.ep > 1 or dims.cp > 1:
            raise MeshError(f"--mesh {dims.spec or dims.mesh_spec}: {name} is a dense model with torchtitan's TP plan; "
                            f"ep and cp are not offered for it", "dp, tp and pp; or an HF model")
        # torchtitan's own plan: sequence parallel (its default) and its loss-parallel head
        plan = Plan.from_torchtitan(sub, model, loss_parallel=True) if dims.tp > 1 else Plan(sub, {})
    elif dims.tp > 1 or dims.ep > 1:
        if dims.ep > 1 and not getattr(model.config.get_text_config(), "base_model_ep_plan", None):
            raise MeshError(f"--mesh {dims.spec or dims.mesh_spec}: ep shards a mixture of experts' routed experts, and "
                            f"{name} has none (its config has no base_model_ep_plan)",
                            "drop ep, or an MoE model (mixtral, qwen3_moe, ...)")
        plan = _megatron_hf_plan(sub, model, log) if dims.tp > 1 else Plan.from_hf(sub, model)
    else:
        plan = Plan(sub, {})
    specs, inputs = dict(plan.specs), {k: dict(v) for k, v in plan.inputs.items()}
    tokens = input_name(model)
    from torch.distributed.tensor import Replicate, Shard

    if dims.cp > 1:
        pattern = attention_pattern(model)
        if pattern in specs:
            raise MeshError(f"--mesh {dims.spec or dims.mesh_spec}: the model's plan already has an entry for {pattern}; "
                            f"cp would replace it")
        specs[pattern] = context_parallel("cp", load_balance=not gather)
        inputs.setdefault(tokens, {})["cp"] = Shard(1)
        if gather:
            norm = final_norm_name(model)
            key = next((p for p in specs if pattern_regex(p).fullmatch(norm)), norm)
            old = specs.get(key)  # under sequence parallelism: the norm on (cp, tp) sequence shards
            specs[key] = ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()}) if old is None else replace(
                old, out_src={**(old.out_src or {}), "cp": Shard(1)},
                out_dst={**(old.out_dst or old.out_src or {}), "cp": Replicate()})
    for axis in dims.batch_axes:  # the rows over dp_replicate, then within it over dp
        inputs.setdefault(tokens, {})[axis] = Shard(0)
    fsdp = tuple(a for a in dims.fsdp_axes if not (a == "cp" and gather))
    return Plan(sub, specs, inputs=inputs, fsdp=fsdp or None, pipeline=pipeline)


def _megatron_hf_plan(sub, model: nn.Module, log: Callable[[str], None] | None) -> Plan:
    """HF's plan with sequence and loss parallelism; each that this model's structure
    refuses is dropped with a line saying why (plain TP computes the same numbers)."""
    try:
        return Plan.from_hf(sub, model, sequence_parallel=True, loss_parallel=True)
    except PlanError as e:
        first = str(e)
    for sp, lp in ((False, True), (True, False)):
        try:
            plan = Plan.from_hf(sub, model, sequence_parallel=sp, loss_parallel=lp)
        except PlanError:
            continue
        if log is not None:
            log(f"tp: {'loss parallel only' if lp else 'sequence parallel only'} for {type(model).__name__}: "
                f"{first.splitlines()[0]}")
        return plan
    if log is not None:
        log(f"tp: plain tensor parallel (no sequence or loss parallel) for {type(model).__name__}: "
            f"{first.splitlines()[0]}")
    return Plan.from_hf(sub, model)


def sharded_logits(plan: Plan | None, model: nn.Module) -> tuple[str, int] | None:
    """``(axis, vocab size)`` when ``plan`` leaves the logits vocab-sharded (loss parallel:
    a head whose output stays ``Shard(-1)``), else None.  The loop then takes the loss on
    each rank's vocab shard (``token_loss_sum(..., vocab_axis=axis, vocab_size=vocab)``).

    Example: ``sharded_logits(Plan.from_hf(mesh, model, loss_parallel=True), model)`` -> ``('tp', 32000)``
    """
    from torch.distributed.tensor import Shard

    if plan is None:
        return None
    head = getattr(model, "get_output_embeddings", lambda: None)()  # HF; torchtitan's head is `lm_head` / `output`
    head = head if head is not None else getattr(model, "lm_head", None) or getattr(model, "output", None)
    fqn = next((f for f, m in model.named_modules() if m is head), None) if isinstance(head, nn.Module) else None
    if fqn is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return None
    spec = next((s for p, s in plan.specs.items() if pattern_regex(p).fullmatch(fqn)), None)
    out = (spec.out_dst if spec.out_dst is not None else spec.out_src) if spec is not None else None
    axes = [a for a, p in out.items() if isinstance(p, Shard) and p.dim in (-1, 2)] if isinstance(out, dict) else []
    return (axes[0], int(head.weight.shape[0])) if len(axes) == 1 else None
