"""torch.compile on HF MoE models sharded by fxshard: graph breaks, and a compiled training
step against eager.

For each family and mesh, on 2 real gloo ranks: the tiny model
(:func:`fxshard.testing.hf_tiny.tiny_model`) sharded with ``Plan.from_hf`` (``ep2``,
``tp2``), or with the batch sharded over ep and its tokens dispatched to their experts'
ranks (``ep2-dispatch``: ``routed_experts(dispatch="all_to_all")``, a loss of the logits,
``torch._dynamo.config.capture_scalar_outputs`` on for the all-to-all splits);
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


MESHES = {"ep2": {"ep": 2}, "tp2": {"tp": 2}, "ep2-dispatch": {"ep": 2}}


def _setup(mesh, mesh_name: str, model, rank: int):
    """(plan, example kwargs, this rank's kwargs, loss of the output) for one mesh."""
    import fxshard
    from fxshard.testing.hf_tiny import tiny_inputs
    from torch.distributed.tensor import Shard

    ids, labels = tiny_inputs()
    if mesh_name != "ep2-dispatch":
        kw = {"input_ids": ids, "labels": labels}
        return fxshard.Plan.from_hf(mesh, model), kw, kw, lambda out: out.loss
    spec = fxshard.routed_experts(ep="ep", tokens=Shard(0), dispatch="all_to_all")
    plan = fxshard.Plan(mesh, {"model.layers.*.mlp.experts": spec}, inputs={"input_ids": {"ep": Shard(0)}})
    return plan, {"input_ids": ids}, {"input_ids": ids.chunk(2)[rank]}, lambda out: out.logits.float().pow(2).mean()


def _worker(rank: int, world: int, families: list[str], meshes: list[str], out: str) -> None:
    warnings.filterwarnings("ignore")
    import json

    import torch._dynamo

    import fxshard
    from fxshard.testing.hf_tiny import tiny_model

    rows = []
    for mesh_name in meshes:
        mesh = make_mesh(MESHES[mesh_name])
        for family in families:
            model = tiny_model(family)
            plan, example, kw, loss_of = _setup(mesh, mesh_name, model, rank)
            gm = fxshard.transform(model, plan, example_kwargs=example)
            # the all-to-all splits are read from the exchanged counts (.tolist()): as unbacked
            # sizes dynamo keeps them in the graph; without this they break it (data-dependent)
            torch._dynamo.config.capture_scalar_outputs = mesh_name == "ep2-dispatch"
            torch._dynamo.reset()
            ex = torch._dynamo.explain(gm)(**kw)
            reasons = {}
            for b in ex.break_reasons:
                frame = b.user_stack[-1] if b.user_stack else None
                key = f"{os.path.basename(frame.filename)}:{frame.lineno}: " if frame else ""
                key += str(b.reason).splitlines()[0][:160]
                reasons[key] = reasons.get(key, 0) + 1
            eager = loss_of(gm(**kw))
            eager.backward()
            grads = {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}
            for p in gm.parameters():
                p.grad = None
            torch._dynamo.reset()
            fullgraph = ex.graph_break_count == 0
            compiled = torch.compile(gm, backend="aot_eager", fullgraph=fullgraph)
            got = loss_of(compiled(**kw))
            got.backward()
            grad_diff = max((p.grad - grads[n]).abs().max().item() for n, p in gm.named_parameters() if n in grads)
            rows.append(dict(family=family, mesh=mesh_name, graphs=ex.graph_count, breaks=ex.graph_break_count,
                             reasons=reasons, fullgraph=fullgraph, loss_diff=abs(float(got - eager)),
                             grad_diff=grad_diff))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="mixtral,qwen2_moe,qwen3_moe,deepseek_v3")
    p.add_argument("--meshes", default="ep2,tp2,ep2-dispatch", help=f"comma-separated, of {sorted(MESHES)}")
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
