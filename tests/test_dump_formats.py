"""fxshard.dump_formats: JSON / DOT goldens of a small transformed MLP, networkx round trip, render.

Goldens are ``expecttest`` inline strings: after an intended change of placements or
format, regenerate them with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_dump_formats.py``
and review the diff.  Source lines are written relative to ``MLP.forward`` so that
edits elsewhere in models.py do not touch the goldens.
"""
from __future__ import annotations

import inspect
import json
import re
import shutil

import expecttest
import networkx as nx
import pytest
import torch

import fxshard
from fxshard import MeshSpec, Plan, colwise, rowwise
from fxshard.debug.formats import render, to_dot, to_json, to_networkx
from fxshard.layout.placements import fmt_placement
from fxshard.meta import KEY, TensorInfo
from fxshard.testing.models import MLP, llama, llama_plan, mlp, tokens


def _mlp_sharded():
    model = mlp(dim=8, hidden=16)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    return fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), {"fc1": colwise(), "fc2": rowwise()}), (x,))


def _portable(text: str) -> str:
    """``models.py:463`` -> ``models.py:forward+1`` (line relative to MLP.forward)."""
    first = inspect.getsourcelines(MLP.forward)[1]
    return re.sub(r"models\.py:(\d+)", lambda m: f"models.py:forward+{int(m.group(1)) - first}", text)


class TestGoldens(expecttest.TestCase):
    def test_json(self):
        text = to_json(_mlp_sharded())
        json.loads(text)  # valid JSON
        self.assertExpectedInline(_portable(text), """\
{"model": "MLP", "mesh": {"tp": 2},
"nodes": [
  {"name": "x", "op": "placeholder", "target": "x", "layout": {"tp": "R"}, "local_shape": [2, 8], "shape": [2, 8], "dtype": "float32", "module": "", "source": null, "rule": "plan input", "collective": null},
  {"name": "fc1_weight", "op": "get_attr", "target": "fc1.weight", "layout": {"tp": "S(0)"}, "local_shape": [8, 8], "shape": [16, 8], "dtype": "float32", "module": "fc1", "source": "models.py:forward+1", "rule": "plan param", "collective": null},
  {"name": "fc1_bias", "op": "get_attr", "target": "fc1.bias", "layout": {"tp": "S(0)"}, "local_shape": [8], "shape": [16], "dtype": "float32", "module": "fc1", "source": "models.py:forward+1", "rule": "plan param", "collective": null},
  {"name": "grad_sync", "op": "call_function", "target": "fxshard.grad_sync", "layout": {"tp": "R"}, "local_shape": [2, 8], "shape": [2, 8], "dtype": "float32", "module": "fc1", "source": "models.py:forward+1", "rule": "grad sync", "collective": {"op": "grad_sync", "axis": "tp", "fwd": "identity", "bwd": "all-reduce", "purpose": "grad of x"}},
  {"name": "linear", "op": "call_function", "target": "F.linear", "layout": {"tp": "S(1)"}, "local_shape": [2, 8], "shape": [2, 16], "dtype": "float32", "module": "fc1", "source": "models.py:forward+1", "rule": "linear", "collective": null},
  {"name": "gelu", "op": "call_function", "target": "F.gelu", "layout": {"tp": "S(1)"}, "local_shape": [2, 8], "shape": [2, 16], "dtype": "float32", "module": "", "source": "models.py:forward+2", "rule": "pointwise (nonlinear)", "collective": null},
  {"name": "fc2_weight", "op": "get_attr", "target": "fc2.weight", "layout": {"tp": "S(1)"}, "local_shape": [8, 8], "shape": [8, 16], "dtype": "float32", "module": "fc2", "source": "models.py:forward+3", "rule": "plan param", "collective": null},
  {"name": "fc2_bias", "op": "get_attr", "target": "fc2.bias", "layout": {"tp": "R"}, "local_shape": [8], "shape": [8], "dtype": "float32", "module": "fc2", "source": "models.py:forward+3", "rule": "replicated param", "collective": null},
  {"name": "linear_1", "op": "call_function", "target": "F.linear", "layout": {"tp": "P"}, "local_shape": [2, 8], "shape": [2, 8], "dtype": "float32", "module": "fc2", "source": "models.py:forward+3", "rule": "linear", "collective": null},
  {"name": "all_reduce", "op": "call_function", "target": "fxshard.all_reduce", "layout": {"tp": "R"}, "local_shape": [2, 8], "shape": [2, 8], "dtype": "float32", "module": "fc2", "source": "models.py:forward+3", "rule": "redistribute", "collective": {"op": "all_reduce", "axis": "tp", "fwd": "all-reduce", "bwd": "identity", "purpose": "output 'output' of fc2"}},
  {"name": "add", "op": "call_function", "target": "operator.add", "layout": {"tp": "R"}, "local_shape": [2, 8], "shape": [2, 8], "dtype": "float32", "module": "fc2", "source": "models.py:forward+3", "rule": "deferred bias", "collective": null},
  {"name": "output", "op": "output", "target": "output", "layout": null, "local_shape": null, "shape": null, "dtype": null, "module": "", "source": null, "rule": null, "collective": null}
],
"edges": [
  ["x", "grad_sync"],
  ["grad_sync", "linear"],
  ["fc1_weight", "linear"],
  ["fc1_bias", "linear"],
  ["linear", "gelu"],
  ["gelu", "linear_1"],
  ["fc2_weight", "linear_1"],
  ["linear_1", "all_reduce"],
  ["all_reduce", "add"],
  ["fc2_bias", "add"],
  ["add", "output"]
]}
""")

    def test_dot(self):
        self.assertExpectedInline(_portable(to_dot(_mlp_sharded())), """\
digraph "MLP" {
  graph [label="MLP  mesh: tp=2", labelloc="t", rankdir="TB", fontname="Helvetica"];
  node [shape="box", style="filled,rounded", fontname="Helvetica", fontsize="10"];
  edge [color="#555555"];
  "x" [label="x\\ntp=R  [2, 8]", fillcolor="#e0e0e0", tooltip="<top level>  global [2, 8]", shape="invhouse"];
  "gelu" [label="gelu\\nF.gelu\\ntp=S(1)  [2, 8]", fillcolor="#9ecae1", tooltip="<top level>  models.py:forward+2  global [2, 16]"];
  "output" [label="output", fillcolor="#e0e0e0", tooltip="<top level>", shape="house"];
  subgraph "cluster_0" {
    label="fc1"; style="rounded"; color="#999999"; fontname="Helvetica";
    "fc1_weight" [label="fc1_weight\\nfc1.weight\\ntp=S(0)  [8, 8]", fillcolor="#9ecae1", tooltip="fc1  models.py:forward+1  global [16, 8]", shape="cylinder"];
    "fc1_bias" [label="fc1_bias\\nfc1.bias\\ntp=S(0)  [8]", fillcolor="#9ecae1", tooltip="fc1  models.py:forward+1  global [16]", shape="cylinder"];
    "grad_sync" [label="grad_sync\\ngrad_sync on tp\\nfwd identity\\nbwd all-reduce\\ntp=R  [2, 8]", fillcolor="#e0e0e0", tooltip="fc1  models.py:forward+1  global [2, 8]", shape="hexagon", color="#d62728", penwidth="2.5", style="filled,bold"];
    "linear" [label="linear\\nF.linear\\ntp=S(1)  [2, 8]", fillcolor="#9ecae1", tooltip="fc1  models.py:forward+1  global [2, 16]"];
  }
  subgraph "cluster_1" {
    label="fc2"; style="rounded"; color="#999999"; fontname="Helvetica";
    "fc2_weight" [label="fc2_weight\\nfc2.weight\\ntp=S(1)  [8, 8]", fillcolor="#9ecae1", tooltip="fc2  models.py:forward+3  global [8, 16]", shape="cylinder"];
    "fc2_bias" [label="fc2_bias\\nfc2.bias\\ntp=R  [8]", fillcolor="#e0e0e0", tooltip="fc2  models.py:forward+3  global [8]", shape="cylinder"];
    "linear_1" [label="linear_1\\nF.linear\\ntp=P  [2, 8]", fillcolor="#fdae6b", tooltip="fc2  models.py:forward+3  global [2, 8]"];
    "all_reduce" [label="all_reduce\\nall_reduce on tp\\nfwd all-reduce\\nbwd identity\\ntp=R  [2, 8]", fillcolor="#e0e0e0", tooltip="fc2  models.py:forward+3  global [2, 8]", shape="hexagon", color="#d62728", penwidth="2.5", style="filled,bold"];
    "add" [label="add\\noperator.add\\ntp=R  [2, 8]", fillcolor="#e0e0e0", tooltip="fc2  models.py:forward+3  global [2, 8]"];
  }
  "x" -> "grad_sync";
  "grad_sync" -> "linear";
  "fc1_weight" -> "linear";
  "fc1_bias" -> "linear";
  "linear" -> "gelu";
  "gelu" -> "linear_1";
  "fc2_weight" -> "linear_1";
  "linear_1" -> "all_reduce";
  "all_reduce" -> "add";
  "fc2_bias" -> "add";
  "add" -> "output";
}
""")


def test_json_is_machine_independent():
    text = to_json(_mlp_sharded())
    assert "/" not in "".join(n["source"] or "" for n in json.loads(text)["nodes"])
    data = json.loads(to_json(_mlp_sharded(), indent=2))
    assert data == json.loads(text)


def test_networkx_round_trip():
    gm = _mlp_sharded()
    g = to_networkx(gm)
    nodes = list(gm.graph.nodes)
    assert g.number_of_nodes() == len(nodes)
    assert g.number_of_edges() == sum(len(n.all_input_nodes) for n in nodes)
    assert nx.is_directed_acyclic_graph(g)
    assert g.graph["mesh"] == {"tp": 2}
    for n in nodes:
        v = n.meta[KEY].value
        if isinstance(v, TensorInfo):
            assert g.nodes[n.name]["layout"] == {a: fmt_placement(p) for a, p in v.layout.items()}
            assert g.nodes[n.name]["local_shape"] == list(v.local_shape)
        for a in n.all_input_nodes:
            assert g.has_edge(a.name, n.name)
    colls = {name for name, d in g.nodes(data=True) if d["collective"]}
    assert colls == {n.name for n in nodes if n.meta[KEY].collective is not None} and colls
    # the path from the input to the output crosses the row-parallel all-reduce
    assert "all_reduce" in nx.shortest_path(g, "linear", "output")


def test_region_filter_llama():
    model = llama(n_heads=8, n_kv_heads=4)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (tokens(2, 8, 128),))
    g = to_networkx(sharded, region="layers.1.attention")
    assert g.number_of_nodes() > 10
    assert all(d["module"].startswith("layers.1.attention") for _, d in g.nodes(data=True))
    assert {d["layout"]["tp"] for _, d in g.nodes(data=True) if d["layout"]} >= {"S(2)", "P", "R"}
    dot = to_dot(sharded, region="layers.0")
    assert dot.count("shape=\"hexagon\"") == 4  # 2 all-reduces + 2 grad syncs in layer 0
    assert 'label="layers.0.attention.wq"' in dot and "layers.1" not in dot
    data = json.loads(to_json(sharded))
    assert len(data["nodes"]) == len(sharded.graph.nodes)


def test_render_without_graphviz(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install graphviz"):
        render(_mlp_sharded(), "graph.svg")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_render_svg(tmp_path):
    path = render(_mlp_sharded(), tmp_path / "graph.svg")
    svg = open(path).read()
    assert "<svg" in svg and "all_reduce" in svg and "fc1" in svg
