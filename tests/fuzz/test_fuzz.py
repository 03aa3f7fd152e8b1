"""Property-based fuzzing: random models (grammar.py) x random plans, under simulated ranks.

The promise under test: ``fxshard.transform(model, plan)`` either gives the
single-device numbers or raises ``fxshard.PlanError`` and leaves the model untouched.
Every case ends in exactly one of

* **equal**: transform succeeds and, on every simulated rank, the output, the input
  gradient (float inputs) and every parameter gradient shard equal the matching slice
  of the single-device values (one forward + backward of ``(out * w).sum()``);
* **PlanError**: ``Plan(...)`` or ``transform`` raises PlanError, and the model's
  parameters (objects and values), buffers, modules, attributes and hooks are exactly
  as before;

anything else fails: another exception out of transform or out of the sharded
program, an ``fxshard.InternalError`` (a bug in fxshard: never a PlanError), or a PlanError
that says it is one ("this is a bug in fxshard") (**crash**); a number that differs, a Partial output, a touched
model (**silently wrong**).  A right plan (no mistake, every sharded size divides)
that is refused is counted and listed (``refused``), not failed: a refusal keeps the
promise.  A quarter of the cases run the sharded program at another batch size and
sequence length than the example inputs it was transformed with (``run_shape``).  The
example inputs are never the tensors the program runs on, and have other values; some
pass one tensor under two names (``ModelCfg.example``), so an input bound by identity
is a wrong number.

Simulated ranks (torch's ``LocalTensorMode``) hold a size that differs by rank (a batch
of 3 on ``dp=2``) as a ``LocalIntNode``, which lacks methods some ops call (grouped-query
attention's ``k[:, :, :, None, :].expand(...)``).  A case whose sharded program fails on
that alone (:func:`simulation_gap`) is checked again on real gloo processes, one per rank
(:func:`run_case_real`), against the same single-device values, and its outcome there is
the case's: equal, PlanError, crash or wrong like any other.  The report line says how
many cases were checked so.

Run::

    pytest tests/fuzz -m "not slow"                  # ~30 cases
    pytest tests/fuzz -m slow                        # the sweep: >= 1000 cases, fixed seed
    FXSHARD_FUZZ_CASES=3000 FXSHARD_FUZZ_SECONDS=900 pytest tests/fuzz -m slow
    FXSHARD_FUZZ_COLLECT=/tmp/fuzz.jsonl pytest tests/fuzz -m slow   # census: record failures, don't stop

A failure prints the shrunk ``FuzzCase`` (a reproducer: ``replay(FuzzCase(...))`` from
this module) and the plan as fxshard code.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, given, note, seed, settings

import fxshard
from fxshard import PlanError

from equivalence import coords_of, input_layouts, output_layout, slice_for
from harness import make_mesh, plain, rank_map, rank_value, simulated, spawn

from grammar import (AttnCfg, BlockCfg, Entry, FuzzCase, MlpCfg, ModelCfg, build_example_inputs, build_inputs, build_model,
                     build_plan, fuzz_cases, plan_source)
from fxshard.meta import program_meta

ATOL = 1e-4
RTOL = 1e-4
INTERNAL = "this is a bug in fxshard"  # what an InternalError says; a PlanError never should

QUICK_CASES = int(os.environ.get("FXSHARD_FUZZ_QUICK_CASES", "30"))
SWEEP_CASES = int(os.environ.get("FXSHARD_FUZZ_CASES", "1000"))
SWEEP_MIN = int(os.environ.get("FXSHARD_FUZZ_MIN", str(min(1000, SWEEP_CASES))))
SWEEP_SECONDS = float(os.environ.get("FXSHARD_FUZZ_SECONDS", "900"))  # a bound against a hang; ~250 s expected
REAL_TIMEOUT = 120.0  # seconds for one case on real gloo ranks
COLLECT = os.environ.get("FXSHARD_FUZZ_COLLECT")  # a .jsonl path: record every failure, keep going


# ----------------------------------------------------------------------------- the model is untouched


def fingerprint(model: nn.Module) -> dict:
    """Everything a transform could change on the input model: parameter and buffer
    objects and values, module attributes, children, hooks, modes."""
    from torch.nn.modules import module as mm

    return {
        "params": [(n, id(p), p.requires_grad, p.grad is None, p.detach().clone())
                   for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, id(b), b.clone()) for n, b in model.named_buffers(remove_duplicate=False)],
        "modules": [(n, id(m), type(m), m.training, sorted(vars(m)), sorted(m._parameters), sorted(m._buffers),
                     sorted(m._modules), sorted(m._non_persistent_buffers_set),
                     len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                     len(m._backward_pre_hooks), len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks))
                    for n, m in model.named_modules(remove_duplicate=False)],
        "global_hooks": (len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks), len(mm._global_backward_hooks)),
        "state_dict": list(model.state_dict().keys()),
    }


def fingerprint_diff(before: dict, after: dict) -> str | None:
    for key in ("modules", "global_hooks", "state_dict"):
        if before[key] != after[key]:
            if key == "modules":
                for b, a in zip(before[key], after[key]):
                    if b != a:
                        return f"module {b[0]!r} changed: {b} -> {a}"
            return f"{key} changed: {before[key]} -> {after[key]}"
    for kind in ("params", "buffers"):
        if [x[:-1] for x in before[kind]] != [x[:-1] for x in after[kind]]:
            return f"{kind} objects/flags changed"
        for b, a in zip(before[kind], after[kind]):
            if b[-1].shape != a[-1].shape or not torch.equal(b[-1], a[-1]):
                return f"{kind[:-1]} {b[0]!r} value changed"
    return None


# ----------------------------------------------------------------------------- one case


@dataclasses.dataclass
class Outcome:
    kind: str          # "equal" | "planerror" | "crash" | "wrong"
    what: str = ""     # one line: the PlanError's first line, the exception, the comparison that failed
    detail: str = ""   # traceback or message
    max_diff: float | None = None
    real: bool = False  # checked on real gloo ranks: simulated ranks cannot run the program (simulation_gap)

    @property
    def failed(self) -> bool:
        return self.kind in ("crash", "wrong")


def weights_for(shape, seed: int = 1234) -> torch.Tensor:
    """The loss weights: (out * w).sum() has gradient w (scaled like a mean)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) / math.sqrt(max(1, math.prod(shape)))


def reference(model: nn.Module, inputs):
    """Single-device output, input gradients and parameter gradients (by FQN)."""
    model = copy.deepcopy(model)
    xs = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = model(*xs)
    w = weights_for(tuple(out.shape))
    (out * w).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return out.detach(), w, [x.grad if x.is_floating_point() else None for x in xs], grads


def _diff(got, want, what: str) -> tuple[str | None, float]:
    if got is None:
        return f"{what}: no gradient", math.inf
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}: local shape {tuple(got.shape)}, expected {tuple(want.shape)}", math.inf
    d = (got.detach().double() - want.double()).abs()
    diff = float(d.max()) if d.numel() else 0.0
    if not torch.allclose(got, want, atol=ATOL, rtol=RTOL, equal_nan=True):
        return f"{what}: max abs diff {diff:.3g}", diff
    return None, diff


def simulation_gap(e: BaseException) -> bool:
    """The simulated ranks cannot run this program: torch's ``LocalTensorMode`` holds a
    size that differs by rank (a batch of 3 on ``dp=2``: 2 rows and 1) as a ``LocalIntNode``,
    which lacks methods a real SymNode has (``statically_known_true``, and past it asserts
    that compare such a size with an int, e.g. ``expand`` of a grouped-query ``k[..., None, :]``).
    A real rank holds plain ints, so the case is checked on real gloo ranks instead."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, (AttributeError, AssertionError)) and ("SymNode" in text or "LocalIntNode" in text)


def run_case(case: FuzzCase, real_rank: int | None = None) -> Outcome:
    """Transform and check one case (see the module docstring for the outcomes).
    ``real_rank``: check only this rank, inside a real process group (:func:`run_case_real`)."""
    mesh_shape = case.mesh_shape
    world = math.prod(mesh_shape.values())
    model = build_model(case.model)
    example = build_example_inputs(case.model)  # other tensors (other values, maybe aliased) than the run's
    inputs = build_inputs(case.model, case.run_shape)  # what the program runs on
    before = fingerprint(model)
    ranks = range(world) if real_rank is None else [real_rank]
    with (simulated(mesh_shape) if real_rank is None else contextlib.nullcontext(make_mesh(mesh_shape))) as mesh:
        # ---- transform
        try:
            plan = build_plan(case, mesh)
            sharded = fxshard.transform(model, plan, example_inputs=example, capture=case.capture)
        except PlanError as e:
            with plain():
                touched = fingerprint_diff(before, fingerprint(model))
            if touched:
                return Outcome("wrong", f"PlanError left the model touched: {touched}", f"{type(e).__name__}: {e}")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if INTERNAL in str(e):  # a bug dressed as a refusal
                cause = e.__cause__
                what = f"{type(cause).__name__}: {cause}" if cause is not None else first
                return Outcome("crash", f"internal error dressed as PlanError: {what.splitlines()[0] if what else ''}",
                               f"{e}\n\n" + "".join(traceback.format_exception(cause)) if cause is not None else str(e))
            return Outcome("planerror", first, str(e))
        except Exception as e:
            return Outcome("crash", f"transform raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           traceback.format_exc())
        with plain():
            touched = fingerprint_diff(before, fingerprint(model))
        if touched:
            return Outcome("wrong", f"transform touched the model: {touched}")
        try:
            out_layout = output_layout(sharded)
        except (ValueError, TypeError) as e:
            return Outcome("wrong", f"no comparable output layout: {e}")
        in_layouts = input_layouts(sharded, plan)
        with plain():
            ref_out, w, ref_in_grads, ref_grads = reference(model, inputs)

        # ---- run the sharded program: one forward + backward on every simulated rank
        try:
            local_in = []
            for x, lay in zip(inputs, in_layouts):
                t = rank_map(lambda r, x=x, lay=lay: slice_for(x, lay, coords_of(r, mesh_shape), mesh_shape).clone())
                local_in.append(t.requires_grad_() if t.is_floating_point() else t)
            local_w = rank_map(lambda r: slice_for(w, out_layout, coords_of(r, mesh_shape), mesh_shape).clone())
            out = sharded(*local_in)
            (out * local_w).sum().backward()
        except Exception as e:
            if real_rank is None and simulation_gap(e):
                return run_case_real(case)
            return Outcome("crash", f"the sharded program raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           traceback.format_exc())

        # ---- compare every rank with the matching slice of the single-device values
        with plain():
            state = (program_meta(sharded).state or {})
            blocks = program_meta(sharded).blocks
            grads = {n: p.grad for n, p in sharded.named_parameters(remove_duplicate=False)}
            if set(grads) != set(ref_grads):
                return Outcome("wrong", f"parameter FQNs differ: lost {sorted(set(ref_grads) - set(grads))}, "
                                        f"new {sorted(set(grads) - set(ref_grads))}")
            worst, problems = 0.0, []
            for r in ranks:
                coord = coords_of(r, mesh_shape)
                checks = [(rank_value(out, r), slice_for(ref_out, out_layout, coord, mesh_shape), "output")]
                for i, (x, g, lay) in enumerate(zip(local_in, ref_in_grads, in_layouts)):
                    if g is not None:
                        got = x.grad
                        checks.append((None if got is None else rank_value(got, r), slice_for(g, lay, coord, mesh_shape), f"grad of input {i}"))
                for fqn, g in grads.items():
                    want = ref_grads[fqn]
                    layout, shape = state.get(fqn, ({}, None))
                    if shape is not None and tuple(shape) != tuple(ref_grads_shape(model, fqn)):
                        problems.append(f"{fqn}: global shape {tuple(shape)}")
                        continue
                    if want is None:
                        if g is not None and rank_value(g, r).any():
                            problems.append(f"rank {r}: {fqn} has a gradient, single device has none")
                        continue
                    checks.append((None if g is None else rank_value(g, r), slice_for(want, layout, coord, mesh_shape, blocks.get(fqn)),
                                   f"grad of {fqn}"))
                for got, want, what in checks:
                    problem, diff = _diff(got, want, f"rank {r} {coord}: {what}")
                    worst = max(worst, diff)
                    if problem:
                        problems.append(problem)
            if problems:
                return Outcome("wrong", problems[0], "\n".join(problems[:20]), worst)
            return Outcome("equal", max_diff=worst)


def _real_rank_main(rank: int, world_size: int, case: FuzzCase, out_dir: str) -> None:
    """One gloo rank of :func:`run_case_real`: its outcome as JSON in ``out_dir``."""
    torch.set_num_threads(1)
    o = run_case(case, real_rank=rank)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(dataclasses.asdict(o), f)


def run_case_real(case: FuzzCase) -> Outcome:
    """The case on ``prod(mesh)`` real gloo processes, each checking its own rank against
    one device; the worst rank's outcome (crash, then wrong, then the others), marked
    ``real``.  For the programs simulated ranks cannot run (:func:`simulation_gap`)."""
    world = math.prod(case.mesh_shape.values())
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            spawn(_real_rank_main, world, case, out_dir, timeout=REAL_TIMEOUT)
        except Exception as e:  # a rank died or hung: in the program, as a crash
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return Outcome("crash", f"on real gloo ranks: {type(e).__name__}: {first}", str(e)[-4000:], real=True)
        outcomes = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                outcomes.append(Outcome(**json.load(f)))
    order = {"crash": 0, "wrong": 1, "planerror": 2, "equal": 3}
    worst = min(outcomes, key=lambda o: order[o.kind])
    if len({o.kind for o in outcomes}) > 1 and worst.kind in ("planerror", "equal"):
        worst = Outcome("crash", f"on real gloo ranks: the ranks disagree: {[o.kind for o in outcomes]}", worst.detail)
    diffs = [o.max_diff for o in outcomes if o.max_diff is not None]
    what = worst.what if worst.what.startswith("on real") or not worst.what else f"on real gloo ranks: {worst.what}"
    return dataclasses.replace(worst, what=what, max_diff=max(diffs) if diffs else None, real=True)


def ref_grads_shape(model: nn.Module, fqn: str):
    return dict(model.named_parameters(remove_duplicate=False))[fqn].shape


def replay(case: FuzzCase) -> Outcome:
    """Run one case (e.g. a falsifying example pasted from a failure) and print what happened."""
    print(plan_source(case))
    o = run_case(case)
    print(f"{o.kind}: {o.what}")
    if o.detail and o.kind != "equal":
        print(o.detail)
    return o


# ----------------------------------------------------------------------------- the sweep


class Tally:
    def __init__(self):
        self.counts = collections.Counter()
        self.refused: list[tuple[FuzzCase, str]] = []
        self.failures: list[tuple[FuzzCase, Outcome]] = []
        self.reasons = collections.Counter()
        self.started = time.monotonic()
        self.max_diff = 0.0

    def add(self, case: FuzzCase, o: Outcome) -> None:
        self.counts["cases"] += 1
        self.counts[o.kind] += 1
        if o.real:
            self.counts["real"] += 1
        if o.kind == "equal" and o.max_diff is not None:
            self.max_diff = max(self.max_diff, o.max_diff)
        if o.kind == "planerror":
            self.reasons[_reason(o.detail or o.what)] += 1
            if case.expect_equal:
                self.refused.append((case, o.what))
        if o.failed:
            self.failures.append((case, o))

    def line(self) -> str:
        c = self.counts
        return (f"{c['cases']} cases, {c['equal']} equal, {c['planerror']} PlanError, "
                f"{c['crash']} crash, {c['wrong']} silently wrong")

    def extra(self) -> list[str]:
        wall = time.monotonic() - self.started
        n = max(1, self.counts["cases"])
        out = [f"{wall:.1f} s wall, {wall / n:.3f} s per case; largest difference among equal cases {self.max_diff:.2g}; "
               f"{len(self.refused)} right plans refused; {self.counts['real']} cases checked on real gloo ranks "
               f"(simulated ranks cannot run them)"]
        if self.reasons:
            out.append("  most common PlanErrors: " + "; ".join(f"{k} ({v})" for k, v in self.reasons.most_common(5)))
        for case, why in self.refused[:10]:
            out.append(f"  refused right plan ({case.style}, mesh {case.mesh_shape}): {why[:160]}")
        for case, o in self.failures[:20]:
            out.append(f"  {o.kind}: {o.what[:200]}  [{case.style}; {list(case.mutations)}]")
        return out


def _reason(message: str) -> str:
    """A PlanError's gist, for the tally: its ``problem:`` line (node errors), else its first line."""
    lines = [l.strip() for l in message.strip().splitlines()]
    problem = next((l[len("problem:"):].strip() for l in lines if l.startswith("problem:")), lines[0] if lines else "")
    return problem[:50]


def _record(path: str, case: FuzzCase, o: Outcome) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"kind": o.kind, "what": o.what, "case": repr(case), "plan": plan_source(case),
                            "detail": o.detail[-4000:], "expect_equal": case.expect_equal}) + "\n")


def _sweep(cases: int, seconds: float, report: list, name: str, collect: str | None = COLLECT,
           draw_seed: int | None = None) -> Tally:
    """Run ``cases`` distinct cases (fewer if ``seconds`` run out first).  ``draw_seed``:
    hypothesis draws from this seed (a shard of the sweep) instead of the test's hash."""
    tally = Tally()
    deadline = time.monotonic() + seconds
    first_failure = []
    seen = set()

    # different choice sequences often give the same case: draw twice as many, run each case once
    @settings(max_examples=2 * cases, derandomize=draw_seed is None, database=None, deadline=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
              phases=[Phase.explicit, Phase.generate] if collect else [Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=fuzz_cases())
    def prop(case):
        key = repr(case)
        if not first_failure:
            if tally.counts["cases"] >= cases or time.monotonic() > deadline or key in seen:
                return  # enough cases, the time budget is spent, or a case already run
            seen.add(key)
        note(plan_source(case))
        o = run_case(case)
        if not first_failure:  # counts stop at the first failure (shrinking replays it)
            tally.add(case, o)
        if o.failed:
            if collect:
                _record(collect, case, o)
                return
            first_failure.append(o)
            note(o.detail)
            raise AssertionError(f"{o.kind}: {o.what}")

    if draw_seed is not None:
        prop = seed(draw_seed)(prop)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only contend (2 shared cores in CI)
    trace_log = logging.getLogger("torch.__trace")  # export's structured trace: thousands of DEBUG records a case
    propagate, trace_log.propagate = trace_log.propagate, False
    try:
        prop()
    finally:
        torch.set_num_threads(threads)
        trace_log.propagate = propagate
        lines = tally.extra() + [f"fxshard fuzz [{name}]: {tally.line()}"]  # the counts line last
        report.extend(lines)
        print("\n".join(lines))
    return tally


def test_fuzz_quick(fuzz_report):
    """A few random models x plans (the default quick run)."""
    tally = _sweep(QUICK_CASES, 120.0, fuzz_report, "quick")
    assert tally.counts["crash"] == 0 and tally.counts["wrong"] == 0, tally.line()


# dp x tp = 2 x 2 with a batch of 3 (2 rows and 1) and grouped-query attention written as
# k[:, :, :, None, :].expand(...): simulated ranks cannot run it (a LocalIntNode per-rank size)
UNEVEN_BATCH_GQA = FuzzCase(
    model=ModelCfg(dim=24, batch=3, seq=4, max_seq=8, input="x", vocab=16, embed_scale="none", layers=(BlockCfg(
        norm="rmsnorm", attn=AttnCfg(n_heads=6, n_kv_heads=2, head_dim=4, qkv="fused", core="sdpa_mask", gqa="expand",
                                     scale="sqrt", mask="bool", heads="transpose", softmax="plain", split_view="literal",
                                     rope="shared", rope_view="index", merge="flatten", bias=True, out_bias=False,
                                     shape_use="ones_like_tril"),
        mlp=MlpCfg(kind="grouped", hidden=12, groups=2, act="gelu", bias=True, act_module=False, parts="split"),
        call="positional"),), final_norm=None, head="none", head_out=24, head_bias=False, seq_from="input", tail="none",
        pos_embed=False, loss="none", seed=1, tables="buffer", leaf="dropout", example="distinct"),
    mesh=(("dp", 2), ("tp", 2)),
    entries=(Entry("layers.*.attention.wqkv", "colwise", axis="tp", inputs="R", splits=(24, 8, 8)),
             Entry("layers.*.attention.wo", "rowwise", axis="tp"), Entry("layers.*.feed_forward.w13", "colwise", axis="tp"),
             Entry("layers.*.feed_forward.w2", "rowwise", axis="tp")),
    inputs={"x": {"dp": "S0"}}, style="tp")


def test_simulation_gap_checked_on_real_ranks():
    """A program simulated ranks cannot run is checked on 4 real gloo ranks, each against
    the single-device values, and is equal there (not skipped, not a crash)."""
    o = run_case(UNEVEN_BATCH_GQA)
    assert o.real and o.kind == "equal", (o.kind, o.what, o.detail[-2000:])
    assert o.max_diff is not None and o.max_diff < ATOL


SHARD_RESULT = "fxshard fuzz shard result: "


@pytest.mark.slow
@pytest.mark.sweep  # ~8 min: .ci/run's second stage
def test_fuzz_sweep(fuzz_report):
    """>= 1000 random models x plans with fixed seeds; stops drawing after
    FXSHARD_FUZZ_SECONDS.  Every case must be equal or a clean PlanError.

    The sweep is single-threaded, so it runs as two shards side by side: half the cases
    here (hypothesis seed 0), half in a child process (seed 1, see ``_shard_main``)."""
    half = SWEEP_CASES // 2
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, __file__, "1", str(SWEEP_CASES - half), str(SWEEP_SECONDS)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": path})
    try:
        tally = _sweep(half, SWEEP_SECONDS, fuzz_report, "sweep shard 0", draw_seed=0)
    except BaseException:
        child.kill()
        raise
    out, _ = child.communicate(timeout=SWEEP_SECONDS + 600)
    results = [line[len(SHARD_RESULT):] for line in out.splitlines() if line.startswith(SHARD_RESULT)]
    assert results, f"the fuzz shard in the child process reported nothing (exit {child.returncode}):\n{out[-4000:]}"
    other = json.loads(results[-1])
    fuzz_report.extend(other["lines"])
    assert other["failure"] is None, f"fuzz shard 1: {other['failure']}\n{out[-6000:]}"
    counts = tally.counts + collections.Counter(other["counts"])
    fuzz_report.append(f"fxshard fuzz [sweep]: {counts['cases']} cases, {counts['equal']} equal, {counts['planerror']} "
                       f"PlanError, {counts['crash']} crash, {counts['wrong']} silently wrong")
    assert counts["crash"] == 0 and counts["wrong"] == 0, fuzz_report[-1]
    assert counts["cases"] >= SWEEP_MIN, (
        f"only {counts['cases']} cases ran within FXSHARD_FUZZ_SECONDS={SWEEP_SECONDS:.0f}; "
        f"at least {SWEEP_MIN} are required (raise the budget on a slow machine)")


def _shard_main(shard: int, cases: int, seconds: float) -> None:
    """A shard of the sweep in its own process: prints its tally (and its first failure,
    shrunk, with the reproducer hypothesis notes above it) as one JSON line."""
    report: list[str] = []
    failure = None
    try:
        tally = _sweep(cases, seconds, report, f"sweep shard {shard}", draw_seed=shard)
    except AssertionError as e:
        tally, failure = None, str(e)
    counts = dict(tally.counts) if tally is not None else {}
    print(SHARD_RESULT + json.dumps({"counts": counts, "lines": report, "failure": failure}), flush=True)


if __name__ == "__main__":  # python test_fuzz.py SHARD CASES SECONDS (test_fuzz_sweep's child)
    _shard_main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
