"""Pipeline parallelism: stages cut from fxshard's graph, run by ``torch.distributed.pipelining``.

This package is also the function :func:`pipeline` (``fxshard.pipeline("pp", microbatches=4)``
makes the spec; ``fxshard.pipelining.train_step`` etc. are its other names).

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    plan = fxshard.Plan.from_hf(mesh["tp"], model).replace(pipeline=fxshard.pipeline("pp", microbatches=4))
    staged = fxshard.pipeline_transform(model, plan, mesh, example_kwargs={"input_ids": ids, "labels": labels})
    loss = fxshard.train_step(staged, {"input_ids": ids, "labels": labels})

See docs/pipeline.md.
"""
from fxshard.plan.pipeline import PipelineSpec, pipeline
from .stages import LossProgram, StageCut, cut_stages
from fxshard.training.fsdp import fully_shard  # the same functions as fxshard.fully_shard etc.: they take a PipelinedModule
from fxshard.training.grad_norm import clip_grad_norm_, grad_norm
from .train_step import PipelinedModule, eval_step, pipeline_transform, train_step

__all__ = ["PipelineSpec", "pipeline", "StageCut", "LossProgram", "cut_stages", "PipelinedModule", "pipeline_transform",
           "train_step", "eval_step", "grad_norm", "clip_grad_norm_", "fully_shard"]
