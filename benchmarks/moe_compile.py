"""torch.compile on HF MoE models sharded by fxshard: graph breaks, and a compiled training
step against eager.

For each family and mesh, on 2 real gloo ranks: the tiny model
(:func:`fxshard.testing.hf_tiny.tiny_model`) sharded with ``Plan.from_hf``;
``torch._dynamo.explain`` counts the graphs and graph breaks of the transformed module
(each reason listed with its source line); then ``torch.compile(..., backend="aot_eager",
fullgraph=True)`` runs forward + backward and its loss and gradients are compared with
eager's.

    python benchmarks/moe_compile.py                                  # Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
    python benchmarks/moe_compile.py --families mixtral --meshes ep2
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, describe_machine, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from harness import make_mesh, spawn  # noqa: E402


MESHES = {"ep2": {"ep": 2}, "tp2": {"tp": 2}}


def _worker(rank: int, world: int, families: list[str], meshes: list[str], out: str) -> None:
    warnings.filterwarnings("ignore")
    import json

    import torch._dynamo

    import fxshard
    from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

    rows = []
    for mesh_name in meshes:
        mesh = make_mesh(MESHES[mesh_name])
        for family in families:
            model = tiny_model(family)
            ids, labels = tiny_inputs()
            kw = {"input_ids": ids, "labels": labels}
            gm = fxshard.transform(model, fxshard.Plan.from_hf(mesh, model), example_kwargs=kw)
            torch._dynamo.reset()
            ex = torch._dynamo.explain(gm)(**kw)
            reasons = {}
            for b in ex.break_reasons:
                frame = b.user_stack[-1] if b.user_stack else None
                key = f"{os.path.basename(frame.filename)}:{frame.lineno}: " if frame else ""
                key += str(b.reason).splitlines()[0][:160]
                reasons[key] = reasons.get(key, 0) + 1
            eager = gm(**kw)
            eager.loss.backward()
            grads = {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}
            for p in gm.parameters():
                p.grad = None
            torch._dynamo.reset()
            fullgraph = ex.graph_break_count == 0
            compiled = torch.compile(gm, backend="aot_eager", fullgraph=fullgraph)
            got = compiled(**kw)
            got.loss.backward()
            grad_diff = max((p.grad - grads[n]).abs().max().item() for n, p in gm.named_parameters() if n in grads)
            rows.append(dict(family=family, mesh=mesh_name, graphs=ex.graph_count, breaks=ex.graph_break_count,
                             reasons=reasons, fullgraph=fullgraph, loss_diff=abs(float(got.loss - eager.loss)),
                             grad_diff=grad_diff))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="mixtral,qwen2_moe,qwen3_moe,deepseek_v3")
    p.add_argument("--meshes", default="ep2,tp2", help=f"comma-separated, of {sorted(MESHES)}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import json
    import tempfile

    families, meshes = args.families.split(","), args.meshes.split(",")
    print(f"MoE under torch.compile: {families} x {meshes}, 2 gloo ranks; machine: {describe_machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        spawn(_worker, 2, families, meshes, path)
        rows = json.loads(Path(path).read_text())
    for r in rows:
        print(f"{r['family']:12s} {r['mesh']}: {r['graphs']} graph(s), {r['breaks']} graph break(s); compiled "
              f"(aot_eager, fullgraph={r['fullgraph']}) loss diff {r['loss_diff']:.2g}, grads diff {r['grad_diff']:.2g}")
        for reason, n in r["reasons"].items():
            print(f"    x{n} {reason}")
    print(f"results: {write_json('moe_compile', vars(args), dict(rows=rows), args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
