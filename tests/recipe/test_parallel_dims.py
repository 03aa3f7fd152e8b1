"""``ParallelDims``: ``--mesh`` read into one typed object, its one ``check()`` of what must
divide (the trainer's rules and the planner's reasons), and what its properties say about
a mesh (FSDP2's axes, cp's pieces, HSDP)."""
from __future__ import annotations

import pytest

from fxshard.errors import PlanError
from fxshard.recipe.parallel_dims import AXES, MeshError, ParallelDims


def test_parse_reads_the_axes_in_the_mesh_order():
    dims = ParallelDims.parse("tp=2, dp=2,pp=2", world_size=8)
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (2, 2, 2, 1)
    assert list(dims.sizes) == ["pp", "dp", "tp"] and dims.mesh_spec == "pp=2,dp=2,tp=2"
    assert dims.spec == "tp=2, dp=2,pp=2" and dims == ParallelDims(dp=2, tp=2, pp=2)  # the text is not compared
    assert ParallelDims.parse("", 1).sizes == {} and ParallelDims.parse("", 1).describe() == "one process"
    assert AXES[0] == "pp" and AXES[-1] == "tp"  # the tensor-parallel ranks adjacent


@pytest.mark.parametrize("text,world,says", [
    ("foo=2", 2, "unknown axis 'foo'"),
    ("tp", 2, "is not AXIS=SIZE"),
    ("tp=2,tp=2", 4, "given twice"),
    ("tp=0", 1, "a size is at least 1"),
    ("tp=2", 1, "has 2 ranks, but 1 processes run"),
    ("dp_replicate=2,cp=2", 4, "dp_replicate=2 (HSDP) replicates the parameters"),
])
def test_parse_refuses_with_the_fix(text, world, says):
    with pytest.raises(MeshError, match="--mesh") as e:
        ParallelDims.parse(text, world)
    assert says in str(e.value) and isinstance(e.value, PlanError), str(e.value)


@pytest.mark.parametrize("dims,kw,reason", [
    (ParallelDims(dp=3), dict(world_size=4), "the mesh has 3 ranks, not 4"),
    (ParallelDims(dp=4), dict(batch=6), "dp=4 does not divide the global batch of 6 rows"),
    (ParallelDims(dp=2, dp_replicate=2), dict(batch=6), "dp_replicate x dp = 4 does not divide the global batch of 6 rows"),
    (ParallelDims(dp=2), dict(batch=8, accum=3), "accum=3 passes do not divide each dp rank's 4 rows"),
    (ParallelDims(dp=2, pp=2), dict(batch=8, microbatches=3), "3 micro-batches do not divide each dp rank's 4 rows"),
    (ParallelDims(pp=2), dict(batch=8, accum=2, microbatches=3), "3 micro-batches do not divide each pass's 4 rows"),
    (ParallelDims(tp=3), dict(heads=4), "tp=3 does not divide the 4 attention heads"),
    (ParallelDims(tp=8), dict(heads=4), "tp=8 does not divide the 4 attention heads"),
    (ParallelDims(cp=3), dict(seq=15), "cp=3 does not divide the sequence of 15 tokens into 6 pieces"),
    (ParallelDims(ep=2), dict(experts=0), "ep=2: the model has no routed experts"),
    (ParallelDims(ep=4), dict(experts=6), "ep=4 does not divide the 6 experts"),
    (ParallelDims(pp=2), dict(n_blocks=3, virtual=2), "pp=2 x 2 stages per rank is more than the 3 blocks"),
    (ParallelDims(pp=2), dict(microbatches=3, virtual=2, schedule="Interleaved1F1B"),
     "Interleaved1F1B needs micro-batches a multiple of pp=2"),
    (ParallelDims(pp=4), dict(microbatches=2, schedule="1F1B"),
     "1F1B needs at least as many micro-batches as pp=4 (torch refuses fewer)"),
    (ParallelDims(dp_replicate=2), {}, "dp_replicate=2 (HSDP) replicates the parameters over its ranks"),
])
def test_check_names_the_first_rule_broken(dims, kw, reason):
    with pytest.raises(MeshError) as e:
        dims.check(**kw)
    assert e.value.reason.startswith(reason), e.value.reason
    assert "\n  fix: " in str(e.value)


def test_check_passes_what_divides():
    ParallelDims(dp=2, pp=2, tp=2, cp=2).check(world_size=16, batch=8, accum=2, microbatches=2, schedule="1F1B",
                                               seq=16, heads=4, n_blocks=4)
    ParallelDims(cp=3, pp=2).check(seq=15)  # contiguous under pp: 3 pieces (6 would not divide 15)
    ParallelDims(pp=4).check(microbatches=2, schedule="GPipe")  # GPipe takes fewer
    ParallelDims(ep=2).check(experts=4)
    ParallelDims(ep=2).check()  # experts not given: not checked


def test_fsdp_and_cp_follow_the_pipeline():
    alone, under_pp = ParallelDims(dp=2, cp=2), ParallelDims(dp=2, cp=2, pp=2)
    assert alone.fsdp_axes == ("dp", "cp") and alone.fsdp_shard_ranks == 4
    assert alone.load_balanced_cp and not alone.gathers_sequence_before_head and alone.sequence_pieces == 4
    assert under_pp.fsdp_axes == ("dp",) and under_pp.fsdp_shard_ranks == 2
    assert under_pp.gathers_sequence_before_head and not under_pp.load_balanced_cp and under_pp.sequence_pieces == 2
    hsdp = ParallelDims.parse("dp_replicate=2,dp=2,cp=2", 8)
    assert hsdp.batch_ranks == 4 and hsdp.batch_axes == ["dp"] and hsdp.plan_axes == {"dp": 4, "cp": 2}
    assert hsdp.hsdp == {"dp": ("dp_replicate", "dp_shard")} and ParallelDims(dp=2).hsdp is None
    assert ParallelDims(pp=2, tp=2).plan_axes == {"tp": 2} and ParallelDims(pp=2).plan_axes == {}
