"""torch.compile consumes fxshard's rewritten graph: real gloo ranks, tp=2.

For every case (model factory + plan factory) and backend the compiled sharded
program must

* compile with ``fullgraph=True`` and no graph break (``torch._dynamo.explain``);
* give the eager sharded program's output and every parameter gradient (forward and
  backward through the collectives' autograd), also after an SGD step;
* show the compiler fxshard's collectives as ``_c10d_functional`` ops, each followed by
  ``wait_tensor``: a custom backend (``aot_autograd`` with capturing compilers) sees, in
  the forward and backward graphs, exactly the collectives that
  :func:`fxshard.comm_summary` lists, and inductor's generated code calls them.

One spawn for the custom backend (~20 s), one for inductor (~75 s
with a cold cache: marked slow); every case runs inside it.  Add a model family by
adding a :class:`Case` to ``CASES``.  ``FXSHARD_TEST_VERBOSE=1`` prints the
collectives each graph holds.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

try:
    from harness import make_mesh, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, spawn


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    make_model: Callable  # () -> nn.Module
    make_plan: Callable  # (mesh) -> fxshard.Plan
    make_inputs: Callable  # () -> tuple of single-device inputs (replicated on every rank)
    loss: Callable  # (output, *inputs) -> scalar
    # expected per-layer collectives {phase: {c10d op: count}}, checked on top of comm_summary
    per_layer: dict | None = None
    n_layers: int = 0


def _llama():
    from fxshard.testing.models import llama

    return llama(n_heads=8, n_kv_heads=4, n_layers=2, rope="real")  # real rope: inductor has no complex codegen


def _llama_plan(mesh):
    import fxshard
    from fxshard.testing.models import llama_plan

    return fxshard.Plan(mesh, llama_plan("tp"))


def _token_inputs():
    from fxshard.testing.models import tokens

    return (tokens(2, 8, 128),)


def _logits_loss(out, ids):
    return F.cross_entropy(out.flatten(0, 1), ids.roll(-1, 1).flatten())


def _gpt2_with_loss():
    from fxshard.testing.models import WithLoss, gpt2

    return WithLoss(gpt2())


def _gpt2_sp_plan(mesh):
    import fxshard
    from fxshard.testing.models import gpt2_plan

    plan = gpt2_plan("tp", sequence_parallel=True, loss_parallel=True)
    return fxshard.Plan(mesh, {f"model.{k}": v for k, v in plan.items()})


def _token_and_target_inputs():
    from fxshard.testing.models import tokens

    return (tokens(2, 8, 128), tokens(2, 8, 128, seed=1))


def _cp_plan(mesh, method):
    """Context parallelism on the test's one mesh axis (named "tp"): the sequence is
    sharded there, attention gathers K/V or runs the ring."""
    import fxshard
    from torch.distributed.tensor import Shard

    return fxshard.Plan(mesh, {"layers.*.attention": fxshard.context_parallel("tp", method=method)},
                        inputs={"tokens": {"tp": Shard(1)}})


def _cp_allgather_plan(mesh):
    return _cp_plan(mesh, "allgather")


def _cp_ring_plan(mesh):
    return _cp_plan(mesh, "ring")


CASES = {
    "llama": Case(_llama, _llama_plan, _token_inputs, _logits_loss,
                  per_layer={"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}, n_layers=2),
    # sequence parallel (all-gather / reduce-scatter), vocab-parallel embedding, loss parallel
    "gpt2_sp_loss_parallel": Case(_gpt2_with_loss, _gpt2_sp_plan, _token_and_target_inputs, lambda out, *_: out),
    # context parallelism: K/V gathered (backward reduce-scatter), or the ring's shifts (all-to-alls)
    # (the collectives are checked against comm_summary, which counts them per layer in test_context_parallel_*)
    "llama_cp_allgather": Case(_llama, _cp_allgather_plan, _token_inputs, _logits_loss),
    "llama_cp_ring": Case(_llama, _cp_ring_plan, _token_inputs, _logits_loss),
}


# ----------------------------------------------------------------------------- helpers (run in the ranks)


def _collectives(gm: torch.fx.GraphModule) -> Counter:
    """``{c10d op: count}`` of the functional collectives in an aot graph; checks that
    each one is waited for."""
    counts: Counter = Counter()
    for n in gm.graph.nodes:
        name = str(n.target)
        if n.op != "call_function" or not name.startswith("_c10d_functional.") or "wait_tensor" in name:
            continue
        op = name.split(".")[1]
        counts[op] += 1
        users = [str(u.target) for u in n.users]
        assert any("wait_tensor" in u for u in users), f"{n.name} ({name}) is not followed by wait_tensor: {users}"
    return counts


def _expected(summary, phase: str) -> Counter:
    from fxshard.debug.comm_summary import C10D_OPS

    return Counter(C10D_OPS[r.kind] for r in summary.select(phase))


def _capturing_backend(graphs: dict):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(phase):
        def compile_fn(gm, example_inputs):
            graphs.setdefault(phase, []).append(gm)
            return make_boxed_func(gm.forward)
        return compile_fn

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_step(model, run, inputs, loss_fn):
    """forward + backward + one SGD step; returns (output, loss, grads, output after the step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = run(*inputs)
    loss = loss_fn(out, *inputs)
    opt.zero_grad()
    loss.backward()
    grads = _grads(model)
    opt.step()
    after = run(*inputs).detach()  # grad mode unchanged: the compiled graph is reused, not recompiled
    return out.detach(), loss.detach(), grads, after


def _check_case(name: str, case: Case, mesh, backend: str, rtol: float, atol: float, rank: int) -> str:
    import torch._dynamo
    import fxshard
    from fxshard.debug.comm_summary import comm_summary

    inputs = case.make_inputs()
    model = case.make_model()
    eager = fxshard.transform(model, case.make_plan(mesh), inputs)
    compiled_module = fxshard.transform(model, case.make_plan(mesh), inputs)
    summary = comm_summary(eager)
    ref = _train_step(eager, eager, inputs, case.loss)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # no graph breaks: one graph for the whole program
    explained = torch._dynamo.explain(compiled_module)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, (
        f"{name}: {explained.graph_count} graphs, {explained.graph_break_count} breaks {explained.break_reasons}, "
        f"compile times {explained.compile_times}")
    torch._dynamo.reset()

    graphs: dict = {}
    if backend == "capture":
        compiled = torch.compile(compiled_module, backend=_capturing_backend(graphs), fullgraph=True)
        codes = []
        got = _train_step(compiled_module, compiled, inputs, case.loss)
    elif backend == "inductor":
        from torch._inductor.utils import run_and_get_code

        compiled = torch.compile(compiled_module, backend="inductor", fullgraph=True)
        got, codes = run_and_get_code(lambda: _train_step(compiled_module, compiled, inputs, case.loss))
    else:
        compiled = torch.compile(compiled_module, backend=backend, fullgraph=True)
        codes = []
        got = _train_step(compiled_module, compiled, inputs, case.loss)
    assert not torch._dynamo.utils.counters["graph_break"], f"{name}: {dict(torch._dynamo.utils.counters['graph_break'])}"

    for what, a, b in zip(("output", "loss"), got[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name} {backend} {what}: {m}")
    assert got[2].keys() == ref[2].keys() and ref[2], f"{name}: gradients of {sorted(ref[2])} vs {sorted(got[2])}"
    for pname in ref[2]:
        torch.testing.assert_close(got[2][pname], ref[2][pname], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name} {backend} grad of {pname}: {m}")
    torch.testing.assert_close(got[3], ref[3], rtol=rtol, atol=atol, msg=lambda m: f"{name} {backend} after a step: {m}")

    report = []
    if backend == "capture":
        # one forward and one backward graph: no recompilation, also after the optimizer step
        assert len(graphs.get("forward", [])) == 1 and len(graphs.get("backward", [])) == 1, {k: len(v) for k, v in graphs.items()}
        for phase in ("forward", "backward"):
            seen, want = _collectives(graphs[phase][0]), _expected(summary, phase)
            assert seen == want and sum(want.values()) > 0, f"{name} {phase} graph: {dict(seen)} != comm_summary {dict(want)}"
            if case.per_layer is not None:
                assert seen == Counter({op: n * case.n_layers for op, n in case.per_layer[phase].items()}), (name, phase, seen)
            report.append(f"{phase} {dict(seen)}")
    if backend == "inductor":
        code = "\n".join(codes)
        called = Counter(m.rstrip("_") for m in re.findall(r"_c10d_functional\.(\w+?)\.default\(", code) if m != "wait_tensor")
        want = _expected(summary, "forward") + _expected(summary, "backward")
        assert called == want, f"{name}: inductor code calls {dict(called)}, comm_summary says {dict(want)}"
        assert code.count("_c10d_functional.wait_tensor.default(") == sum(want.values())
        report.append(f"inductor calls {dict(called)}")
    return f"{name}: " + "; ".join(report)


def _compiled_ranks(rank: int, world_size: int, backends: list[str], names: list[str], rtol: float, atol: float) -> None:
    torch.manual_seed(0)
    mesh = make_mesh({"tp": world_size})
    for backend in backends:
        for name in names:
            msg = _check_case(name, CASES[name], mesh, backend, rtol, atol, rank)
            if rank == 0 and os.environ.get("FXSHARD_TEST_VERBOSE"):
                print(f"[{backend}] {msg}", flush=True)
        if backend == "capture":
            _check_runtime_ops(rank)


def _check_runtime_ops(rank: int) -> None:
    """Every runtime op (not only those the model cases use) compiles with fullgraph,
    keeps its gradient semantics, and shows its communication in the aot graphs."""
    import torch._dynamo
    from fxshard.runtime import collectives as rt

    def program(x):
        a = rt.shard(x, "tp", 0)  # forward: no comm; backward: all-gather
        b = rt.all_gather(a * 2, "tp", 0)  # forward all-gather; backward: local chunk
        c = rt.all_gather(a * 3, "tp", 0, grad="partial")  # backward: reduce-scatter
        d = rt.reduce_scatter(b + c, "tp", 1)  # backward: all-gather
        e = rt.all_to_all(d, "tp", 1, 0)  # backward: all-to-all
        f = rt.grad_sync(e, "tp")  # backward: all-reduce
        return rt.all_reduce(f.sin(), "tp")  # backward: identity

    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ref = program(x)
    ref.sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    graphs: dict = {}
    torch._dynamo.reset()
    out = torch.compile(program, backend=_capturing_backend(graphs), fullgraph=True)(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_grad)
    assert _collectives(graphs["forward"][0]) == Counter(
        all_gather_into_tensor=2, reduce_scatter_tensor=1, all_to_all_single=1, all_reduce=1)
    assert _collectives(graphs["backward"][0]) == Counter(
        all_reduce=1, all_to_all_single=1, all_gather_into_tensor=2, reduce_scatter_tensor=1)


# ----------------------------------------------------------------------------- tests


def test_compile_custom_backend():
    """Custom capturing backend (collectives in the aot forward/backward graphs) for every
    case, in one spawn.  It is ``aot_autograd`` running the forward and backward graphs as
    they come, which is what ``aot_eager`` runs (aot_eager itself: tests/test_regional_compile.py,
    tests/test_fsdp.py)."""
    spawn(_compiled_ranks, 2, ["capture"], list(CASES), 1.3e-6, 1e-5)


@pytest.mark.slow  # ~75 s on 2 CPU cores with a cold inductor cache (C++ compilation)
@pytest.mark.sweep  # .ci/run's second stage: the custom backend above checks the same graphs each run
def test_compile_inductor():
    """Inductor for every case but context parallelism's, in one spawn; its generated code
    calls the collectives.  (The context-parallel cases compile under the capturing
    backend and aot_eager above; under inductor, which a cold cache makes the slowest
    test of the suite, they are left out to keep the suite short.)"""
    spawn(_compiled_ranks, 2, ["inductor"], [c for c in CASES if not c.startswith("llama_cp_")], 1e-4, 1e-5)
