"""fxshard.compile: one compiled graph per transformer block, shared by identical blocks.

On real gloo ranks (one spawn): tensor parallelism with ``blocks="auto"`` and FSDP2 over
dp (compiled after ``fxshard.fully_shard``, and before), each compiled with a backend that records
the graphs dynamo hands it: one graph for all the identical blocks, no graph break, and
the eager program's outputs and parameter gradients, also after an SGD step; fxshard's
own gradient buckets over dp with ``no_sync`` accumulation, compiled; checkpointed blocks
compiled (their backward recomputes the forward's collectives); this rank's pipeline
stage's blocks compiled under a 1F1B schedule.  Without
blocks split out, ``fxshard.compile`` is a PlanError with the fix."""
import contextlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import fxshard
from fxshard.testing.models import llama, llama_plan, tokens
from fxshard.training.compile import compiled_blocks
from harness import make_mesh, spawn
from fxshard.meta import program_meta

TOL = dict(rtol=1e-5, atol=1e-5)


class _Recorder:
    """A torch.compile backend (``aot_eager``'s) recording every graph dynamo compiles and
    the forward and backward graphs AOTAutograd makes of it."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.graphs, self.forward, self.backward = [], [], []

        def keep(into):
            return lambda gm, example_inputs: (into.append(gm), make_boxed_func(gm.forward))[1]

        self._aot = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self._aot(gm, example_inputs)


def _c10d_ops(gms) -> Counter:
    return Counter(str(n.target).split(".")[1] for gm in gms for n in gm.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("_c10d_functional."))


def _steps(program, ids, tgt, steps: int = 2, accum: int = 1):
    """Outputs and parameter gradients of ``steps`` SGD steps, each of ``accum`` micro-batches
    (all but the last under ``fxshard.no_sync``)."""
    opt = torch.optim.SGD(program.parameters(), lr=0.1)
    record = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        outs = []
        for k, (i, t) in enumerate(zip(ids.chunk(accum), tgt.chunk(accum))):
            with fxshard.no_sync(program) if k < accum - 1 else contextlib.nullcontext():
                out = program(i)
                (F.cross_entropy(out.flatten(0, 1).float(), t.flatten()) / accum).backward()
            outs.append(out.detach())
        record.append((torch.cat(outs), {n: p.grad.detach().clone() for n, p in program.named_parameters()}))
        opt.step()
    return record


def _check_same(got, want, what: str) -> None:
    for step, ((out, grads), (want_out, want_grads)) in enumerate(zip(got, want)):
        torch.testing.assert_close(out, want_out, **TOL, msg=lambda m: f"{what}, step {step}, output: {m}")
        for name, g in want_grads.items():
            g_got = grads[name]
            g_got, g = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (g_got, g))
            torch.testing.assert_close(g_got, g, **TOL, msg=lambda m: f"{what}, step {step}, {name}: {m}")


def _compiled_vs_eager(make, ids, tgt, what: str, n_blocks: int, then=lambda program: program, accum: int = 1):
    """``make()`` eager and ``then(fxshard.compile(make()))`` compiled, the same steps."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = then(make())
    recorder = _Recorder()
    compiled = then(fxshard.compile(make(), backend=recorder))
    assert len(set(compiled_blocks(compiled).values())) == 1, compiled_blocks(compiled)
    assert len(compiled_blocks(compiled)) == n_blocks
    _check_same(_steps(compiled, ids, tgt, accum=accum), _steps(eager, ids, tgt, accum=accum), what)
    # one graph for every block (dynamo reuses it: the blocks share one class), no break inside
    assert len(recorder.graphs) == 1, (what, [len(g.graph.nodes) for g in recorder.graphs])
    assert sum(counters["graph_break"].values()) == 0, (what, dict(counters["graph_break"]))
    return _c10d_ops(recorder.forward), _c10d_ops(recorder.backward)


def _check(rank: int, world_size: int) -> None:
    ids, tgt = tokens(4, 8, 128, seed=1), tokens(4, 8, 128, seed=2)
    _pipelined_compiled_vs_eager(ids, tgt)
    model = llama(n_layers=4, rope="real")

    mesh = make_mesh({"tp": 2})
    plan = fxshard.Plan(mesh, llama_plan("tp", sequence_parallel=True))
    forward, backward = _compiled_vs_eager(lambda: fxshard.transform(model, plan, (ids,), blocks="auto"), ids, tgt,
                                           "tp=2 sequence parallel", 4)
    # fxshard's collectives inside the block's graphs: Megatron-SP's 2 all-gathers and 2 reduce-scatters
    # each way, the column-parallel linears' inputs gathered again in the backward (their shards are
    # what the forward keeps), and the norms' bucket (kept within the block) all-reduced, each waited on
    assert forward == Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2, wait_tensor=4), forward
    assert backward == Counter(all_gather_into_tensor=4, reduce_scatter_tensor=2, all_reduce=1, wait_tensor=7), backward
    # checkpointed blocks: the compiled graph holds the checkpoint, its backward recomputes the forward's collectives
    # (2 all-gathers, and 1 reduce-scatter: the block output's is not needed again)
    forward, backward = _compiled_vs_eager(
        lambda: fxshard.checkpoint_blocks(fxshard.transform(model, plan, (ids,), blocks="auto")), ids, tgt,
        "tp=2 sequence parallel, checkpointed", 4)
    assert forward == Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2, wait_tensor=4), forward
    # (and the linears' inputs gathered again for their weights' gradients, as without checkpointing)
    assert backward == Counter(all_gather_into_tensor=6, reduce_scatter_tensor=3, all_reduce=1, wait_tensor=10), backward

    dp_mesh = make_mesh({"dp": 2})
    # fxshard's own syncs over dp, accumulated under no_sync: held back in the eager program; in the
    # compiled blocks every backward syncs (one graph, no recompile), the same gradients
    dp_plan = fxshard.Plan(dp_mesh, {}, inputs={"tokens": {"dp": Shard(0)}})
    mine = slice(2 * rank, 2 * rank + 2)
    with pytest.warns(UserWarning, match="inside compiled blocks run in every backward"):
        _compiled_vs_eager(lambda: fxshard.transform(model, dp_plan, (ids,), blocks="auto"), ids[mine], tgt[mine],
                           "dp buckets, no_sync accumulation", 4, accum=2)
    fsdp_plan = fxshard.Plan(dp_mesh, {}, inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    _compiled_vs_eager(lambda: fxshard.fully_shard(fxshard.transform(model, fsdp_plan, (ids,)), dp_mesh),
                       ids[mine], tgt[mine], "FSDP2 over dp, then compiled", 4)
    _compiled_vs_eager(lambda: fxshard.transform(model, fsdp_plan, (ids,)), ids[mine], tgt[mine],
                       "compiled, then FSDP2 over dp", 4, then=lambda program: fxshard.fully_shard(program, dp_mesh))


def _pipelined_compiled_vs_eager(ids, tgt) -> None:
    """pp=2, 1F1B: this rank's stage's blocks checkpointed and compiled (one graph), 2 SGD
    steps through ``fxshard.train_step`` equal to the eager (checkpointed) stages'."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mesh = make_mesh({"pp": 2})
    model = llama(n_layers=4, rope="real")
    spec = fxshard.pipeline("pp", microbatches=2)

    def run(compile_blocks: bool):
        staged = fxshard.pipeline_transform(model, None, mesh, example_inputs=(ids[:2],), spec=spec, blocks="auto")
        fxshard.checkpoint_blocks(staged)  # and activation checkpointing, inside the compiled graph
        if compile_blocks:
            recorder = _Recorder()
            fxshard.compile(staged, backend=recorder)
            assert set(compiled_blocks(staged).values()) == {0} and len(compiled_blocks(staged)) >= 1
        opt = torch.optim.SGD(staged.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            losses.append(fxshard.train_step(staged, {"tokens": ids}, target=tgt,
                                             loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())))
            opt.step()
        if compile_blocks:
            assert len(recorder.graphs) == 1 and sum(counters["graph_break"].values()) == 0
        return losses, dict(staged.named_parameters())

    (got_losses, got), (want_losses, want) = run(True), run(False)
    torch.testing.assert_close(torch.stack(got_losses), torch.stack(want_losses), **TOL)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, **TOL, msg=lambda m: f"pp=2 compiled, {name}: {m}")


def test_blocks_split_without_fsdp_keep_their_buckets_and_refusals():
    """``blocks="auto"`` splits the blocks without FSDP2, each with its own gradient-sync
    bucket; a pattern that matches nothing and a program without blocks are PlanErrors."""
    ids = tokens(4, 8, 128)
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), llama_plan("tp", sequence_parallel=True))
    sharded = fxshard.transform(llama(n_layers=2), plan, (ids,), blocks="auto")
    assert program_meta(sharded).fsdp_units == ["layers.0", "layers.1"]
    for program, members in [(sharded, ["norm_weight"])] + [(block, ["ffn_norm_weight", "attention_norm_weight"])
                                                           for block in sharded.layers]:
        (bucket,) = [n for n in program.graph.nodes if n.target is fxshard.grad_sync_bucket]
        assert [a.name.split("layers_")[-1].lstrip("0123456789_") for a in bucket.args[0]] == members
    with pytest.raises(fxshard.PlanError, match="no module's FQN matches the blocks= pattern"):
        fxshard.transform(llama(n_layers=2), plan, (ids,), blocks="blocks.*")
    with pytest.raises(fxshard.PlanError, match="blocks='auto'"):
        fxshard.compile(fxshard.transform(llama(n_layers=2), plan, (ids,)))


def test_regional_compile_real_gloo():
    spawn(_check, 2)
