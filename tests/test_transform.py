"""fxshard.transform's pass table as a contract: what each row requires of the graph and
ensures for later passes is checked around the pass, and a broken fact is an
InternalError naming the pass; every rewrite a layout rule asks for has the one pass
that acts on it (fxshard.meta.Rewrite)."""
from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import fxshard
from fxshard import InternalError, MeshSpec, Plan, PlanError
from fxshard.meta import KEY, Rewrite
from fxshard.testing.models import gpt2, gpt2_plan, llama, llama_plan, tokens

ROOT = Path(__file__).resolve().parent.parent
TRANSFORM = importlib.import_module("fxshard.transform")  # the module: fxshard.transform is the function
MESH = MeshSpec(("tp",), (2,))
IDS = tokens(2, 8, 128)


def _replace_pass(monkeypatch, name: str, run) -> None:
    rows = tuple(dataclasses.replace(p, run=run) if p.name == name else p for p in TRANSFORM.PIPELINE)
    monkeypatch.setattr(TRANSFORM, "PIPELINE", rows)


def test_a_pass_that_does_not_write_what_it_ensures_is_an_internal_error(monkeypatch):
    _replace_pass(monkeypatch, "propagate", lambda gm, ctx: None)
    with pytest.raises(InternalError, match=r"internal error in pass propagate: it ensures 'value' .* after it ran does not "
                                            r"hold: node `\w+` .* has no layout") as e:
        fxshard.transform(llama(n_layers=1), Plan(MESH, llama_plan("tp")), example_inputs=(IDS,))
    assert not isinstance(e.value, PlanError) and e.value.pass_name == "propagate"
    assert "please report it" in str(e.value)


def test_a_rewrite_asked_for_and_not_made_is_an_internal_error(monkeypatch):
    """GPT-2's row-parallel c_proj has a bias: the linear rule asks defer_bias to add it after the reduction."""
    _replace_pass(monkeypatch, "defer_bias", lambda gm, ctx: None)
    with pytest.raises(InternalError, match=r"pass defer_bias: it ensures 'rewrite defer_bias done'.*node `linear"):
        fxshard.transform(gpt2(n_layers=1), Plan(MESH, gpt2_plan("tp")), example_inputs=(IDS,))


def test_a_fact_broken_before_a_pass_that_requires_it_is_an_internal_error(monkeypatch):
    replicate_heads = next(p.run for p in TRANSFORM.PIPELINE if p.name == "replicate_heads")

    def forgets_a_declared_layout(gm, ctx):
        replicate_heads(gm, ctx)
        next(n for n in gm.graph.nodes if n.op == "get_attr").meta[KEY].declared = None

    _replace_pass(monkeypatch, "replicate_heads", forgets_a_declared_layout)
    with pytest.raises(InternalError, match=r"pass propagate: it requires 'declared' .* before it runs does not hold: node "
                                            r"`\w+` .* without its declared layout"):
        fxshard.transform(llama(n_layers=1), Plan(MESH, llama_plan("tp")), example_inputs=(IDS,))


def test_every_row_declares_facts_and_the_unchanged_pipeline_keeps_them():
    for p in TRANSFORM.PIPELINE:
        assert all(isinstance(f, TRANSFORM.Fact) for f in p.requires + p.ensures), p.name
    fxshard.transform(gpt2(n_layers=1), Plan(MESH, gpt2_plan("tp", loss_parallel=True)), example_inputs=(IDS,))


def test_every_rewrite_is_acted_on_by_its_pass():
    """Each Rewrite names a pass of the table, whose row ensures that no node still asks for it."""
    rows = {p.name: p for p in TRANSFORM.PIPELINE}
    for rewrite in Rewrite:
        assert rewrite.pass_name in rows, f"{rewrite}: no pass {rewrite.pass_name!r} in fxshard.transform.PIPELINE"
        done = [f.name for f in rows[rewrite.pass_name].ensures if f.name.startswith("rewrite ")]
        assert any(rewrite in name.split()[1].split("/") for name in done), (
            f"{rewrite}: the row of {rewrite.pass_name} does not ensure it is done: {done}")
        source = (ROOT / "passes" / f"{rewrite.pass_name}.py").read_text()
        assert f"Rewrite.{rewrite.name}" in source, f"passes/{rewrite.pass_name}.py never reads Rewrite.{rewrite.name}"


def _rewrite_writes():
    """(file, line, what) of every write of NodeInfo.rewrite in fxshard/ and passes/: an
    assignment to ``.rewrite`` or a ``request_rewrite(...)`` call."""
    for path in sorted(list((ROOT / "fxshard").rglob("*.py")) + list((ROOT / "passes").glob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "rewrite" for t in node.targets):
                yield path.relative_to(ROOT), node.lineno, node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "request_rewrite":
                yield path.relative_to(ROOT), node.lineno, node.args[0] if node.args else None


def test_every_rewrite_written_is_a_documented_value_asked_for_by_a_rule():
    asked = set()
    for path, line, value in _rewrite_writes():
        if isinstance(value, ast.Constant) and value.value is None or path == Path("fxshard/layout/op_rules/context.py"):
            continue  # a pass clearing the request it acted on; Ctx.request_rewrite itself
        is_member = (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "Rewrite"
                     and value.attr in Rewrite.__members__)
        assert is_member, f"{path}:{line} writes NodeInfo.rewrite = {ast.unparse(value)}, not a member of fxshard.meta.Rewrite"
        # the rules: layout/op_rules/, and those of fxshard's own ops, registered next to them in runtime/
        assert path.parts[:3] == ("fxshard", "layout", "op_rules") or path.parts[:2] == ("fxshard", "runtime"), (
            f"{path}:{line}: only a layout rule asks for a rewrite (ctx.request_rewrite)")
        asked.add(Rewrite[value.attr])
    assert asked == set(Rewrite), f"values no rule asks for: {sorted(set(Rewrite) - asked)}"
