"""loss_parallel: cross-entropy on vocab-sharded logits, never gathered."""
import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard import MeshSpec, Plan, colwise
from fxshard.meta import KEY, TensorInfo
from fxshard.testing.models import WithLoss, llama, llama_plan, tokens
from harness import plain, rank_map, rank_value, simulated, spawn

V = 128


def _logits_and_targets(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 3
    t = torch.randint(0, V, (n,), generator=g)
    t[0], t[1], t[2] = 0, V - 1, -100  # first/last class and an ignored token
    t[3] = V // 2  # a shard boundary for tp=2 and tp=4
    return x, t


CASES = [dict(reduction=r, label_smoothing=ls) for r in ("mean", "sum", "none") for ls in (0.0, 0.1)]


@pytest.mark.parametrize("tp", [2, 4])
def test_function_matches_cross_entropy_simulated(tp):
    x, t = _logits_and_targets()
    with simulated({"tp": tp}) as mesh:
        fxshard.bind_mesh(mesh)
        for kw in CASES:
            with plain():
                xr = x.clone().requires_grad_()
                ref = F.cross_entropy(xr, t, **kw)
                ref.sum().backward()
            xl = rank_map(lambda r: x.chunk(tp, 1)[r].clone()).requires_grad_()
            loss = fxshard.vocab_parallel_cross_entropy(xl, t, "tp", **kw)
            loss.sum().backward()
            with plain():
                for r in range(tp):
                    torch.testing.assert_close(rank_value(loss, r), ref, atol=1e-5, rtol=1e-5, msg=f"{kw} rank {r}")
                    torch.testing.assert_close(rank_value(xl.grad, r), xr.grad.chunk(tp, 1)[r], atol=1e-6, rtol=1e-5, msg=f"{kw} grad rank {r}")


def test_log_softmax_and_nll_simulated():
    x, t = _logits_and_targets(seed=1)
    with simulated({"tp": 2}) as mesh:
        fxshard.bind_mesh(mesh)
        with plain():
            xr = x.clone().requires_grad_()
            logp = F.log_softmax(xr, -1)
            ref = F.nll_loss(logp, t)
            (ref + (logp * 0.01).sum()).backward()
        xl = rank_map(lambda r: x.chunk(2, 1)[r].clone()).requires_grad_()
        lp = fxshard.vocab_parallel_log_softmax(xl, "tp", -1)
        loss = fxshard.vocab_parallel_nll_loss(lp, t, "tp")
        from fxshard.runtime import collectives as runtime
        (loss + runtime.all_reduce((lp * 0.01).sum(), "tp")).backward()
        with plain():
            for r in range(2):
                torch.testing.assert_close(rank_value(lp, r), logp.detach().chunk(2, 1)[r])
                torch.testing.assert_close(rank_value(loss, r), ref.detach())
                torch.testing.assert_close(rank_value(xl.grad, r), xr.grad.chunk(2, 1)[r], atol=1e-6, rtol=1e-5)


def _real_function_check(rank, world_size):
    from harness import make_mesh

    fxshard.bind_mesh(make_mesh({"tp": world_size}))
    x, t = _logits_and_targets(seed=2)
    for kw in CASES:
        xr = x.clone().requires_grad_()
        ref = F.cross_entropy(xr, t, **kw)
        ref.sum().backward()
        xl = x.chunk(world_size, 1)[rank].clone().requires_grad_()
        loss = fxshard.vocab_parallel_cross_entropy(xl, t, "tp", **kw)
        loss.sum().backward()
        torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xl.grad, xr.grad.chunk(world_size, 1)[rank], atol=1e-6, rtol=1e-5)


def test_function_real_gloo():
    spawn(_real_function_check, 2)


def _lp_plan(mesh):
    return Plan(mesh, {"model." + k: v for k, v in llama_plan(loss_parallel=True).items()})


def test_graph_rewrite_and_no_full_vocab_logits():
    model = WithLoss(llama(n_heads=8, n_kv_heads=4))
    ids, tgt = tokens(2, 8, V), tokens(2, 8, V, seed=3)
    sharded = fxshard.transform(model, _lp_plan(MeshSpec(("tp",), (4,))), (ids, tgt))
    targets = [n.target for n in sharded.graph.nodes]
    assert fxshard.vocab_parallel_cross_entropy in targets and F.cross_entropy not in targets
    head = next(n for n in sharded.graph.nodes if n.op == "get_attr" and n.target == "model.output.weight")
    downstream, frontier = set(), [head]
    while frontier:  # every value computed from the LM head's weight
        n = frontier.pop()
        for u in n.users:
            if u not in downstream:
                downstream.add(u)
                frontier.append(u)
    for n in downstream:
        v = n.meta[KEY].value
        if isinstance(v, TensorInfo):
            assert V not in v.local_shape, f"{n.name} holds a full-vocab tensor {v.local_shape}"


def test_log_softmax_nll_in_graph_is_rewritten():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, V, bias=False)

        def forward(self, x, t):
            return F.nll_loss(F.log_softmax(self.proj(x), dim=-1), t, ignore_index=5)

    torch.manual_seed(0)
    model = Head()
    x, t = torch.randn(6, 16), torch.randint(0, V, (6,))
    t[0] = 5
    ref_model = Head()
    ref_model.load_state_dict(model.state_dict())
    xr = x.clone().requires_grad_()
    ref = ref_model(xr, t)
    ref.backward()
    with simulated({"tp": 2}) as mesh:
        sharded = fxshard.transform(model, Plan(mesh, {"proj": colwise()}), (x, t))
        code = sharded.code
        xs = x.clone().requires_grad_()
        loss = sharded(xs, t)
        loss.backward()
        with plain():
            assert "vocab_parallel_log_softmax" in code and "vocab_parallel_nll_loss" in code
            for r in range(2):
                torch.testing.assert_close(rank_value(loss, r), ref.detach())
                torch.testing.assert_close(rank_value(xs.grad, r), xr.grad, atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(rank_value(sharded.proj.weight.grad, r), ref_model.proj.weight.grad.chunk(2)[r], atol=1e-6, rtol=1e-5)


def test_class_weights_are_rejected():
    class Weighted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, V, bias=False)
            self.register_buffer("w", torch.ones(V))

        def forward(self, x, t):
            return F.cross_entropy(self.proj(x), t, weight=self.w)

    x, t = torch.randn(4, 16), torch.randint(0, V, (4,))
    with pytest.raises(fxshard.PlanError, match="class weights"):
        fxshard.transform(Weighted(), Plan(MeshSpec(("tp",), (2,)), {"proj": colwise()}), (x, t))
