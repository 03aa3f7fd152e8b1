"""Third-party conformance: model code fxshard did not write, sharded at tp=2 and
compared with one device.

The cases are :func:`fxshard.conformance.third_party.cases`: litgpt's ``GPT`` from its own
configs (auto_plan), torchtune's component builders with torchtune's own TP plan
(``base_llama_tp_plan`` through ``Plan.from_torch``), transformers' encoders,
encoder-decoders and vision transformers, which ship no TP plan (auto_plan).  Each is
checked by ``tests/equivalence.py``'s ``check_simulated`` on a simulated ``{"tp": 2}``
mesh (one process): transformed with other example tensors (same-shaped ones aliased),
then every rank's loss, output, input and parameter gradients (each rank's shard against
the matching slice) at 2 SGD steps and after them, against one device.

Verdicts: ``exact``; ``PlanError (expected)`` (a refusal the case lists with its reason) or
``PlanError`` (one it does not: a finding until justified), with its first line; ``internal error`` (an ``fxshard.InternalError``, or
any other exception); ``wrong`` (a comparison failed; it is rerun in float64 at 1e-9, and ``wrong (float64: exact)`` means
the float32 difference is summation order: raise the case's tolerance).  ``sharded`` is the share of
parameter elements the plan shards (a plan that shards nothing is exact for nothing).

    python benchmarks/third_party.py                 # every case, tp=2
    python benchmarks/third_party.py --library litgpt --markdown
    python benchmarks/third_party.py --only "transformers/T5" -v   # the traceback of a failure
    python benchmarks/third_party.py --float64       # float64 at 1e-9: summation order ruled out
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, describe_machine, table, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from equivalence import check_simulated  # noqa: E402  (tests/: the project's independent oracle)

import torch  # noqa: E402

import fxshard  # noqa: E402
from fxshard.conformance.third_party import NOT_INSTALLABLE, cases  # noqa: E402
from fxshard.meta import program_meta  # noqa: E402

COLUMNS = [
    ("library", "library", ""),
    ("model", "model", ""),
    ("plan", "plan source", ""),
    ("result", "result", ""),
    ("sharded", "sharded", ""),
    ("error", "first line of the error", ""),
    ("seconds", "s", ".1f"),
]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def sharded_share(sharded) -> str:
    """Share of the model's parameter elements that the plan shards on some axis."""
    state = (program_meta(sharded).state or {})
    names = {n for n, _ in sharded.named_parameters(remove_duplicate=False)}
    total = part = 0
    for fqn, (layout, shape) in state.items():
        if fqn not in names or shape is None:
            continue
        n = math.prod(shape)
        total += n
        if layout and any(isinstance(p, torch.distributed.tensor.Shard) for p in layout.values()):
            part += n
    return f"{100 * part / total:.0f}%" if total else "-"


def run_case(case, tp: int = 2) -> dict:
    """Check one case; returns its row (``verdict``: exact / PlanError / internal error / wrong)."""
    import re

    row = dict(library=case.library, model=case.model, plan=case.plan_source, result=None, sharded="", error="",
               verdict=None)
    t0 = time.perf_counter()
    kw = case.check_kwargs()
    torch.set_grad_enabled(True)
    try:  # the model must run on one device, or the case (not fxshard) is wrong
        args, kwargs, targets = case.batch()
        with torch.no_grad():
            case.build()(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        row.update(verdict="case does not run", result="case does not run", error=f"{type(e).__name__}: {first_line(e)}",
                   traceback=traceback.format_exc(), seconds=time.perf_counter() - t0)
        return row
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sharded = check_simulated(case.build, case.plan, kw.pop("inputs"), {"tp": tp}, **kw)
        row["verdict"] = "exact"
        row["sharded"] = sharded_share(sharded)
    except fxshard.PlanError as e:
        internal = first_line(e).startswith("internal error")
        row["verdict"] = "internal error" if internal else "PlanError"
        row["error"] = first_line(e)
        row["traceback"] = traceback.format_exc()
        if not internal and case.refusal:
            row["verdict"] = "PlanError (expected)" if re.search(case.refusal, str(e)) else "PlanError (other than expected)"
    except AssertionError as e:
        row["verdict"] = "wrong"
        row["error"] = first_line(e)
        row["traceback"] = traceback.format_exc()
    except Exception as e:  # noqa: BLE001 - anything else is a finding
        row["verdict"] = "internal error"
        row["error"] = f"{type(e).__name__}: {first_line(e)}"
        row["traceback"] = traceback.format_exc()
    if case.refusal and row["verdict"] == "exact":
        row["verdict"] = "exact (a refusal was expected)"
    row["result"] = row["verdict"]
    row["seconds"] = time.perf_counter() - t0
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--library", help="comma-separated: litgpt, torchtune, transformers")
    ap.add_argument("--only", help="semicolon-separated case names (library/model)")
    ap.add_argument("--markdown", action="store_true", help="a README table")
    ap.add_argument("--float64", action="store_true", help="every case in float64, checked at 1e-9")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the traceback of every failure")
    ap.add_argument("--out", help="results file (default benchmarks/results/third_party.json)")
    args = ap.parse_args(argv)
    libs = tuple(args.library.split(",")) if args.library else None
    todo = cases(libs)
    if args.only:
        names = set(args.only.split(";"))
        todo = [c for c in todo if c.name in names]
    if args.float64:
        todo = [c.in_float64() for c in todo]
    rows = []
    for c in todo:
        row = run_case(c, args.tp)
        if row["verdict"] == "wrong" and not args.float64:  # summation order, or a wrong number?
            again = run_case(c.in_float64(), args.tp)
            row["float64"] = again["verdict"]
            row["verdict"] = row["result"] = "wrong (float64: exact)" if again["verdict"] == "exact" else "wrong"
        rows.append(row)
        print(f"{c.name:45s} {row['verdict']:16s} {row['sharded']:>5s} {row['seconds']:5.1f}s  {row['error'][:150]}",
              flush=True)
        if args.verbose and row.get("traceback"):
            print("\n".join(row["traceback"].splitlines()[-25:]))
    if args.markdown:
        print("\n| library | model | plan source | result | sharded | first line of the error |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            err = r["error"].replace("|", "\\|")[:160]
            print(f"| {r['library']} | {r['model']} | {r['plan']} | {r['result']} | {r['sharded']} | {err} |")
    else:
        print()
        print(table(rows, COLUMNS))
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(f"\n{len(rows)} cases at tp={args.tp}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for lib, why in NOT_INSTALLABLE.items():
        print(f"not in the sweep: {lib}: {why}")
    print(describe_machine())
    write_json("third_party", dict(tp=args.tp, library=args.library, only=args.only),
               [{k: v for k, v in r.items()} for r in rows], args.out)
    bad = [r for r in rows if r["verdict"] in ("internal error", "wrong", "PlanError", "PlanError (other than expected)",
                                               "case does not run")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
