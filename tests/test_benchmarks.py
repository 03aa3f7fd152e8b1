"""Smoke tests of benchmarks/ and ``python -m fxshard demo --bench``: every script runs
with tiny arguments, prints its table and writes a results JSON whose content is
checked against what the script must have found (losses equal, the measured
collectives equal the static summary and the Megatron formula, loss parallel saves
memory ...).  Each runs in a subprocess (spawned ranks, its own process group)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# subprocesses with spawned ranks, several minutes on 2 cores: .ci/run's second stage, with the sweeps
pytestmark = [pytest.mark.slow, pytest.mark.sweep]


def _run(args: list[str], timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One results folder for the module: test_report reads what the others wrote."""
    return tmp_path_factory.mktemp("results")


def _results(path: Path):
    payload = json.loads(path.read_text())
    assert payload["command"].startswith("python benchmarks/") and payload["machine"]["torch"]
    return payload["results"]


def test_step_time(results):
    out = results / "step_time.json"
    text = _run([str(BENCH / "step_time.py"), "--sizes", "small", "--modes", "eager", "--iters", "2", "--warmup", "1",
                 "--n-layers", "1", "--quiet", "--no-plot", "--out", str(out)])
    assert "fxshard/megatron =" in text and "fxshard/dtensor =" in text
    rows = _results(out)["rows"]
    assert [r["contender"] for r in rows] == ["megatron", "fxshard", "dtensor"]
    for r in rows:
        assert r["steps"] == 3 and len(r["times_ms"]) == 2 and r["median_ms"] > 0
        # same weights, same batch: every contender's loss equals one device's and the others'
        assert abs(r["loss_first"] - r["loss_single_device"]) < 1e-4 and r["max_loss_diff"] < 1e-4
        assert r["loss_last"] < r["loss_first"]  # SGD steps were taken
    assert rows[0]["ratio_vs_megatron"] == 1.0
    ratios = _results(out)["ratios"][0]
    assert abs(ratios["fxshard_vs_dtensor"] - rows[1]["median_ms"] / rows[2]["median_ms"]) < 1e-9



def test_step_time_hf_llama(results):
    pytest.importorskip("transformers")
    out = results / "step_time_hf_llama.json"
    text = _run([str(BENCH / "step_time.py"), "--model", "hf-llama", "--sizes", "small", "--modes", "eager", "--iters", "2",
                 "--warmup", "1", "--n-layers", "1", "--quiet", "--no-plot", "--out", str(out)])
    assert "fxshard/hf_tp =" in text and "fxshard/single =" in text
    payload = json.loads(out.read_text())
    rows = payload["results"]["rows"]
    assert [r["contender"] for r in rows] == ["hf_tp", "fxshard", "dtensor", "single"]
    for r in rows:
        assert r["steps"] == 3 and r["median_ms"] > 0 and r["max_loss_diff"] < 1e-4
        assert r["loss_last"] < r["loss_first"]
    params = {r["contender"]: r["params_per_rank"] for r in rows}
    # the three TP contenders shard the same parameters; one device holds all of them
    assert params["hf_tp"] == params["fxshard"] == params["dtensor"] < params["single"]
    assert payload["results"]["first_loss"][0]["max_diff"] < 1e-4 and rows[0]["ratio_vs_hf_tp"] == 1.0

def test_communication(results):
    out = results / "communication.json"
    text = _run([str(BENCH / "communication.py"), "--tp", "2", "--cases",
                 "llama_dense,llama_sp_loss_parallel,gpt2_dense,moe_expert_parallel,hf_mixtral_ep_dispatch",
                 "--out", str(out)])
    assert "minimum" in text
    rows = {(r["case"], r["contender"]): r for r in _results(out)}
    dense = rows["llama_dense", "fxshard"]
    # Megatron: 2 all-reduces per layer forward, 2 backward (2 layers), of [4, 16, 64] fp32
    assert (dense["forward"], dense["backward"], dense["by_kind"]) == (4, 4, "8 AR")
    assert dense["buffer_bytes"] == 8 * 4 * 16 * 64 * 4
    assert rows["llama_dense", "minimum"]["total"] == 8 and dense["wire_vs_min"] == 1.0
    for case in ("llama_dense", "llama_sp_loss_parallel", "gpt2_dense"):
        assert rows[case, "fxshard"]["static_ok"] == "yes" and rows[case, "fxshard"]["loss_ok"] == "yes", case
    # DTensor syncs the input gradient of q, k, v, w1 and w3 one by one: 5 backward all-reduces per layer
    dt = rows["llama_dense", "dtensor"]
    assert (dt["backward"], dt["static_ok"], dt["loss_ok"]) == (10, "yes", "yes")
    assert rows["gpt2_dense", "dtensor"]["note"].startswith("n/a")
    # MoE (real ranks): per layer the count exchange, dispatch and combine forward, the two
    # mirrors backward, plus the grad sync of the replicated (non-expert) parameters
    moe = rows["moe_expert_parallel", "fxshard"]
    assert (moe["forward"], moe["static_ok"], moe["loss_ok"]) == (6, "yes", "yes")
    assert moe["by_kind"].endswith("+ 10 A2A") and moe["wire_vs_min"] == pytest.approx(1.0)
    # HF Mixtral with its batch-sharded tokens dispatched (routed_experts(dispatch="all_to_all")): the same scheme
    hf = rows["hf_mixtral_ep_dispatch", "fxshard"]
    assert (hf["forward"], hf["backward"], hf["static_ok"], hf["loss_ok"]) == (6, 5, "yes", "yes")
    assert hf["by_kind"].endswith("+ 10 A2A") and hf["wire_vs_min"] == pytest.approx(1.0)


def test_transform_time(results):
    out = results / "transform_time.json"
    text = _run([str(BENCH / "transform_time.py"), "--layers", "1,2", "--repeats", "1", "--no-plot", "--hf-sizes", "8B",
                 "--no-plain-export", "--out", str(out)], timeout=400)  # ~50 s alone; the cp start-up rows spawn 3 processes
    assert "growth 2/1 layers" in text
    res = _results(out)
    one, two = res["rows"]
    assert two["traced_nodes"] > one["traced_nodes"] and two["nodes"] > one["nodes"]
    from fxshard.transform import PIPELINE

    ran = {p.name for p in PIPELINE if p.when is None}  # no FSDP2 here: every unconditional pass, and the copy
    assert ran | {"capture"} == set(two["passes_s"])
    assert res["growth"]["nodes"] == two["nodes"] / one["nodes"]
    (meta,) = res["hf_llama_meta"]  # Llama-3-8B on the meta device: 16 GB of bf16 weights never allocated
    assert meta["params"] > 8e9 and meta["nodes"] > 1000 and meta["peak_rss"] < meta["bf16_bytes"] / 4
    assert meta["capture_blocks"] == "stamped 29 of 32 blocks of model.layers from 3 captured"
    assert [r["mesh"] for r in res["gemma3_startup"]] == ["tp=2", "cp=2", "cp=2,tp=2"]


def test_memory(results):
    out = results / "memory.json"
    text = _run([str(BENCH / "memory.py"), "--tp", "2", "--batch", "4", "--seqlen", "32", "--vocab", "4096",
                 "--no-checkpoint", "--out", str(out)])
    assert "loss parallel / gathered logits" in text
    rows = {r["variant"]: r for r in _results(out)}
    # logits are 4x32x4096 fp32 = 2 MiB; sharded in two with loss parallel
    assert rows["gathered"]["logits_bytes"] == 4 * 32 * 4096 * 4
    assert rows["loss parallel"]["logits_bytes"] == 4 * 32 * 4096 * 4 // 2
    assert rows["loss parallel"]["param_bytes"] == rows["gathered"]["param_bytes"] < rows["dense"]["param_bytes"]
    assert rows["loss parallel"]["peak_bytes"] < 0.75 * rows["gathered"]["peak_bytes"]
    assert rows["gathered"]["peak_bytes"] >= 2 * rows["gathered"]["logits_bytes"]  # the profiler saw the logits


def test_memory_checkpoint_load(results):
    out = results / "memory_checkpoint.json"
    text = _run([str(BENCH / "memory.py"), "--checkpoint-only", "--tp", "2", "--ckpt-hidden", "512", "--ckpt-layers", "2",
                 "--ckpt-out", str(out)], timeout=300)
    assert "checkpoint load" in text
    (row,) = _results(out)["rows"]
    assert row["files"] > 1 and row["params"] > 3e7
    # each rank's private memory grows by its shards (half the checkpoint), never a full copy
    assert row["local"] < 0.55 * row["checkpoint_bytes"]
    assert row["anon"] < row["local"] + 24 * 2**20


def test_equivalence_script(results):
    out = results / "device_equivalence.json"
    _run([str(BENCH / "device_equivalence.py"), "--tp", "2", "--cases", "llama_dense", "--out", str(out)])
    (row,) = _results(out)
    assert row["ok"] == "yes" and row["max_abs_diff"] < 1e-4


def test_demo_bench():
    text = _run(["-m", "fxshard", "demo", "--steps", "1", "--bench", "--bench-modes", "eager", "--bench-iters", "2"])
    assert "max |loss difference|" in text
    table = text[text.index("step time of the demo model"):]
    for name in ("megatron", "fxshard", "dtensor"):
        assert f"demo   eager      {name}" in table
    assert "NO" not in table  # every contender's loss agrees


def test_gpu_script_is_well_formed():
    script = BENCH / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    steps = subprocess.run(["bash", str(script), "--dry-run"], check=True, capture_output=True, text=True).stdout
    assert "-m fxshard demo" in steps and "--device cuda" in steps and "inductor" in steps
    assert "--nproc-per-node 1" in steps and "benchmarks/device_equivalence.py" in steps
    assert "benchmarks/compile_time.py --device cuda" in steps and "-m cuda tests/" in steps
    some = subprocess.run(["bash", str(script), "--dry-run"], env={**os.environ, "STEPS": "cuda_tests simulated_cuda"},
                          check=True, capture_output=True, text=True).stdout
    assert [line.split()[0] for line in some.splitlines()] == ["cuda_tests", "simulated_cuda"]


def test_compile_time_run_under_torchrun(tmp_path):
    """The path gpu.sh takes (a torchrun per run), here on one gloo rank: a row with equal numbers."""
    out = tmp_path / "row.json"
    config = json.dumps(["tp", "aot_eager", "per-block", 1, 1, False, "cpu"])
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "benchmarks/compile_time.py", "--world", "1",
          "--one", config, "--out", str(out)])
    row = json.loads(out.read_text())
    assert (row["mesh"], row["way"], row["graphs"], row["graph_breaks"], row["max_diff"]) == ("tp1", "per-block", 1, 0, 0.0)


def test_megatron_minimum_formula():
    """The analytical minimum, counted by hand for 3 layers (independent of the code's sums)."""
    sys.path.insert(0, str(BENCH))
    try:
        import communication as c
    finally:
        sys.path.remove(str(BENCH))
    s = c.Shapes(batch=2, seqlen=8, dim=16, n_layers=3, vocab=64)
    act = 2 * 8 * 16 * 4
    dense = c.megatron_minimum(c.CASES["llama_dense"], s, 4)
    assert (dense.count("forward"), dense.count("backward"), dense.buffer()) == (6, 6, 12 * act)
    assert dense.wire() == 12 * act * 2 * 3 / 4
    sp_lp = c.megatron_minimum(c.CASES["llama_sp_loss_parallel"], s, 4, norm_params=7 * 16)
    # 12 AG + 12 RS in the layers, embedding RS + AG, head AG + RS, 3 scalar-per-token ARs, 1 bucketed AR
    assert sp_lp.kinds() == "4 AR + 14 AG + 14 RS"
    assert sp_lp.buffer() == 28 * act + 3 * 2 * 8 * 4 + 7 * 16 * 4


def test_report(results):
    """The README section from the results the tests above wrote (run after them)."""
    if not (results / "step_time.json").exists():
        pytest.skip("needs the results of the benchmark tests above")
    text = _run([str(BENCH / "report.py"), "--results", str(results)])
    assert text.startswith("## Performance")
    for heading in ("**Step time**", "**Communication per training step**", "**Transform time**", "**Memory per rank**"):
        assert heading in text
    step = json.loads((results / "step_time.json").read_text())["results"]["ratios"][0]
    assert f"**{step['fxshard_vs_megatron']:.2f}**" in text and f"**{step['fxshard_vs_dtensor']:.2f}**" in text


# HF families the equivalence tests do not build (tests/test_hf_models.py has Llama, Qwen2/3,
# Phi3, Gemma, GPT-2, Mistral; tests/test_hf_moe.py the MoE ones), and two a correct fxshard
# must refuse (doge, gemma3n_text).
# a family per quirk (sliding windows, q/k norms over the projected width, partial rotary, fused qkv,
# parallel attention + MLP, layer norms, MoE, and the two refusals); every family: the script itself
CONFORMANCE = ["gemma3_text", "olmo2", "glm4", "starcoder2", "phi", "gpt_neox", "cohere", "hrm_text", "mixtral",
               "qwen3_moe", "doge", "gemma3n_text"]


@pytest.mark.sweep  # every HF decoder family: .ci/run's second stage
def test_hf_conformance(results):
    """Every family: exact or a PlanError that says why; no crash, no wrong number."""
    pytest.importorskip("transformers")
    out = results / "hf_conformance.json"
    text = _run([str(BENCH / "hf_conformance.py"), "--families", ",".join(CONFORMANCE), "--no-hf", "--quiet",
                 "--out", str(out)], timeout=900)
    assert "crash 0, wrong 0" in text
    rows = {r["family"]: r for r in _results(out)["rows"]}
    assert set(rows) == set(CONFORMANCE)
    for family in CONFORMANCE[:-2]:
        assert rows[family]["exact"] == "yes", rows[family]
    for family in ("doge", "gemma3n_text"):
        assert str(rows[family]["transformed"]).startswith("PlanError"), rows[family]


def test_auto_plan_benchmark(results):
    """auto_plan against HF's plan: strictly fewer wire bytes on Phi-3 (OLMo2 too: tests/planner/test_auto_plan.py)."""
    pytest.importorskip("transformers")
    out = results / "auto_plan.json"
    _run([str(BENCH / "auto_plan.py"), "--families", "phi3", "--out", str(out)], timeout=600)
    rows = {r["family"]: r for r in _results(out)}
    assert set(rows) == {"phi3"}
    for r in rows.values():
        assert r["auto_wire_bytes"] < r["hf_wire_bytes"], r


def test_context_parallel_benchmark(tmp_path):
    out = tmp_path / "cp.json"
    text = _run([str(BENCH / "context_parallel.py"), "--cp", "2", "--no-memory", "--out", str(out)])
    assert "allgather" in text and "ring" in text
    comm = json.loads(out.read_text())["results"]["comm"]
    assert all(r["fwd_bytes"] == r["fwd_analytical"] == r["fwd_measured"] and
               r["bwd_bytes"] == r["bwd_analytical"] == r["bwd_measured"] for r in comm)


def test_trainer_benchmark(results):
    """benchmarks/trainer.py: the trainer and the plain loop run the same steps; both figures are printed."""
    out = results / "trainer.json"
    text = _run([str(BENCH / "trainer.py"), "--hidden", "64", "--layers", "2", "--heads", "4", "--seq", "32",
                 "--steps", "4", "--warmup", "1", "--repeats", "1", "--out", str(out)], timeout=300)
    assert "python -m fxshard train" in text and "plain HF + AdamW" in text
    results_ = _results(out)
    rows = {r["loop"]: r for r in results_["loops"]}
    assert rows["plain HF + AdamW"]["tokens_per_s"] > 0 and rows["python -m fxshard train"]["tokens_per_s"] > 0
    assert rows["python -m fxshard train"]["tflops"] > 0 and rows["python -m fxshard train"]["mfu"] is None  # no CPU peak
    # the planner's predicted peak beside the measured one (a CPU's resident set: shown, not compared)
    memory = results_["memory"]
    assert memory["predicted_gib"] > 0 and memory["measured_gib"] > 0 and "not comparable" in memory["measured_as"]
    assert "peak memory: predicted" in text
