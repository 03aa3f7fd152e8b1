"""Balanced pipeline stages whatever wraps the blocks (``fxshard.pipelining.stage_costs``).

The trainer's own program for each mesh (``trainer.parallelize.build_plan`` under pp, on an
offline mesh: rank 0 of torch's fake process group) of an 8-block model is cut as
``pipeline_transform`` cuts it: pp=2 holds 4/4 blocks and pp=4 2/2/2/2 under FSDP2 (blocks
split out), tp, cp (the pp recipe: contiguous, the final norm gathered), ep (routed experts
as an opaque region) and activation checkpointing's split blocks; each block costs its own
parameters (read off the model, at global shapes) and the same FLOPs as without the wrapper.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)

from fxshard.pipelining.stage_costs import AFTER, BEFORE, StageCost, balance, balanced_stages, cost_shares, unit_costs  # noqa: E402
from fxshard.pipelining.stages import cut_stages  # noqa: E402
from fxshard.plan.mesh import MeshSpec  # noqa: E402
from fxshard.plan.pipeline import pipeline  # noqa: E402
from fxshard.plan.plan import Plan  # noqa: E402
from fxshard.planner.offline import offline_mesh  # noqa: E402
from fxshard.trainer.models import ModelSource  # noqa: E402
from fxshard.recipe.parallel_dims import AXES, ParallelDims  # noqa: E402
from fxshard.trainer.parallelize import ParallelOptions, build_plan  # noqa: E402
from fxshard.transform import transform  # noqa: E402

BLOCKS = 8


@pytest.fixture(scope="module")
def models():
    out = {}
    for name in ("llama", "qwen3_moe"):
        source = ModelSource.resolve(name, {"num_hidden_layers": BLOCKS})
        out[name] = (source, source.build(meta=False))
    return out


_PROGRAMS: dict = {}


def _trainer_program(source, model, axes: dict, blocks=None):
    """The program the trainer's pipeline path transforms for ``--mesh pp=2,<axes>`` and its
    cuts at pp=2 and 4 (the program is the same for any pp: the cut follows the transform)."""
    key = (source.name, tuple(axes.items()), blocks)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _transform_and_cut(source, model, axes, blocks)
    return _PROGRAMS[key]


def _transform_and_cut(source, model, axes: dict, blocks):
    dims = ParallelDims(pp=2, **axes)
    # pp alone: no plan axis, no mesh (the trainer's plan is None)
    with offline_mesh({a: axes[a] for a in AXES if a in axes}) if axes else contextlib.nullcontext() as mesh:
        plan, _ = build_plan(model, source, dims, mesh, ParallelOptions(microbatches=4))
        # as pipeline_transform: within a stage an ordinary plan (no pipeline), FSDP2's axis kept
        plan = Plan(plan.mesh, plan.specs, inputs=plan.inputs, fsdp=plan.fsdp) if plan is not None else \
            Plan(MeshSpec(("tp",), (1,)), {})
        ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
        # as pipeline_transform: one gradient sync per parameter (a bucket would read several blocks')
        gm = transform(model, plan, example_kwargs={source.input_name: ids}, bucket_cap_mb=None, blocks=blocks)
        cuts = {pp: cut_stages(gm, pipeline("pp"), pp, with_loss=False) for pp in (2, 4)}
    return gm, cuts


CASES = [("llama", {}, None), ("llama", {"dp": 2}, None), ("llama", {"tp": 2}, None), ("llama", {"cp": 2}, None),
         ("llama", {}, "auto"), ("qwen3_moe", {"ep": 2}, None), ("qwen3_moe", {"dp": 2, "ep": 2}, None)]


@pytest.mark.parametrize("name,axes,blocks", CASES,
                         ids=[f"{n} {','.join(f'{a}={k}' for a, k in ax.items()) or 'pp'}{' blocks=auto' if b else ''}"
                              for n, ax, b in CASES])
def test_alike_blocks_split_evenly_whatever_wraps_them(models, name, axes, blocks):
    source, model = models[name]
    gm, cuts = _trainer_program(source, model, axes, blocks)
    assert [len(b) for b in cuts[2].blocks] == [4, 4], cuts[2].describe()
    assert [len(b) for b in cuts[4].blocks] == [2, 2, 2, 2], cuts[4].describe()
    costs = {c.name: c for c in unit_costs(gm)}
    # each block holds its own parameters at their global shapes, however a rank holds them
    params = dict(model.named_parameters())
    for i in range(BLOCKS):
        block = f"model.layers.{i}"
        want = sum(p.numel() * p.element_size() for fqn, p in params.items() if fqn.startswith(block + "."))
        assert costs[block].param_bytes == want, (block, costs[block], want)
    head = sum(params[f].numel() * params[f].element_size() for f in ("lm_head.weight", "model.norm.weight"))
    assert costs[AFTER].param_bytes == head and costs[BEFORE].param_bytes >= params["model.embed_tokens.weight"].numel() * 4


def test_a_block_costs_the_same_split_out_or_not(models):
    """FSDP2's program (each block one call_module node) against the flat one: the blocks'
    FLOPs, parameters and activations are equal (they were the call's output alone)."""
    source, model = models["llama"]
    flat, _ = _trainer_program(source, model, {})
    split, _ = _trainer_program(source, model, {"dp": 2})
    assert any(n.op == "call_module" for n in split.graph.nodes)
    a = {c.name: c for c in unit_costs(flat)}
    b = {c.name: c for c in unit_costs(split)}
    for i in range(BLOCKS):
        assert a[f"model.layers.{i}"] == b[f"model.layers.{i}"]
        assert b[f"model.layers.{i}"].flops > b[AFTER].flops  # the head's linear is one of a block's seven


def test_expert_parallel_experts_cost_their_routed_flops(models):
    """Routed experts as an opaque region (ep) cost what the traced grouped GEMMs of one
    process cost: 2 FLOPs per parameter of the k experts each token goes through."""
    source, model = models["qwen3_moe"]
    whole, _ = _trainer_program(source, model, {})
    ep, _ = _trainer_program(source, model, {"ep": 2})
    assert any(n.op == "call_module" for n in ep.graph.nodes)  # the experts region
    a = {c.name: c for c in unit_costs(whole)}["model.layers.0"]
    b = {c.name: c for c in unit_costs(ep)}["model.layers.0"]
    assert a.param_bytes == b.param_bytes
    assert abs(a.flops - b.flops) <= 0.1 * a.flops, (a, b)


def test_balance_charges_the_embedding_and_the_head_to_the_end_stages():
    assert balance([0.1] + [0.1] * 8 + [0.1], 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert balance([0.0] + [0.125] * 8 + [0.0], 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    # a head as costly as three blocks: the last stage holds fewer blocks
    assert balance([0.0] + [0.1] * 8 + [0.3], 2) == [0, 0, 0, 0, 0, 1, 1, 1]
    costs = [StageCost(BEFORE, 10, 10, 10)] + [StageCost(f"b{i}", 100, 100, 100) for i in range(8)] + [StageCost(AFTER, 10, 10, 10)]
    assert sum(cost_shares(costs)) == pytest.approx(1.0)
    assert balanced_stages(costs, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    # the planner measures at a few rows: FLOPs and activations grow with the rows, parameters do not
    assert StageCost("b", 100, 10, 20).scaled(3) == StageCost("b", 100, 30, 60)
