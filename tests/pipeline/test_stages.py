"""The stage cut on one process: stages compose to the program, are dump-able, and bad
pipeline plans are PlanErrors that name the fix (docs/pipeline.md)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.pipelining import PipelinedModule, cut_stages, pipeline, train_step
from fxshard.testing.models import llama, tokens



@contextlib.contextmanager
def _fake_ranks(mesh_shape: dict):
    """Rank 0 of a fake process group (no LocalTensorMode: this rank's coordinate is a plain int)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(mesh_shape.values()))
    try:
        yield init_device_mesh("cpu", tuple(mesh_shape.values()), mesh_dim_names=tuple(mesh_shape))
    finally:
        dist.destroy_process_group()


def _program(n_layers: int = 4):
    model = llama(n_layers=n_layers)
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (1,)), {})
    return model, fxshard.transform(model, plan, example_inputs=(tokens(2, 8, 128, seed=3),))


def _run_stages(cut, *inputs):
    values = inputs
    for st in cut.stages:
        out = st(*values)
        values = out if isinstance(out, tuple) else (out,)
    return values


def test_stages_compose_to_the_program_at_other_sizes_and_dump():
    model, gm = _program()
    cut = cut_stages(gm, pipeline("pp", split=["layers.1", "layers.3"]), 3)
    assert cut.blocks == [["layers.0"], ["layers.1", "layers.2"], ["layers.3"]]
    assert cut.loss is None  # no target input: the last stage returns the logits
    ids = tokens(3, 5, 128, seed=4)  # another batch and sequence length than the example
    (logits,) = _run_stages(cut, ids)
    torch.testing.assert_close(logits, model(ids))
    # each stage holds its blocks' parameters only; the embedding in the first, the head in the last
    names = [set(dict(st.named_parameters())) for st in cut.stages]
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[2]
    assert not any(n.startswith("layers.3.") for n in names[0] | names[1])
    assert not any(n.startswith("layers.0.") for n in names[1] | names[2])
    for st in cut.stages:
        assert "linear" in fxshard.dump(st)
    assert "stage 1: layers.1 .. layers.2" in cut.describe()


def test_balanced_split_by_cost():
    _, gm = _program(n_layers=6)
    cut = cut_stages(gm, pipeline("pp"), 2)
    assert sum(cut.stage_costs) == pytest.approx(1.0)
    # the embedding and the head are counted: neither stage carries over 60% of the cost
    assert max(cut.stage_costs) < 0.6 and [len(b) for b in cut.blocks] in ([3, 3], [4, 2], [2, 4])
    four = cut_stages(gm, pipeline("pp"), 4)
    assert all(four.blocks) and sum(len(b) for b in four.blocks) == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="OneFOneB"), "unknown schedule 'OneFOneB'"),
    (dict(schedule="Interleaved1F1B"), "virtual=2"),
    (dict(schedule="1F1B", virtual=2), "runs one stage per rank"),
    (dict(schedule="ZBVZeroBubble", virtual=3), "exactly 2 stages per rank"),
    (dict(microbatches=0), "positive int"),
    (dict(split="layers.2"), "list of module FQNs"),
])
def test_bad_pipeline_specs_are_plan_errors(kwargs, message):
    with pytest.raises(fxshard.PlanError, match="fix:") as e:
        pipeline("pp", **kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("stages, split, message", [
    (5, None, "only 4 transformer blocks"),
    (2, ["layers.2.attention"], "inside block 'layers.2'"),
    (2, ["layers.2.attention.wq"], "inside block 'layers.2'"),
    (2, ["layers.7"], "no transformer block"),
    (3, ["layers.2"], "3 stages need 2"),
    (3, ["layers.3", "layers.2"], "in model order"),
])
def test_bad_cuts_are_plan_errors(stages, split, message):
    _, gm = _program()
    with pytest.raises(fxshard.PlanError, match="fix:") as e:
        cut_stages(gm, pipeline("pp", split=split), stages)
    assert message in str(e.value)


def test_microbatches_that_do_not_divide_the_batch_are_a_plan_error():
    _, gm = _program()
    cut = cut_stages(gm, pipeline("pp", microbatches=2), 2)
    with _fake_ranks({"pp": 2, "tp": 1}) as mesh:
        staged = PipelinedModule(cut, pipeline("pp", microbatches=2), mesh)
        with pytest.raises(fxshard.PlanError, match="2 micro-batches do not divide the batch of 3"):
            train_step(staged, {"tokens": tokens(3, 8, 128)}, loss_fn=lambda out, t: out.sum(), target=torch.zeros(3))
        with pytest.raises(fxshard.PlanError, match="a pipelined module runs its stages under a schedule"):
            staged(tokens(2, 8, 128))
        assert fxshard.dump(staged).startswith("== stage 0\n")  # this rank's stage
        text = staged.describe()
        assert "holds stage(s) [0]" in text and "stage 1: layers.2 .. layers.3" in text
        assert "bubble in theory (equal stages): 0.333" in text  # (2 - 1) / (2 + 2 - 1)


def test_plan_carries_the_pipeline_on_another_axis():
    spec = fxshard.pipeline("pp", microbatches=4)
    assert spec == pipeline("pp", microbatches=4) and fxshard.pipelining.train_step is fxshard.train_step
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {}, pipeline=spec)
    assert plan.pipeline is spec and plan == plan.replace() and "pipeline=PipelineSpec(axis='pp'" in repr(plan)
    with pytest.raises(fxshard.PlanError, match=r"carries a pipeline \('pp'\).*\n  fix: fxshard.pipeline_transform"):
        fxshard.transform(torch.nn.Linear(4, 4), plan, (torch.randn(2, 4),))
    with pytest.raises(fxshard.PlanError, match=r"the pipeline axis 'pp' is an axis of the plan's mesh.*\n  fix: build the plan"):
        fxshard.Plan(fxshard.MeshSpec(("pp", "tp"), (2, 2)), {}, pipeline=spec)
    with pytest.raises(fxshard.PlanError, match="expected fxshard.pipeline"):
        fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {}, pipeline="pp")


def test_pipeline_transform_refuses_meshes_it_cannot_use():
    model = llama(n_layers=2)
    ids = tokens(2, 8, 128)
    with _fake_ranks({"pp": 2}) as mesh:
        with pytest.raises(fxshard.PlanError, match=r"axis 'stages' is no dim of the mesh"):
            fxshard.pipeline_transform(model, None, mesh, example_inputs=(ids,), spec=pipeline("stages"))
        with pytest.raises(fxshard.PlanError, match="no pipeline spec"):
            fxshard.pipeline_transform(model, None, mesh, example_inputs=(ids,))
        # torch's own requirement (DualPipeV: at least as many micro-batches as its 4 stages), at the transform
        with pytest.raises(fxshard.PlanError, match=r"DualPipeV refuses this pipeline \(4 stages over 2 ranks, 2 "
                                                    r"micro-batches\).*at least as many microbatches as stages"):
            fxshard.pipeline_transform(llama(n_layers=4), None, mesh, example_inputs=(ids,),
                                       spec=pipeline("pp", microbatches=2, schedule="DualPipeV", virtual=2))


def test_a_loss_the_last_stage_cannot_compute_alone_is_a_plan_error():
    from torch.distributed.tensor import Shard

    from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

    model = tiny_model("llama", num_hidden_layers=2)
    ids, labels = tiny_inputs(batch=2, seq=8)
    kw = {"input_ids": ids, "labels": labels}
    spec = pipeline("pp")
    with _fake_ranks({"pp": 2, "tp": 2}) as mesh:
        vocab_sharded = fxshard.Plan.from_hf(mesh["tp"], model, loss_parallel=True).replace(pipeline=spec)
        with pytest.raises(fxshard.PlanError, match=r"laid out tp=S\(\d\), but its target .labels. is tp=R.*\n  fix: a plan whose head output is replicated"):
            fxshard.pipeline_transform(model, vocab_sharded, mesh, example_kwargs=kw)
        sequence_sharded = fxshard.Plan(mesh["tp"], {}, inputs={"labels": {"tp": Shard(1)}}, pipeline=spec)
        with pytest.raises(fxshard.PlanError, match=r"sharded on dim 1 over 'tp'.*\n  fix: shard the batch"):
            fxshard.pipeline_transform(model, sequence_sharded, mesh, example_kwargs=kw)


class _Tail(torch.nn.Module):
    """A block that keeps the last ``-start`` positions (``start`` a negative size made outside
    the blocks, as Kimi-Linear's convolution slices ``[..., -seq_len:]``) and hands the next block
    a transposed (non-contiguous) activation, as Gemma-4 and AFMoE do at a cut."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, start):
        y = self.proj(x.transpose(1, 2))[:, start:]  # x: [batch, 8, seq] -> [batch, seq, 8]
        return y.transpose(1, 2)  # a view: not contiguous


class _TailModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Tail() for _ in range(4))

    def forward(self, x):
        start = -x.size(2)  # negative: a shape cannot carry it as it is
        for layer in self.layers:
            x = layer(x, start)
        return x.sum(1)


def test_a_negative_size_and_a_strided_activation_cross_a_cut():
    model = _TailModel()
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (1,)), {})
    gm = fxshard.transform(model, plan, example_inputs=(torch.randn(2, 8, 6),))
    cut = cut_stages(gm, pipeline("pp", split=["layers.2"]), 2)
    assert any(shape == ("size",) for _, shape, _ in cut.boundaries[0]), cut.describe()  # the negative size crosses
    x = torch.randn(3, 8, 5)  # other sizes than the example's
    sent = cut.stages[0](x)
    # what a c10d send takes: contiguous tensors, sizes as empty tensors of a non-negative shape
    assert all(t.is_contiguous() for t in sent) and all(min(t.shape) >= 0 for t in sent)
    assert (5, 0) in [tuple(t.shape) for t in sent]  # -5 as its magnitude
    torch.testing.assert_close(cut.stages[1](*sent), model(x))


def test_the_stage_torch_runs_infers_shapes_on_zeros():
    """torch's shape inference runs a later stage on tensors it makes from the shapes it receives:
    uninitialized, an index among them (Hunyuan-V4's top-k of an earlier layer) is out of bounds.
    fxshard's stage makes them zeros."""
    from torch.distributed.pipelining._utils import extract_tensor_metas

    _, gm = _program()
    spec = pipeline("pp", microbatches=2)
    cut = cut_stages(gm, spec, 2)
    with _fake_ranks({"pp": 2, "tp": 1}) as mesh:
        staged = PipelinedModule(cut, spec, mesh)
        stage = staged.schedule(lambda out, t: out.sum())._stage
        index = torch.full((2, 8), 2**31 - 1, dtype=torch.int32)
        (meta,) = extract_tensor_metas((index,))
        for _ in range(3):  # allocations that reuse freed memory would show its bytes
            made = stage._to_tensor(meta)
            assert made.dtype == torch.int32 and made.shape == (2, 8) and not made.any()


class _TwoTables(torch.nn.Module):
    """Two tables of one shape computed before the blocks in an order that ``first`` picks, as HF
    code iterating a set of layer types computes its rotary tables in the order of the process's
    string hashing: two ranks' captures of one model differ in their order."""

    def __init__(self, first: str):
        super().__init__()
        self.first = first
        self.register_buffer("sliding", torch.arange(8.0))
        self.register_buffer("full", -torch.arange(8.0) - 1)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        tables = {}
        for kind in (self.first, "full" if self.first == "sliding" else "sliding"):
            tables[kind] = getattr(self, kind) * x.sum(0)  # of the input: it crosses the cut
        for i, layer in enumerate(self.layers):
            x = layer(x) * tables["sliding" if i % 2 else "full"]
        return x


def test_the_values_crossing_a_cut_are_in_one_order_on_ranks_that_traced_in_another():
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (1,)), {})
    x = torch.randn(2, 8)
    cuts = []
    for first in ("sliding", "full"):
        model = _TwoTables(first)
        torch.manual_seed(0)
        for layer in model.layers:
            layer.reset_parameters()
        gm = fxshard.transform(model, plan, example_inputs=(x,))
        cuts.append(cut_stages(gm, pipeline("pp", split=["layers.2"]), 2))
    # rank 0 traced "sliding" first, rank 1 "full" first: what rank 0 sends is what rank 1 reads
    sent = cuts[0].stages[0](x)
    torch.testing.assert_close(cuts[1].stages[1](*sent), model(x))


def test_a_tied_embedding_sharded_over_tp_is_gathered_under_both_names():
    """Gemma-3 and Cohere-2 tie the embedding to the head, which the HF plan shards over the vocabulary:
    the layout is recorded under one name, and the full state dict gathers the tensor under both."""
    from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

    model = tiny_model("llama", num_hidden_layers=2, tie_word_embeddings=True)
    ids, labels = tiny_inputs(batch=2, seq=8)
    with _fake_ranks({"pp": 2, "tp": 2}) as mesh:
        plan = fxshard.Plan.from_hf(mesh["tp"], model).replace(pipeline=pipeline("pp", microbatches=2))
        staged = fxshard.pipeline_transform(model, plan, mesh, example_kwargs={"input_ids": ids, "labels": labels})
        full = fxshard.full_state_dict(staged)  # the fake group's gathers: the shapes, not the values
    want = model.state_dict()
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(full)
    for fqn, t in full.items():
        assert t.shape == want[fqn].shape, (fqn, t.shape, want[fqn].shape)
