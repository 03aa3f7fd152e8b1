"""Pipeline conformance: every transformers decoder family that ships a TP plan, cut into
pipeline stages by fxshard and trained 2 steps on real gloo ranks, against one device.

For each family of :func:`fxshard.testing.hf_tiny.decoder_families` (or ``--families``):

1. the tiny model with 4 decoder layers (``tests/pipeline/test_train_step.py``
   ``four_block_model``: hidden 64, vocab 128, the family's own ``tie_word_embeddings``
   default, a per-layer ``layer_types`` repeated to 4);
2. ``--mesh pp=2``: ``fxshard.pipeline_transform(model, None, mesh, spec=pipeline("pp",
   microbatches=2, schedule="1F1B"))``; ``--mesh pp=2,tp=2``: the family's own
   ``fxshard.Plan.from_hf(mesh["tp"], model)`` inside each stage; transformed with other
   example tensors (batch 2, sequence 6) than it runs with;
3. on ``pp * tp`` gloo processes (127.0.0.1, one thread each): 2 AdamW steps through
   ``fxshard.train_step`` and ``fxshard.clip_grad_norm_`` (max norm 0.5, which clips) on a
   batch of 4 x 8 tokens whose labels are other tokens than the ids, with -100 padding;
   the loss and the gradient norm of each step, the gradients of the first step (pp
   alone), every full parameter after the steps (``fxshard.full_state_dict``), a step on
   another batch size and sequence length and gradient accumulation (pp alone) against one
   device (``check_case`` of ``tests/pipeline/test_train_step.py``, imported, atol 1e-5).

Verdicts: ``exact``; ``PlanError`` (fxshard refused, with its first line); ``crash`` (any
other exception, a finding); ``wrong`` (a number above the tolerance, a finding);
``timeout`` (the family's ranks still ran after ``--timeout`` s, killed); ``no tiny
model`` (the family cannot be built at tiny size, ``TinyBuildError``).  The first failure
in time over the ranks is the verdict (a peer's failure often makes the others fail).

    python benchmarks/pipeline_conformance.py                                # every family, pp=2
    python benchmarks/pipeline_conformance.py --mesh pp=2,tp=2 --markdown    # + the HF plan on tp
    python benchmarks/pipeline_conformance.py --families llama,gpt2,qwen3 --timeout 120
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, describe_machine, table, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "pipeline"))
from harness import spawn  # noqa: E402  (tests/: a spawn with a timeout that kills the ranks)
from test_train_step import check_case  # noqa: E402  (the one-device comparison of the test suite)

import fxshard  # noqa: E402
from fxshard.testing.hf_tiny import TinyBuildError, decoder_families  # noqa: E402

COLUMNS = [
    ("family", "family", ""),
    ("mesh", "mesh", ""),
    ("verdict", "verdict", ""),
    ("detail", "detail", ""),
    ("seconds", "s", ".0f"),
]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def verdict_of(e: BaseException) -> tuple[str, str]:
    """``(verdict, detail)`` of the exception a rank raised."""
    if isinstance(e, fxshard.PlanError):
        return "PlanError", _first_line(e)
    if isinstance(e, TinyBuildError):
        return "no tiny model", _first_line(e)
    if isinstance(e, AssertionError):  # check_case's comparisons with one device: what and by how much
        lines = str(e).strip().splitlines()
        worst = [ln.strip() for ln in lines if "Greatest absolute" in ln]
        return "wrong", (lines[0] if lines else "AssertionError")[:160] + (f" ({worst[0]})" if worst else "")
    return "crash", f"{type(e).__name__}: {_first_line(e)}"


def _rank(rank: int, world_size: int, family: str, mesh_shape: dict, out_dir: str) -> None:
    """One rank of one family: ``check_case``, its outcome written to ``out_dir/rank<r>.json``."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    import test_train_step

    test_train_step.MAX_NORM = 0.05  # below every family's norm (Cohere's scaled logits make ~0.3): clipping acts
    record = {"rank": rank}
    try:
        check_case(family, mesh_shape, "1F1B", 2, 1, mesh_shape.get("tp", 1) > 1)
        record.update(verdict="exact", detail="", time=time.time())
    except BaseException as e:  # noqa: BLE001 - every outcome is a verdict
        verdict, detail = verdict_of(e)
        record.update(verdict=verdict, detail=detail, time=time.time(),
                      traceback="".join(traceback.format_exception(e))[-4000:])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        raise
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def run_family(family: str, mesh_shape: dict, timeout: float) -> dict:
    """Spawn the family's ranks; the row of its verdict (the earliest failure over the ranks)."""
    world = 1
    for n in mesh_shape.values():
        world *= n
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_error = None
        try:
            spawn(_rank, world, family, mesh_shape, out_dir, timeout=timeout)
        except TimeoutError as e:
            spawn_error = ("timeout", _first_line(e))
        except Exception as e:  # noqa: BLE001 - the ranks' own records say why
            spawn_error = ("crash", _first_line(e))
        records = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    failed = sorted((r for r in records if r["verdict"] != "exact"), key=lambda r: r["time"])
    row = {"family": family, "mesh": ",".join(f"{k}={v}" for k, v in mesh_shape.items() if v > 1),
           "seconds": time.perf_counter() - t0}
    if failed:
        row.update(verdict=failed[0]["verdict"], detail=failed[0]["detail"], rank=failed[0]["rank"],
                   traceback=failed[0].get("traceback", ""))
    elif spawn_error is not None or len(records) < world:
        verdict, detail = spawn_error or ("crash", "a rank exited without a record")
        row.update(verdict=verdict, detail=detail)
    else:
        row.update(verdict="exact", detail="")
    return row


def parse_mesh(text: str) -> dict:
    shape = {}
    for part in text.split(","):
        axis, n = part.split("=")
        shape[axis.strip()] = int(n)
    if "pp" not in shape:
        raise SystemExit(f"--mesh {text!r}: needs a pp axis")
    shape.setdefault("tp", 1)  # check_case's plans look up mesh["tp"]
    return shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="pp=2", help="pp=2 or pp=2,tp=2")
    ap.add_argument("--families", default=None, help="comma-separated model_types (default: every family)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per family")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--out", default=None, help="results JSON path")
    args = ap.parse_args()
    mesh_shape = parse_mesh(args.mesh)
    families = args.families.split(",") if args.families else decoder_families()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(describe_machine(), flush=True)
    rows = []
    for family in families:
        row = run_family(family, mesh_shape, args.timeout)
        rows.append(row)
        print(f"{family:24s} {row['verdict']:10s} {row['seconds']:5.0f} s  {row['detail']}", flush=True)
        if row["verdict"] in ("crash", "wrong") and row.get("traceback"):
            print("    " + "\n    ".join(row["traceback"].strip().splitlines()[-24:]), flush=True)
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print("\n" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.markdown:
        print("\n| family | verdict | detail |\n|---|---|---|")
        for r in rows:
            print(f"| {r['family']} | {r['verdict']} | {r['detail'].replace('|', '/')} |")
    else:
        print(table(rows, COLUMNS))
    write_json("pipeline_conformance", {"mesh": mesh_shape, "families": families}, rows, args.out)


if __name__ == "__main__":
    main()
