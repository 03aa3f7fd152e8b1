"""Pipeline parallelism: stages cut from fxshard's graph, run by ``torch.distributed.pipelining``.

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    spec = fxshard.pipeline.pipeline("pp", microbatches=4, schedule="1F1B")
    staged = fxshard.pipeline.pipeline_transform(model, fxshard.Plan.from_hf(mesh["tp"], model), spec, mesh,
                                                 example_kwargs={"input_ids": ids, "labels": labels})
    loss = fxshard.pipeline.train_step(staged, {"input_ids": ids, "labels": labels})

See docs/pipeline.md.
"""
from .spec import PipelineSpec, pipeline
from .stages import LossProgram, StageCut, cut_stages
from .train_step import PipelinedModule, clip_grad_norm_, grad_norm, pipeline_transform, train_step

__all__ = ["PipelineSpec", "pipeline", "StageCut", "LossProgram", "cut_stages", "PipelinedModule", "pipeline_transform",
           "train_step", "grad_norm", "clip_grad_norm_"]
