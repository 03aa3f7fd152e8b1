"""The shape of the package (docs/design.md §5): imports go one way, no private name crosses
a module, the pass table is one pass per file with one signature, and a pass can be
stopped after and timed by name."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import networkx as nx
import pytest

import fxshard
from fxshard.meta import KEY, PassContext
from fxshard.transform import PASS_NAMES, PIPELINE
from fxshard.testing.models import llama, llama_plan, tokens

from harness import simulated

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"fxshard": ROOT / "fxshard", "fxshard.passes": ROOT / "passes"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, base in SOURCES.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            name = ".".join((pkg,) + (rel[:-1] if rel[-1] == "__init__" else rel))
            mods[name] = path
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines under ``if TYPE_CHECKING:``: imports for annotations only, never run."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(mods: dict[str, Path]):
    """(importer, imported module, name) for every fxshard import, also inside functions
    (not those under ``if TYPE_CHECKING:``)."""
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                if not base.startswith("fxshard"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    yield name, sub if sub in mods else base, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fxshard"):
                        yield name, alias.name, None


# The layers of docs/design.md ("Where the code lives"), lowest first: a module imports its own
# layer or lower ones, never a higher one (imports inside functions included).  A module
# belongs to the layer of its longest prefix here.
LAYERS = [
    ("errors and markers", ["fxshard.errors", "fxshard.markers"]),
    ("plan vocabulary", ["fxshard.plan.specs", "fxshard.plan.mesh", "fxshard.plan.pipeline"]),
    ("meta contract", ["fxshard.meta"]),
    ("layouts", ["fxshard.layout"]),
    ("runtime", ["fxshard.runtime"]),
    ("state", ["fxshard.state"]),
    ("plan", ["fxshard.plan"]),
    ("front end", ["fxshard.frontend"]),
    ("training helpers", ["fxshard.training"]),
    ("passes", ["fxshard.passes"]),
    ("transform", ["fxshard.transform"]),
    ("debugging", ["fxshard.debug"]),
    ("pipelining", ["fxshard.pipelining"]),
    ("recipe", ["fxshard.recipe"]),
    ("testing and demo models", ["fxshard.testing"]),
    ("trainer", ["fxshard.trainer"]),
    ("planner", ["fxshard.planner"]),
    ("third-party conformance cases", ["fxshard.conformance"]),
    ("public face", ["fxshard"]),
    ("command line", ["fxshard.cli", "fxshard.__main__"]),
]


def layer_of(module: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer of LAYERS (docs/design.md)"
    return best[1]


def test_imports_go_down_the_layers():
    mods = _modules()
    upward = sorted({(a, b, LAYERS[layer_of(a)][0], LAYERS[layer_of(b)][0]) for a, b, _ in _imports(mods)
                     if b in mods and layer_of(b) > layer_of(a)})
    assert not upward, "imports against the layer order of docs/design.md:\n" + "\n".join(
        f"  {a} ({la}) -> {b} ({lb})" for a, b, la, lb in upward)


def test_the_design_lists_the_layers_in_order():
    design = (ROOT / "docs" / "design.md").read_text()
    listed = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", design, re.S)
    assert listed, "docs/design.md: the layer list between <!-- layers --> markers"
    names = [m.group(1) for m in re.finditer(r"^\d+\. \*\*(.+?)\*\*", listed.group(1), re.M)]
    assert names == [name for name, _ in LAYERS], names


def test_imports_form_no_circle():
    mods = _modules()
    graph = nx.DiGraph((a, b) for a, b, _ in _imports(mods) if b in mods and a != b)
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def test_no_private_name_crosses_a_module():
    crossing = [(a, b, n) for a, b, n in _imports(_modules())
                if n and n.startswith("_") and not n.startswith("__") and a != b]
    assert not crossing, f"private names imported from another module: {crossing}"


def test_the_root_holds_the_public_face_and_a_few_modules():
    root = sorted(p.stem for p in (ROOT / "fxshard").glob("*.py"))
    assert root == ["__init__", "__main__", "errors", "markers", "meta", "transform"], root


def test_one_pass_per_file_with_one_signature():
    assert len(set(PASS_NAMES)) == len(PASS_NAMES)
    for p in PIPELINE:
        module = inspect.getmodule(p.run)
        assert module.__name__ == f"fxshard.passes.{p.name}", (p.name, module.__name__)
        assert list(inspect.signature(p.run).parameters) == ["gm", "ctx"], p.name
        assert module.__doc__.startswith(f"{p.name}: "), f"passes/{p.name}.py: its docstring names the pass first"
    public = set(fxshard.__all__)
    assert not public & set(PASS_NAMES), "a pass named like a public API entry reads as that entry"


def test_design_references_resolve():
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, flags=re.M))
    cited = set()
    for path in list(ROOT.glob("fxshard/**/*.py")) + list(ROOT.glob("passes/*.py")) + list(ROOT.glob("tests/**/*.py")):
        text = path.read_text()
        assert "DESIGN.md" not in text or path.name == "test_structure.py", f"{path} cites a design outside the project"
        cited |= set(re.findall(r"docs/design\.md §(\d+)", text))
    assert cited and cited <= sections, f"cited sections {sorted(cited - sections)} are not in docs/design.md"


def test_stop_after_a_pass_and_time_every_pass():
    model, ids = llama(n_layers=1), tokens(2, 8, 128)
    with simulated({"tp": 2}) as mesh:
        plan = fxshard.Plan(mesh, llama_plan("tp"))
        timings: dict[str, float] = {}
        gm = fxshard.transform(model, plan, example_inputs=(ids,), stop_after="propagate", timings=timings)
        assert list(timings) == ["capture"] + list(PASS_NAMES[:PASS_NAMES.index("propagate") + 1])
        assert all(n.meta[KEY].value is not None for n in gm.graph.nodes if n.op == "get_attr")
        assert not any(n.meta.get(KEY) and n.meta[KEY].collective for n in gm.graph.nodes), "no collective before redistribute"
        timings.clear()
        fxshard.transform(model, plan, example_inputs=(ids,), timings=timings)
        assert set(timings) == {"capture"} | {p.name for p in PIPELINE if p.when is None or p.when(PassContext.from_plan(plan))}
        with pytest.raises(fxshard.PlanError, match="not a pass of fxshard.transform"):
            fxshard.transform(model, plan, example_inputs=(ids,), stop_after="normalise")
