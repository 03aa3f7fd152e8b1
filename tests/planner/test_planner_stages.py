"""The planner cuts pipeline stages where ``pipeline_transform`` does, with the same function
(``fxshard.pipelining.stage_costs``), at real sizes: Llama-3.1-405B's config (126 blocks, vocab
128256) on the meta device at pp=8 under FSDP2 (dp=8) splits the blocks evenly, the first and
last stage (the embedding, the head and the loss) at most a block short of the others.
Before, a block FSDP2 split out cost its output alone, and 405B split 1/1/1/1/1/41/79/1."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)

from fxshard.planner import plan_parallelism  # noqa: E402

LLAMA_31_405B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                     max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                     num_key_value_heads=8)


def test_405b_at_pp8_under_fsdp_splits_evenly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_405B))
    (entry,) = plan_parallelism(str(tmp_path), 64, memory_gib=80, seq=8192, global_batch=128, device="h100",
                                candidates=[{"pp": 8, "dp": 8, "microbatches": 8}])
    held = [len(r.blocks) for r in entry.ranks]
    assert sum(held) == 126 and len(held) == 8, held
    mean = 126 / 8
    assert all(abs(n - mean) <= 1 for n in held[1:-1]), held  # the middle stages: blocks alone
    assert all(mean - 2 <= n <= mean + 1 for n in (held[0], held[-1])), held  # the embedding / head and loss
    blocks = [b for r in entry.ranks for b in r.blocks]
    assert blocks == list(range(126))  # contiguous, in order


def test_the_planner_cuts_where_the_trainer_cuts():
    """A head as costly as a few blocks (vocab 4096, hidden 64) makes an uneven cut: the planner's
    (from its captured prefix at its 3 rows, scaled) is the trainer's (the whole program at one
    micro-batch), under FSDP2 whose split-out blocks the old copy costed apart."""
    import torch

    from fxshard.pipelining.stages import cut_stages
    from fxshard.plan.pipeline import pipeline
    from fxshard.plan.plan import Plan
    from fxshard.planner.offline import offline_mesh
    from fxshard.trainer.models import ModelSource
    from fxshard.recipe.parallel_dims import ParallelDims
    from fxshard.trainer.parallelize import ParallelOptions, build_plan
    from fxshard.transform import transform

    seq, batch, microbatches = 16, 8, 2
    source = ModelSource.resolve("llama", {"num_hidden_layers": 8, "vocab_size": 4096})
    source.positions = seq
    model = source.build(meta=False)
    (entry,) = plan_parallelism(model, 4, memory_gib=100, seq=seq, global_batch=batch, device="cpu", dtype="fp32",
                                candidates=[{"pp": 2, "dp": 2, "microbatches": microbatches}])
    predicted = [[f"model.layers.{i}" for i in r.blocks] for r in entry.ranks]
    with offline_mesh({"dp": 2}) as mesh:
        plan, _ = build_plan(model, source, ParallelDims(pp=2, dp=2), mesh, ParallelOptions(microbatches=microbatches))
        ids = torch.randint(0, 4096, (batch // microbatches, seq), generator=torch.Generator().manual_seed(0))
        gm = transform(model, Plan(plan.mesh, plan.specs, inputs=plan.inputs, fsdp=plan.fsdp),
                       example_kwargs={source.input_name: ids}, bucket_cap_mb=None)
        cut = cut_stages(gm, pipeline("pp"), 2, with_loss=False)
    assert predicted == cut.blocks, (predicted, cut.describe())
    assert len(cut.blocks[0]) > len(cut.blocks[1]), cut.describe()  # the head weighs on the last stage
