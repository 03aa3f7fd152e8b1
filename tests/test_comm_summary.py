"""fxshard.comm_summary: the static list of collectives equals what a step really runs.

The reference is measured, not derived: a TorchDispatchMode records every
``torch.ops._c10d_functional`` call (what NCCL/gloo would be asked to do) during the
forward and, separately, during the backward of the sharded program under simulated
ranks; each call's kind, mesh axis (from its process-group name) and byte size must
match the summary's rows one for one.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from fxshard import MeshSpec, Plan, colwise, rowwise
from fxshard.debug.comm_summary import comm_summary
from fxshard.testing.models import WithLoss, gpt2, gpt2_plan, llama, llama_plan, mlp, tokens

try:
    from harness import make_mesh, plain, simulated, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, plain, simulated, spawn

_KIND = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


class _CollectiveLog(TorchDispatchMode):
    """Records (kind, group name, bytes of the larger buffer) of every functional collective."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in _KIND:
            x = args[0]
            nbytes = x.numel() * x.element_size()
            if name == "all_gather_into_tensor":
                nbytes *= args[1]  # group size: the gathered output
            self.calls.append((_KIND[name], args[-1], nbytes))
        return func(*args, **kwargs)


def _measure(sharded, inputs, mesh) -> dict[str, Counter]:
    axis_of = {mesh.get_group(a).group_name: a for a in mesh.mesh_dim_names}
    measured = {}
    with _CollectiveLog() as fwd:
        out = sharded(*inputs)
    with _CollectiveLog() as bwd:
        out.float().pow(2).sum().backward()
    for phase, log in (("forward", fwd), ("backward", bwd)):
        measured[phase] = Counter((kind, axis_of[group], nbytes) for kind, group, nbytes in log.calls)
    return measured


def _static(summary) -> dict[str, Counter]:
    return {phase: Counter((r.kind, r.axis, r.bytes) for r in summary.select(phase)) for phase in ("forward", "backward")}


# ----------------------------------------------------------------------------- cases
# name -> (mesh shape, model factory, plan factory(mesh), global inputs, local inputs(global), inputs_require_grad)
# Add a model family by adding a row; the check is the same for all.

def _llama():
    return llama(n_heads=8, n_kv_heads=4)


def _mlp():
    return mlp(dim=8, hidden=16)


def _gpt2_loss():
    return WithLoss(gpt2())


def _prefixed(plan, prefix="model."):
    return {prefix + k: v for k, v in plan.items()}


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _ids(seed=0):
    return tokens(2, 8, 128, seed=seed)


class _TopkGate(torch.nn.Module):
    """A sharded score that only picks indices (a router's top-k): no gradient comes
    back through it, so its input's gradient sync never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.gate = torch.nn.Linear(8, 16)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = x * self.scale
        idx = self.gate(h).topk(2, dim=-1).indices % 8
        return self.proj(h).gather(-1, idx)


CASES = {
    "llama_tp2": ({"tp": 2}, _llama, lambda mesh: Plan(mesh, llama_plan("tp")), lambda: (_ids(),), None, False),
    "llama_tp4": ({"tp": 4}, _llama, lambda mesh: Plan(mesh, llama_plan("tp")), lambda: (_ids(),), None, False),
    "llama_dp2_tp2": ({"dp": 2, "tp": 2}, _llama,
                      lambda mesh: Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}}),
                      lambda: (_ids(),), lambda ids: (ids[:1],), False),
    # all_gather(grad="partial") on entry, reduce-scatter on exit (sequence-parallel MLP)
    "mlp_seq": ({"tp": 2}, _mlp,
                lambda mesh: Plan(mesh, {"fc1": colwise(inputs=Shard(0)), "fc2": rowwise(out=Shard(0))},
                                  inputs={"x": {"tp": Shard(0)}}),
                lambda: (_x(),), lambda x: (x[:2].requires_grad_(),), True),
    "mlp_seq_data_input": ({"tp": 2}, _mlp,
                           lambda mesh: Plan(mesh, {"fc1": colwise(inputs=Shard(0)), "fc2": rowwise(out=Shard(0))},
                                             inputs={"x": {"tp": Shard(0)}}),
                           lambda: (_x(),), lambda x: (x[:2],), False),
    # all_gather (grad replicate: no backward comm) then shard (backward all-gather)
    "mlp_gather_shard": ({"tp": 2}, _mlp,
                         lambda mesh: Plan(mesh, {"fc1": colwise(out=Replicate()), "fc2": rowwise(inputs=Replicate())}),
                         lambda: (_x(),), None, False),
    "mlp_all_to_all": ({"tp": 2}, _mlp,
                       lambda mesh: Plan(mesh, {"fc1": colwise(out=Shard(0)), "fc2": rowwise(inputs=Shard(0))}),
                       lambda: (_x(),), None, False),
    "topk_gate": ({"tp": 2}, _TopkGate, lambda mesh: Plan(mesh, {"gate": colwise(out=Replicate())}),
                  lambda: (_x(),), None, False),
    # sequence parallel + vocab-parallel embedding + loss parallel (communication inside the loss)
    "gpt2_sp_loss_parallel": ({"tp": 2}, _gpt2_loss,
                              lambda mesh: Plan(mesh, _prefixed(gpt2_plan("tp", sequence_parallel=True, loss_parallel=True))),
                              lambda: (_ids(), _ids(1)), None, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_summary_matches_measured_collectives(name):
    mesh_shape, make_model, make_plan, make_inputs, local, inputs_grad = CASES[name]
    with simulated(mesh_shape) as mesh:
        with plain():
            model, inputs = make_model(), make_inputs()
            local_inputs = local(*inputs) if local else inputs
        sharded = fxshard.transform(model, make_plan(mesh), inputs)
        summary = comm_summary(sharded, inputs_require_grad=inputs_grad)
        measured = _measure(sharded, local_inputs, mesh)
    static = _static(summary)
    assert sum(static["forward"].values()) > 0
    for phase in ("forward", "backward"):
        assert static[phase] == measured[phase], f"{phase}: summary {static[phase]} != measured {measured[phase]}\n{summary}"


def test_llama_counts_per_layer():
    """Megatron: 2 all-reduces forward (o, w2) and 2 backward (the grad syncs before q/k/v
    and w1/w3) per layer, each of one activation [batch, seq, dim]."""
    n_layers, dim = 3, 64
    model = llama(n_heads=8, n_kv_heads=4, n_layers=n_layers, dim=dim)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (_ids(),))
    s = comm_summary(sharded)
    act = 2 * 8 * dim * 4
    assert s.count("forward") == s.count("forward", "all_reduce", axis="tp") == 2 * n_layers
    assert s.count("backward") == s.count("backward", "all_reduce", axis="tp") == 2 * n_layers
    assert s.nbytes("forward") == s.nbytes("backward") == 2 * n_layers * act
    assert [r.op for r in s.forward] == ["all_reduce"] * 2 * n_layers
    assert [r.op for r in s.backward] == ["grad_sync"] * 2 * n_layers
    # backward rows run in reverse graph order
    assert [r.region for r in s.backward][:2] == [f"layers.{n_layers - 1}.feed_forward.w1", f"layers.{n_layers - 1}.attention.wq"]
    assert s.count(region="layers.1") == 4 and s.count(region="layers.*.attention") == 2 * n_layers
    assert {t.kind for t in s.totals} == {"all_reduce"}
    per_region = s.by_region()
    assert per_region["layers.0.attention.wo"][0].count == 1
    assert s.forward[0].c10d_op == "all_reduce" and s.forward[0].wire_bytes == act  # 2 (n-1)/n = 1 at n = 2
    text = str(s)
    assert "fxshard comm summary  mesh: tp=2" in text and "totals" in text
    assert f"forward 6 ({act * 6 / 1024:.1f} KiB)" in text.splitlines()[0]
    with pytest.raises(ValueError, match="phase must be one of"):
        s.count("fwd")


def test_axis_of_size_one_and_no_comm():
    model = llama(n_heads=8, n_kv_heads=4, n_layers=1)
    one = fxshard.transform(model, Plan(MeshSpec(("tp",), (1,)), llama_plan("tp")), (_ids(),))
    s = comm_summary(one)
    assert s.rows == [] and "(no communication)" in str(s)
    plain_graph = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), {}), (_ids(),))
    assert comm_summary(plain_graph).rows == []


def test_dump_header_totals():
    model = llama(n_heads=8, n_kv_heads=4, n_layers=2)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (_ids(),))
    header = fxshard.dump(sharded, region="layers.0").splitlines()[:2]
    assert header[1] == "communication per step: forward 4 (16.0 KiB)  backward 4 (16.0 KiB)"


def _moe_ranks(rank: int, world_size: int) -> None:
    from fxshard.testing.moe_models import moe_plan, moe_transformer

    mesh = make_mesh({"ep": world_size})
    model = moe_transformer(seed=0)
    x = torch.randn(4, 8, model.args.dim, generator=torch.Generator().manual_seed(0))
    sharded = fxshard.transform(model, Plan(mesh, moe_plan("ep"), inputs={"x": {"ep": Shard(0)}}), (x,))
    summary = comm_summary(sharded)
    measured = _measure(sharded, (x.chunk(world_size)[rank],), mesh)
    for phase in ("forward", "backward"):
        rows = summary.select(phase)
        counts = Counter((r.kind, r.axis) for r in rows)
        assert counts == Counter((k, a) for (k, a, _), n in measured[phase].items() for _ in range(n)), (phase, counts, measured[phase])
        exact = Counter((r.kind, r.axis, r.bytes) for r in rows if r.exact)
        assert not exact - measured[phase], (phase, exact, measured[phase])
    assert summary.count("forward", "all_to_all", region="layers.0.moe") == 3  # counts, dispatch, combine
    assert summary.count("backward", "all_to_all", region="layers.0.moe") == 2  # combine and dispatch back


def test_moe_region_collectives_real_ranks():
    """Expert parallelism runs only on real ranks: the all-to-alls inside the MoE regions
    (sub-GraphModules) are listed where the region is called, the exact ones with their bytes."""
    spawn(_moe_ranks, 2)
