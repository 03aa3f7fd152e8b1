"""The recipe's plan of each mesh, the one the trainer transforms and the planner predicts:
cp's recipe under pp (contiguous pieces, the final norm's output gathered, FSDP2 not over cp)
named by the planner as an argument, never by a pretended pipeline; the pipeline spec; and the
refusals (a PlanError naming the mesh and the fix).  On torch's fake process group (seconds)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

pytest.importorskip("transformers")

from fxshard.errors import PlanError  # noqa: E402
from fxshard.planner.offline import offline_mesh  # noqa: E402
from fxshard.recipe.parallel_dims import MeshError, ParallelDims  # noqa: E402
from fxshard.recipe.plan_for_mesh import (attention_pattern, final_norm_name, input_name, pipeline_spec,  # noqa: E402
                                          plan_for_mesh)
from fxshard.trainer.models import ModelSource  # noqa: E402

pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)


@pytest.fixture(scope="module")
def llama():
    return ModelSource.resolve("llama", {"num_hidden_layers": 2}).build(meta=False, vocab_size=128)


def test_cp_alone_is_load_balanced_and_fsdp_shards_over_it(llama):
    with offline_mesh({"dp": 2, "cp": 2}) as mesh:
        plan = plan_for_mesh(llama, ParallelDims(dp=2, cp=2), mesh)
    attention = plan.specs[attention_pattern(llama)]
    assert attention.context_parallel.load_balance
    assert plan.inputs["input_ids"] == {"cp": Shard(1), "dp": Shard(0)}
    assert plan.fsdp == ("dp", "cp") and final_norm_name(llama) not in plan.specs and plan.pipeline is None


def test_cp_under_pp_gathers_the_sequence_before_the_head(llama):
    spec = pipeline_spec(ParallelDims(pp=2, dp=2, cp=2), microbatches=2)
    with offline_mesh({"pp": 2, "dp": 2, "cp": 2}) as mesh:
        plan = plan_for_mesh(llama, ParallelDims(pp=2, dp=2, cp=2), mesh, pipeline=spec)
    assert not plan.specs[attention_pattern(llama)].context_parallel.load_balance  # contiguous pieces
    norm = plan.specs[final_norm_name(llama)]
    assert norm.out_src == {"cp": Shard(1)} and norm.out_dst == {"cp": Replicate()}
    assert plan.fsdp == "dp" and plan.pipeline is spec and set(plan.axes) == {"dp", "cp"}


def test_the_planner_names_the_gather_and_gets_the_trainers_stage_plan(llama):
    """What the planner builds for a stage (no pp in its dims, the gather named) is what the
    trainer builds under pp, entry for entry."""
    from fxshard.planner.facts import SubPlan, build_subplan_plan
    from fxshard.planner.model import PlannedModel

    trainer_dims = ParallelDims(pp=2, cp=2, tp=2)
    subplan = SubPlan.of(trainer_dims)
    assert subplan == SubPlan(tp=2, cp=2, cp_gathered=True) and subplan.dims.pp == 1
    with offline_mesh({"pp": 2, "cp": 2, "tp": 2}) as mesh:
        trainer = plan_for_mesh(llama, trainer_dims, mesh)
    with offline_mesh(subplan.axes) as mesh:
        planner = build_subplan_plan(PlannedModel.resolve(llama), subplan, mesh)
        not_gathered = plan_for_mesh(llama, subplan.dims, mesh)
    assert {p: repr(s) for p, s in planner.specs.items()} == {p: repr(s) for p, s in trainer.specs.items()}
    assert planner.inputs == trainer.inputs
    assert not_gathered.specs[attention_pattern(llama)].context_parallel.load_balance  # pp=1: the other recipe
    norm = not_gathered.specs.get(final_norm_name(llama))  # under sequence parallelism: its tp entry only
    assert "cp" not in ((norm.out_dst or {}) if norm is not None else {})


def test_pipeline_spec_and_no_plan_under_pp_alone(llama):
    assert pipeline_spec(ParallelDims(tp=2)) is None
    assert pipeline_spec(ParallelDims(pp=2), microbatches=4, schedule="Interleaved1F1B").virtual == 2
    assert pipeline_spec(ParallelDims(pp=2), microbatches=4, schedule="1F1B").virtual == 1
    with pytest.raises(MeshError, match="--schedule NoSuch"):
        pipeline_spec(ParallelDims(pp=2), schedule="NoSuch")
    with offline_mesh({"pp": 2}) as mesh:
        assert plan_for_mesh(llama, ParallelDims(pp=2), mesh) is None
    assert input_name(llama) == "input_ids"


def test_ep_on_a_dense_model_is_refused_with_the_fix(llama):
    with offline_mesh({"ep": 2}) as mesh:
        with pytest.raises(PlanError, match=r"--mesh ep=2: ep shards a mixture of experts' routed experts.*\n  fix: drop ep"):
            plan_for_mesh(llama, ParallelDims(ep=2), mesh)
    assert torch.is_grad_enabled()
