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
from .spec import PipelineSpec, pipeline
from .stages import LossProgram, StageCut, cut_stages
from .train_step import PipelinedModule, clip_grad_norm_, eval_step, fully_shard, grad_norm, pipeline_transform, train_step

__all__ = ["PipelineSpec", "pipeline", "StageCut", "LossProgram", "cut_stages", "PipelinedModule", "pipeline_transform",
           "train_step", "eval_step", "grad_norm", "clip_grad_norm_", "fully_shard"]
