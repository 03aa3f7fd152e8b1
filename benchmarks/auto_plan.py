"""auto_plan against each model's own plan: collectives and wire bytes per training step.

For each HF family (a tiny config built from its config class, random weights) the
model is transformed twice on a ``tp`` MeshSpec, with ``Plan.from_hf`` and with
``fxshard.auto_plan``, and the static ``fxshard.comm_summary`` of each is printed:
calls forward / backward and the bytes one rank sends with ring algorithms.  A plan
that fails to transform is shown with its PlanError.  Exactness is the tests' job
(``tests/planner/test_auto_plan.py`` checks Phi-3 and OLMo2 against the single-device model).

    python benchmarks/auto_plan.py                       # tp=2, the families below
    python benchmarks/auto_plan.py --tp 4 --families llama,phi3,olmo2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, table, write_json  # noqa: E402

import torch  # noqa: E402

import fxshard  # noqa: E402
from fxshard import MeshSpec, Plan, PlanError  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite", "gpt2"]
V = 128


def model_of(family: str, tp: int):
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4 * max(1, tp // 2), n_positions=64)
    else:
        cfg = transformers.AutoConfig.for_model(
            family, vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4 * max(1, tp // 2), num_key_value_heads=2 * max(1, tp // 2), head_dim=16 // max(1, tp // 2),
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def summary(model, plan, batch) -> tuple[str, int]:
    gm = fxshard.transform(model, plan, example_kwargs=batch)
    s = fxshard.comm_summary(gm)
    rows = s.select()
    fwd = ", ".join(f"{t.count} {t.kind}" for t in s.totals if t.phase == "forward") or "-"
    bwd = ", ".join(f"{t.count} {t.kind}" for t in s.totals if t.phase == "backward") or "-"
    return f"{fwd} / {bwd}", sum(r.wire_bytes for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/auto_plan.json)")
    a = ap.parse_args()
    mesh = MeshSpec(("tp",), (a.tp,))
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, V, (2, 8), generator=g), "labels": torch.randint(3, V, (2, 8), generator=g)}
    rows = []
    keys = ("hf_calls", "hf_wire", "hf_time", "auto_calls", "auto_wire", "auto_time")
    for family in a.families.split(","):
        model = model_of(family, a.tp)
        row, wires = {"family": family}, []
        for prefix, make in (("hf", lambda: Plan.from_hf(mesh, model)),
                             ("auto", lambda: fxshard.auto_plan(model, mesh, example_kwargs=batch))):
            t = time.perf_counter()
            try:
                row[f"{prefix}_calls"], wire = summary(model, make(), batch)
                row[f"{prefix}_wire"], row[f"{prefix}_wire_bytes"] = fmt_bytes(wire), wire
                wires.append(wire)
            except PlanError as e:
                row[f"{prefix}_calls"] = f"PlanError: {str(e).splitlines()[0][:60]}"
                wires.append(None)
            row[f"{prefix}_time"] = f"{time.perf_counter() - t:.1f} s"
        if None not in wires and wires[0]:
            row["ratio"] = wires[1] / wires[0]
        rows.append(row)
        print(family, *(row.get(k, "-") for k in keys), flush=True)
    print()
    print(table(rows, [("family", "family", ""), ("hf_calls", "HF plan: calls fwd / bwd", ""), ("hf_wire", "wire", ""),
                       ("auto_calls", "auto_plan: calls fwd / bwd", ""), ("auto_wire", "wire", ""),
                       ("auto_time", "auto_plan + transform", ""), ("ratio", "auto / HF", ".2f")]))
    print(f"wrote {write_json('auto_plan', {'tp': a.tp, 'families': a.families.split(',')}, rows, a.out)}")

if __name__ == "__main__":
    main()
