"""The planner's ranking against measured step times on 4 real gloo ranks.

The ranks first measure the constants of the roofline (``fxshard.planner.calibrate``: rank 0
alone times matmuls, a copy and small kernels, then all four time gloo all-reduces over the
world), then time a few candidates of a small Llama, round-robin (the fastest of 6 steps each).
Among candidates whose predicted times differ by more than 25%, the faster predicted must be
the faster measured: the planner's order where it claims a difference.

The candidates: tensor parallelism, pipelines, and both, with and without recomputation.  FSDP2
(dp) is not among them: on a CPU its copies in and out of the flat buffers and its hooks cost
more than the transfers the planner counts (docs/planning.md, "Limits").
"""
from __future__ import annotations

import itertools

import pytest

pytest.importorskip("transformers")

import fxshard  # noqa: E402
from fxshard.planner import Calibration  # noqa: E402
from fxshard.trainer.models import ModelSource  # noqa: E402

try:
    from harness import spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import spawn
from real_ranks import calibrate_and_measure, read_results  # noqa: E402

MODEL = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 64}
SEQ, BATCH = 128, 8
MESHES = {"tp=4": 1, "pp=2,tp=2": 2, "pp=4": 4}  # mesh: micro-batches
NAMES = [m + ac for m in MESHES for ac in ("", "+ac")]


@pytest.mark.isolated  # measures step times: alone, after the others (another worker's load reorders close ones)
def test_predicted_order_is_the_measured_order(tmp_path):
    configs = [dict(name=n, model="llama", overrides=MODEL, mesh=n.removesuffix("+ac"), seq=SEQ, batch=BATCH,
                    microbatches=MESHES[n.removesuffix("+ac")], ac=n.endswith("+ac"), timed=6) for n in NAMES]
    spawn(calibrate_and_measure, 4, configs, str(tmp_path))
    measured = {n: max(r[n]["seconds"] for r in read_results(str(tmp_path), 4)) for n in NAMES}
    cal = Calibration.load(str(tmp_path / "calibration.json"))
    source = ModelSource.resolve("llama", MODEL)
    source.positions = SEQ
    candidates = [{**{k: int(v) for k, v in (p.split("=") for p in c["mesh"].split(","))}, "microbatches": c["microbatches"],
                   "activation_checkpointing": c["ac"]} for c in configs]
    entries = fxshard.plan_parallelism(source.build(meta=False), 4, memory_gib=100, seq=SEQ, global_batch=BATCH, device=cal,
                                       dtype="fp32", candidates=candidates)
    predicted = {e.mesh_spec + ("+ac" if e.activation_checkpointing == "full" else ""): e.step_time_s for e in entries}
    report = "\n".join(f"  {n}: predicted {predicted[n]:.3f} s, measured {measured[n]:.3f} s" for n in NAMES)
    pairs = [(a, b) for a, b in itertools.combinations(NAMES, 2)
             if max(predicted[a], predicted[b]) > 1.25 * min(predicted[a], predicted[b])]
    print(f"{cal.describe()}\n{report}")  # pytest -s shows the figures
    assert pairs, f"no two candidates predicted more than 25% apart:\n{report}"
    wrong = [(a, b) for a, b in pairs if (predicted[a] < predicted[b]) != (measured[a] < measured[b])]
    assert not wrong, f"predicted order differs from the measured for {wrong}; {cal.describe()}\n{report}"
