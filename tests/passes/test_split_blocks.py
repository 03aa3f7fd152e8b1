"""split_blocks: each transformer block becomes a sub-GraphModule called once (for
FSDP2), with the model's FQNs, its buffers and the numbers of the flat graph."""
from __future__ import annotations

import re

import pytest

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard.meta import PassContext
from fxshard import MeshSpec, Plan
from fxshard.passes.split_blocks import block_of, split_blocks
from fxshard.testing.models import gpt2, gpt2_plan, llama, llama_plan, tokens

from harness import rank_value, simulated
from fxshard.meta import program_meta

IDS = tokens(4, 8, 128)


def test_blocks_of_llama_are_module_list_items():
    sharded = fxshard.transform(llama(n_layers=3), Plan(MeshSpec(("dp", "tp"), (2, 2)), llama_plan("tp"),
                                                        inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp"), (IDS,))
    assert program_meta(sharded).fsdp_units == ["layers.0", "layers.1", "layers.2"]
    assert isinstance(sharded.layers, torch.nn.ModuleList) and len(sharded.layers) == 3
    assert all(isinstance(b, torch.fx.GraphModule) and program_meta(b).block == f"layers.{i}"
               for i, b in enumerate(sharded.layers))
    assert type(sharded.layers[0]).__name__ == "TransformerBlock"
    calls = [n.target for n in sharded.graph.nodes if n.op == "call_module"]
    assert calls == ["layers.0", "layers.1", "layers.2"]
    assert set(sharded.state_dict()) == set(llama(n_layers=3).state_dict())
    # dumps and the comm summary see through the blocks
    assert "layers.1.attention.wq" in fxshard.dump(sharded, source=False)
    assert fxshard.comm_summary(sharded, region="layers.2").count("forward", "all_reduce") == 2
    graph = fxshard.to_networkx(sharded)  # one graph across the block calls, as before the split
    import networkx as nx
    assert nx.is_weakly_connected(graph) and "layers.1.attention.wq" in {d["module"] for _, d in graph.nodes(data=True)}


def test_gpt2_blocks_and_a_pattern():
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), gpt2_plan("tp"), inputs={"ids": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(gpt2(), plan, (IDS,))
    assert program_meta(sharded).fsdp_units == ["h.0", "h.1"]
    mlps = fxshard.transform(gpt2(), plan, (IDS,), blocks="h.*.mlp")
    assert program_meta(mlps).fsdp_units == ["h.0.mlp", "h.1.mlp"]


def test_split_keeps_the_numbers_and_non_persistent_buffers():
    model = llama(n_layers=2)
    with simulated({"tp": 2}) as mesh:
        # (buckets spanning blocks cannot be split: transform buckets per block when it splits)
        plan = Plan(mesh, llama_plan("tp", sequence_parallel=True))
        flat = fxshard.transform(model, plan, (IDS,), bucket_cap_mb=None)
        split = fxshard.transform(model, plan, (IDS,), bucket_cap_mb=None)
        split_blocks(split, PassContext.from_plan(plan))
        assert [n.target for n in split.graph.nodes if n.op == "call_module"] == ["layers.0", "layers.1"]
        assert set(split.state_dict()) == set(flat.state_dict())
        assert dict(split.named_buffers()).keys() == dict(flat.named_buffers()).keys()
        want, got = flat(IDS), split(IDS)
        want.sum().backward()
        got.sum().backward()
        for r in range(2):
            torch.testing.assert_close(rank_value(got, r), rank_value(want, r))
        for (name, p), (_, q) in zip(flat.named_parameters(), split.named_parameters()):
            for r in range(2):
                torch.testing.assert_close(rank_value(q.grad, r), rank_value(p.grad, r), msg=lambda m: f"{name}: {m}")


def test_block_of_reads_the_outermost_numbered_module():
    class N:
        meta = {"nn_module_stack": {"a": ("model", "M"), "b": ("model.layers.3", "L"), "c": ("model.layers.3.mlp.experts.1", "E")}}
    assert block_of(N) == "model.layers.3"
    assert block_of(N, re.compile(r"^model\.layers\.\d+\.mlp$")) == ""


def test_torchtitan_blocks_stay_in_a_module_dict():
    pytest.importorskip("torchtitan")
    from fxshard.testing.torchtitan_models import tiny_llama3

    model = tiny_llama3()
    plan = Plan.from_torchtitan(MeshSpec(("dp", "tp"), (2, 2)), model)
    plan = plan.replace(inputs={**plan.inputs, "tokens": {**plan.inputs.get("tokens", {}), "dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, (torch.randint(0, 64, (4, 8)),))
    assert isinstance(sharded.layers, torch.nn.ModuleDict) and list(sharded.layers) == ["0", "1"]
    assert all(isinstance(block, torch.fx.GraphModule) for _, block in sharded.layers.items())  # torchtitan's own loop
