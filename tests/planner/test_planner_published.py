"""The planner against torchtitan's published Llama 3.1 runs (``benchmarks/planner.py --published``,
docs/planning.md): the bf16 runs (8B FSDP with selective checkpointing on 8 and 128 H100s),
planned from config.json on the meta device with their own mesh, AC mode and batch on the
constants of their machine, are predicted within 25% of the published memory and 30% of the
published tokens/s per GPU, and the planner's own choice for the same GPUs is at least as fast."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)

BENCHMARK = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "planner.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("planner_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bf16_runs_within_the_bars(tmp_path):
    rows = _benchmark().published_rows(str(tmp_path), precision="bf16")
    assert [r["run"] for r in rows] == ["T1 Llama-3.1-8B", "T3 Llama-3.1-8B"]
    for r in rows:
        assert r["fits"] == "yes", r
        assert 0.75 <= r["mem_ratio"] <= 1.25, (r["run"], r["pred_gib"], r["pub_gib"])
        assert 0.7 <= r["tps_ratio"] <= 1.3, (r["run"], r["pred_tps"], r["pub_tps"])
        assert r["best_tps"] >= r["pred_tps"] * (1 - 1e-9), (r["run"], r["best"], r["best_tps"])
