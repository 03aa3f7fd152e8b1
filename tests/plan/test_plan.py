"""Plans as data: presets, printing, equality, pattern matching, and the conversion of
torch.distributed.tensor.parallel plans (Plan.from_torch)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel)

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, rowwise, sequence_parallel, vocab_parallel
from fxshard.testing.models import llama, llama_plan, tokens
from fxshard.meta import program_meta

TP2 = MeshSpec(("tp",), (2,))
IDS = tokens(2, 8, 128)


# ----------------------------------------------------------------------------- presets


def test_colwise_spec():
    spec = colwise()
    assert spec.params == {"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}
    assert spec.inputs == {"tp": Replicate()} and spec.in_src == {"tp": Replicate()}
    assert spec.out_src == {"tp": Shard(-1)} and spec.out_dst == {"tp": Shard(-1)}
    assert "bias" in spec.optional_params  # a Linear without bias still matches
    sp = colwise("mp", inputs=Shard(1), out=Replicate())
    assert sp.params["weight"] == {"mp": Shard(0)} and sp.in_src == {"mp": Shard(1)} and sp.out_dst == {"mp": Replicate()}


def test_rowwise_spec():
    spec = rowwise()
    assert spec.params == {"weight": {"tp": Shard(1)}}  # the bias stays replicated: added once, after the reduction
    assert spec.inputs == {"tp": Shard(-1)} and spec.in_src == {"tp": Shard(-1)}
    assert spec.out_src == {"tp": Partial()} and spec.out_dst == {"tp": Replicate()}
    assert rowwise(out=Shard(1)).out_dst == {"tp": Shard(1)}
    assert rowwise(inputs=Replicate()).in_src == {"tp": Replicate()}


def test_sequence_parallel_and_vocab_parallel_specs():
    assert sequence_parallel() == ModuleSpec(inputs={"tp": Shard(1)}, out_src={"tp": Shard(1)}, style="sequence_parallel")
    assert sequence_parallel("sp", dim=0).inputs == {"sp": Shard(0)}
    spec = vocab_parallel(out=Shard(1))
    assert spec.params == {"weight": {"tp": Shard(0)}}
    assert spec.inputs == {"tp": Replicate()} and spec.out_src == {"tp": Partial()} and spec.out_dst == {"tp": Shard(1)}


def test_presets_on_an_embedding_follow_torch():
    """colwise on an nn.Embedding shards the embedding dim; rowwise is vocab-parallel."""
    for preset, local in ((colwise(out=Replicate()), (128, 32)), (rowwise(), (64, 64))):
        plan = Plan(TP2, {"tok_embeddings": preset})
        sharded = fxshard.transform(llama(), plan, (IDS,))
        assert tuple(sharded.get_parameter("tok_embeddings.weight").shape) == local, preset.style


# ----------------------------------------------------------------------------- printing, equality


def test_repr_names_mesh_patterns_and_layouts():
    plan = Plan(MeshSpec(("dp", "tp"), (2, 4)), {"layers.*.attention.wq": colwise(), "layers.*.attention.wo": rowwise()},
                inputs={"tokens": {"dp": Shard(0)}})
    text = repr(plan)
    assert text.startswith("Plan(mesh(dp=2, tp=4), {")
    for fragment in ("'layers.*.attention.wq': ModuleSpec(style='colwise'", "'weight': {tp: Shard(dim=0)}",
                     "'layers.*.attention.wo': ModuleSpec(style='rowwise'", "out_src={tp: Partial(sum)}",
                     "inputs={'tokens': dp=S(0) tp=R}"):
        assert fragment in text, fragment
    assert repr(colwise()) == repr(colwise()) and repr(colwise()) != repr(rowwise())


def test_equality():
    a = Plan(TP2, llama_plan("tp"))
    assert a == Plan(MeshSpec(("tp",), (2,)), llama_plan("tp"))
    assert a != Plan(MeshSpec(("tp",), (4,)), llama_plan("tp"))  # another mesh
    assert a != Plan(TP2, {**llama_plan("tp"), "layers.*.attention.wo": rowwise(out=Shard(1))})
    assert a != Plan(TP2, llama_plan("tp"), inputs={"tokens": {"tp": Shard(0)}})
    assert colwise() == colwise() and colwise() != colwise(out=Replicate())


# ----------------------------------------------------------------------------- patterns


def test_star_matches_one_name():
    plan = Plan(TP2, {"layers.*.attention.wq": colwise(), "layers.*.feed_forward.w*": colwise()})
    assert plan.match("layers.0.attention.wq")[0] == "layers.*.attention.wq"
    assert plan.match("layers.17.attention.wq")[0] == "layers.*.attention.wq"
    assert plan.match("layers.0.attention.wqkv") is None
    assert plan.match("layers.0.1.attention.wq") is None  # '*' does not cross a '.'
    assert plan.match("layers.attention.wq") is None
    assert plan.match("xlayers.0.attention.wq") is None
    for w in ("w1", "w2", "w3", "w13"):
        assert plan.match(f"layers.0.feed_forward.{w}")[0] == "layers.*.feed_forward.w*"
    assert plan.match("layers.0.feed_forward") is None


def test_overlapping_patterns():
    same = Plan(TP2, {"layers.*.attention.wq": colwise(), "layers.0.attention.wq": colwise()})
    assert same.match("layers.0.attention.wq")[1] == colwise()
    differ = Plan(TP2, {"layers.*.attention.wq": colwise(), "layers.0.attention.*": rowwise()})
    with pytest.raises(PlanError, match="several plan entries"):
        differ.match("layers.0.attention.wq")


# ----------------------------------------------------------------------------- from_torch


def test_from_torch_styles():
    plan = Plan.from_torch(TP2, {
        "a": ColwiseParallel(),
        "b": RowwiseParallel(),
        "c": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "d": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "e": SequenceParallel(),
        "f": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "g": PrepareModuleInput(input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"x": Replicate()}),
    })
    assert plan.specs["a"] == colwise("tp")
    assert plan.specs["b"] == rowwise("tp")
    assert plan.specs["c"] == colwise("tp", inputs=Shard(1), out=Replicate())
    assert plan.specs["d"] == rowwise("tp", inputs=Replicate(), out=Shard(1))
    assert plan.specs["e"] == sequence_parallel("tp", dim=1)
    f = plan.specs["f"]
    assert f.inputs == ({"tp": Replicate()}, None) and f.in_src == ({"tp": Shard(1)}, None)
    g = plan.specs["g"]
    assert g.inputs == {"x": {"tp": Replicate()}} and g.in_src == {"x": {"tp": Shard(1)}}


def test_from_torch_on_a_2d_mesh_needs_an_axis():
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    with pytest.raises(PlanError, match="axis="):
        Plan.from_torch(mesh, {"a": ColwiseParallel()})
    assert Plan.from_torch(mesh, {"a": ColwiseParallel()}, axis="tp").specs["a"] == colwise("tp")


def _torch_llama_plan(sequence_parallel: bool) -> dict:
    """Megatron's Llama plan as torchtitan writes it for parallelize_module."""
    if not sequence_parallel:
        return {**{f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
                "layers.*.attention.wo": RowwiseParallel(),
                **{f"layers.*.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
                "layers.*.feed_forward.w2": RowwiseParallel()}
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        **{f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"layers.*.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sequence_parallel"])
def test_from_torch_plan_gives_the_handwritten_program(sp):
    """The converted torch plan and the handwritten one transform Llama into the same
    code with the same local parameters."""
    model = llama(n_heads=8, n_kv_heads=4)
    ours = fxshard.transform(model, Plan(TP2, llama_plan("tp", sequence_parallel=sp)), (IDS,))
    theirs = fxshard.transform(model, Plan.from_torch(TP2, _torch_llama_plan(sp)), (IDS,))
    assert theirs.code == ours.code
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert program_meta(theirs).state == program_meta(ours).state


def test_a_preset_equals_its_spelled_out_spec():
    """Regression (issue 15 fuzz): a preset and the identical hand-written ModuleSpec on one
    module were "several plan entries with different specs" (they differed in ``style``)."""
    import torch.nn as nn
    from torch.distributed.tensor import Partial, Replicate, Shard

    explicit = fxshard.ModuleSpec(params={"weight": {"tp": Shard(1)}}, inputs={"tp": Shard(-1)}, in_src={"tp": Shard(-1)},
                                  out_src={"tp": Partial()}, out_dst={"tp": Replicate()})
    assert explicit == fxshard.rowwise()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {"0": fxshard.colwise(), "[2]": fxshard.rowwise(), "2": explicit})
    fxshard.transform(model, plan, example_inputs=(torch.randn(2, 8),))
