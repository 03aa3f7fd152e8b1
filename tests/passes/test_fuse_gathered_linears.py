"""fuse_gathered_linears: column-parallel linears on a sequence-parallel gather keep the shard
(Megatron's way), with the numbers of the unfused program, on real gloo ranks too."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan
from fxshard.runtime import collectives
from fxshard.testing.models import WithLoss, llama, llama_plan, tokens
from torch.distributed.tensor import Replicate, Shard

from equivalence import check_real
from harness import spawn

V = 128


def _sp_plan(mesh):
    return Plan(mesh, {"model." + k: v for k, v in llama_plan(sequence_parallel=True, loss_parallel=True).items()})


def _model():
    return WithLoss(llama(n_heads=8, n_kv_heads=4))


def _targets(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_the_block_linears_and_the_head_read_shards():
    """q|k|v and w1|w3 of each block become one call each; no gather in a block is left that
    a linear reads, and the attention's ``bsz, seqlen, _ = x.shape`` reads its outputs' sizes.
    The head's input (outside the blocks) is gathered as before."""
    ids, tgt = tokens(2, 8, V), tokens(2, 8, V, seed=1)
    gm = fxshard.transform(_model(), _sp_plan(MeshSpec(("tp",), (2,))), (ids, tgt))
    calls = _targets(gm, fxshard.gathered_linears)
    assert [len(c.args[3]) for c in calls] == [3, 2, 3, 2], [c.args[3] for c in calls]
    (head,) = _targets(gm, collectives.all_gather)
    assert [u.args[1].target for u in head.users] == ["model.output.weight"], gm.code
    assert "wq = gathered_linears[0]" in gm.code and "w3 = gathered_linears_1[1]" in gm.code, gm.code
    rows = fxshard.comm_summary(gm).select(region="model.layers.0.attention")
    assert [(r.phase, r.kind, r.shape) for r in rows if r.op == "gathered_linears"] == [
        ("forward", "all_gather", (2, 8, 64)), ("backward", "all_gather", (2, 8, 64)),
        ("backward", "reduce_scatter", (2, 8, 64))]


class _GatherReadTwice(nn.Module):
    """A column-parallel ``up`` and a ``matmul`` with a column-sharded weight, both reading the
    gathered input: the gather has a reader other than a linear, so it stays (its gradient,
    a share from both, is still reduce-scattered)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.block = _Up()

    def forward(self, x):
        return self.block(self.norm(x))


class _Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16, bias=False)
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return self.up(x) + x @ self.w


def _twice_plan(mesh):
    block = ModuleSpec(params={"w": {"tp": Shard(1)}}, inputs=({"tp": Replicate()},), out_dst={"tp": Replicate()})
    return Plan(mesh, {"block": block, "block.up": fxshard.colwise("tp")}, inputs={"x": {"tp": Shard(1)}})


def test_a_gather_with_another_reader_stays():
    x = torch.randn(2, 8, 16)
    gm = fxshard.transform(_GatherReadTwice(), _twice_plan(MeshSpec(("tp",), (2,))), (x,))
    assert not _targets(gm, fxshard.gathered_linears)
    entry, _ = _targets(gm, collectives.all_gather)  # the block's input, and its output (on the hidden dim)
    assert entry.kwargs.get("grad") == "partial" and len(entry.users) == 2, gm.code


def _saved_bytes(fn, params) -> int:
    """Bytes of the storages autograd keeps while ``fn`` runs, ``params`` excluded (alive anyway)."""
    storages, kept = {}, {p.untyped_storage()._cdata for p in params}

    def pack(t):
        if t.untyped_storage()._cdata not in kept:
            storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def _function_against_unfused(rank, world_size):
    """The op against ``all_gather`` + ``F.linear``: outputs and every gradient, in fp32 and
    under bf16 autocast (casts as ``F.linear``'s), biases and a frozen weight included; and
    what each keeps for the backward."""
    from harness import make_mesh

    fxshard.bind_mesh(make_mesh({"tp": world_size}))
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(2, 8, 16, generator=g)
    ws = [torch.randn(6, 16, generator=g) for _ in range(3)]
    bs = [torch.randn(6, generator=g), None, torch.randn(6, generator=g)]
    grads_out = [torch.randn(2, 8, 6, generator=g) for _ in range(3)]
    for autocast in (False, True):
        results = []
        for fused in (False, True):
            x = x_full.chunk(world_size, 1)[rank].clone().requires_grad_()
            w = [t.clone().requires_grad_(i != 1) for i, t in enumerate(ws)]  # the second weight frozen
            b = [t.clone().requires_grad_() if t is not None else None for t in bs]

            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    if fused:
                        return fxshard.gathered_linears(x, "tp", 1, w, b)
                    full = fxshard.all_gather(x, "tp", 1, grad="partial")
                    return tuple(F.linear(full, wi, bi) for wi, bi in zip(w, b))

            outs = []
            saved = _saved_bytes(lambda: outs.extend(run()), w + [t for t in b if t is not None])
            torch.autograd.backward(outs, [go.to(o.dtype) for go, o in zip(grads_out, outs)])
            results.append((outs, x.grad, [t.grad for t in w], [t.grad if t is not None else None for t in b], saved))
        (o0, gx0, gw0, gb0, saved0), (o1, gx1, gw1, gb1, saved1) = results
        for a, c in zip(o0, o1):
            assert a.dtype == c.dtype == (torch.bfloat16 if autocast else torch.float32)
            torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)  # three shares summed in another order
        assert gw1[1] is None and gw0[1] is None
        for a, c in zip(gw0 + gb0, gw1 + gb1):
            if a is not None:
                assert a.dtype == c.dtype == torch.float32
                torch.testing.assert_close(c, a, rtol=0, atol=0)
        whole = x_full.numel() * (2 if autocast else 4)
        assert saved0 - saved1 >= whole - whole // world_size, (saved0, saved1)  # the shard, not the whole


def test_function_real_gloo():
    spawn(_function_against_unfused, 2)


def _loss(out):
    return out


def _targets_with_padding():
    t = tokens(2, 8, V, seed=1)
    t[1, 5:] = -100  # padding: labels are never the inputs, and some are ignored
    return t


def test_llama_sequence_parallel_real_gloo():
    """The program with the fused calls against one device on 2 gloo ranks: the loss, every
    gradient, and the parameters after 3 SGD steps."""
    check_real(2, _model, _sp_plan, (tokens(2, 8, V), _targets_with_padding()), {"tp": 2}, loss_fn=_loss,
               replicated_loss=True, steps=3)
