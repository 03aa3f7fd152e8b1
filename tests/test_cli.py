"""``python -m fxshard dump``: offline transform + dump from the command line.

Most checks call ``fxshard.cli.commands.main(argv)`` in-process (fast); one runs the real
``python -m fxshard dump`` to prove the wiring and the exit status.  Expected output
is computed independently with the library (transform + dump / to_json).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.cli import commands as cli
from fxshard.debug.comm_summary import comm_summary
from fxshard.debug.formats import to_json
from fxshard.testing.models import llama, llama_plan, tokens

LLAMA = "fxshard.testing.models:llama(n_heads=8,n_kv_heads=4)"
BASE = [LLAMA, "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=4"]


@pytest.fixture(scope="module")
def reference():
    """The same transform done with the library."""
    model = llama(n_heads=8, n_kv_heads=4)
    return fxshard.transform(model, Plan(MeshSpec(("tp",), (4,)), llama_plan()), (tokens(2, 8, model.args.vocab_size),))


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_text(capsys, reference):
    rc, out, err = _run(capsys, *BASE)
    assert rc == 0, err
    assert out.startswith(fxshard.dump(reference) + "\n\n")
    assert out.splitlines()[0].startswith("fxshard dump of Llama  mesh: tp=4")
    assert "communication per step: forward 4 (16.0 KiB)  backward 4 (16.0 KiB)" in out
    assert str(comm_summary(reference)) in out


def test_text_region(capsys, reference):
    rc, out, _ = _run(capsys, *BASE, "--region", "layers.1.attention")
    assert rc == 0
    assert out.startswith(fxshard.dump(reference, region="layers.1.attention"))
    modules = {line.split()[-2] for line in out.splitlines() if "layers." in line and "models.py" in line}
    assert modules and all(m.startswith("layers.1.attention") for m in modules)


def test_json(capsys, reference):
    rc, out, _ = _run(capsys, *BASE, "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["mesh"] == {"tp": 4} and data["model"] == "Llama"
    assert [n["name"] for n in data["nodes"]] == [n.name for n in reference.graph.nodes]
    wq = next(n for n in data["nodes"] if n["target"] == "layers.0.attention.wq.weight")
    assert wq["layout"] == {"tp": "S(0)"} and wq["local_shape"] == [64 // 4, 64] and wq["shape"] == [64, 64]
    assert sum(1 for n in data["nodes"] if n["collective"]) == 8


def test_dot_to_file(capsys, tmp_path):
    path = tmp_path / "llama.dot"
    rc, out, err = _run(capsys, *BASE, "--format", "dot", "--region", "layers.0", "-o", str(path))
    assert rc == 0 and out == "" and f"wrote {path}" in err
    dot = path.read_text()
    assert dot.startswith('digraph "Llama" {') and 'label="Llama  mesh: tp=4"' in dot
    assert 'label="layers.0.feed_forward.w2"' in dot and dot.count('shape="hexagon"') == 4


def test_diff(capsys):
    rc, out, _ = _run(capsys, *BASE, "--diff")
    assert rc == 0
    assert out.startswith("--- traced\n+++ transformed\n")
    added = [l for l in out.splitlines() if l.startswith("+ ")]
    assert sum("fxshard_all_reduce(" in l for l in added) == 4
    assert sum("fxshard_grad_sync(" in l for l in added) == 4
    assert any(l.startswith("-") and "view(getitem_2, getitem_3, 8, 8)" in l for l in out.splitlines())  # 8 heads ...
    assert any(l.startswith("+") and "view(getitem_2, getitem_3, 2, 8)" in l for l in out.splitlines())  # ... 2 per rank


def test_bad_plan_exits_1_with_the_plan_error():
    """llama() has 2 kv heads: they cannot be split over 4 ranks."""
    proc = subprocess.run([sys.executable, "-m", "fxshard", "dump", "fxshard.testing.models:llama",
                           "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=4"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert "the plan does not fit the model" in proc.stderr
    assert "cannot shard node" in proc.stderr and "layers.0.attention" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_forms(capsys, tmp_path, monkeypatch, reference):
    """A dict, a factory with kwargs, a function of the mesh, a factory returning one."""
    (tmp_path / "userplans.py").write_text(textwrap.dedent("""
        import fxshard
        from fxshard.testing.models import llama_plan
        PLAN = llama_plan("tp")
        def by_mesh(mesh):
            return fxshard.Plan(mesh, llama_plan("tp"))
        def factory():
            return by_mesh
        def wrong_mesh():
            return fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), llama_plan("tp"))
        def inputs(batch=2):
            from fxshard.testing.models import tokens
            return (tokens(batch, 8, 128),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = to_json(reference)
    for plan in ("userplans:PLAN", "userplans:by_mesh", "userplans:factory", "fxshard.testing.models:llama_plan(axis='tp')",
                 "fxshard.testing.models:llama_plan('tp', fused=False)"):
        rc, out, err = _run(capsys, LLAMA, "--plan", plan, "--mesh", "tp=4", "--format", "json",
                            "--example", "userplans:inputs")
        assert rc == 0, (plan, err)
        assert out == expected, plan
    rc, out, err = _run(capsys, LLAMA, "--plan", "userplans:wrong_mesh", "--mesh", "tp=4")
    assert rc == 2 and "write the plan as a function of the mesh" in err
    rc, out, err = _run(capsys, LLAMA, "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=4", "--format", "json",
                        "--example", "userplans:inputs(batch=4)")
    assert rc == 0 and json.loads(out)["nodes"][0]["shape"] == [4, 8]


def test_model_without_vocab_needs_example(capsys, tmp_path, monkeypatch):
    rc, _, err = _run(capsys, "fxshard.testing.models:mlp", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2")
    assert rc == 2 and "pass --example" in err
    (tmp_path / "mlpinputs.py").write_text("import torch\ndef x():\n    return torch.zeros(3, 32)\n"
                                           "def plan():\n    import fxshard\n"
                                           "    return {'fc1': fxshard.colwise(), 'fc2': fxshard.rowwise()}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = _run(capsys, "fxshard.testing.models:mlp(hidden=64)", "--plan", "mlpinputs:plan", "--mesh", "tp=2",
                        "--example", "mlpinputs:x", "--format", "json")
    assert rc == 0, err
    fc1 = next(n for n in json.loads(out)["nodes"] if n["target"] == "fc1.weight")
    assert fc1["local_shape"] == [32, 32]


@pytest.mark.parametrize("argv, message", [
    (["fxshard.testing.models:llama", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp4"], "write AXIS=SIZE pairs"),
    (["fxshard.testing.models:llama", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=0"], "sizes must be >= 1"),
    (["fxshard.testing.models:lama", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2"], "did you mean ['llama'"),
    (["fxshard.nosuch:llama", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2"], "cannot import module 'fxshard.nosuch'"),
    (["fxshard.testing.models:llama(n_heads=x)", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2"], "must be Python literals"),
    (["fxshard.testing.models:llama(n_head=8)", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2"], "raised TypeError"),
    (["fxshard.testing.models:llama", "--plan", "fxshard.testing.models:tokens(1, 2, 3)", "--mesh", "tp=2"], "gave a Tensor"),
    (["fxshard.testing.models:llama", "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2", "--format", "svg"], "add -o FILE.svg"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert message in err, err


def test_parse_ref():
    assert cli.parse_ref("a.b:f") == ("a.b", "f", None, {})
    assert cli.parse_ref("a:f()") == ("a", "f", (), {})
    assert cli.parse_ref("a:f(1, k='v', t=(1, 2), d={'x': None})") == ("a", "f", (1,), {"k": "v", "t": (1, 2), "d": {"x": None}})
    assert cli.parse_mesh("dp=2, tp=4") == MeshSpec(("dp", "tp"), (2, 4))


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_svg(capsys, tmp_path):
    path = tmp_path / "layer.svg"
    rc, out, err = _run(capsys, *BASE, "--format", "svg", "--region", "layers.0.attention", "-o", str(path))
    assert rc == 0, err
    assert "<svg" in path.read_text()


def test_auto_plan(capsys):
    """--plan auto: the plan auto_plan finds goes to stderr; at tp=4 llama()'s 2 kv heads are
    each held by 2 ranks (heads=2), and the MLPs are sharded."""
    rc = cli.main(["fxshard.testing.models:llama", "--plan", "auto", "--mesh", "tp=4", "--region", "layers.0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "plan = fxshard.Plan(mesh, {" in err and "'layers.*.feed_forward.w2': fxshard.rowwise('tp')," in err
    assert "'layers.*.attention.wk': fxshard.colwise('tp', heads=2)," in err and "2 KV heads each on 2 ranks" in err
    assert "all_reduce" in out


# --------------------------------------------------------------------------- optional packages: the extra named


@pytest.fixture
def no_transformers(monkeypatch, tmp_path):
    """transformers not installed (``None`` in sys.modules: its import raises ModuleNotFoundError),
    and two model modules that need it: one imports it at the top, one inside its factory."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    (tmp_path / "hf_eager.py").write_text("import transformers\n\ndef build():\n    return transformers.AutoModel\n")
    (tmp_path / "hf_lazy.py").write_text("def build():\n    import transformers\n    return transformers.AutoModel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hf_eager", "hf_lazy"):
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize("model", ["hf_eager:build", "hf_lazy:build"])
def test_missing_extra_is_one_line_naming_it_exit_2(capsys, no_transformers, model):
    from fxshard.__main__ import main

    rc = main(["dump", model, "--plan", "fxshard.testing.models:llama_plan", "--mesh", "tp=2"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == f"fxshard dump: {model!r} needs transformers, which is not installed: pip install 'fxshard[hf]'\n", err


def test_require_names_the_extra(no_transformers):
    from fxshard.cli.extras import MissingExtra, require

    with pytest.raises(MissingExtra, match=r"^--model DIR needs transformers, which is not installed: "
                                           r"pip install 'fxshard\[hf\]'$") as info:
        require("transformers", "hf", "--model DIR")
    assert (info.value.module, info.value.extra, info.value.exit_status) == ("transformers", "hf", 2)
    assert require("json", "hf") is json


def test_a_missing_extra_escaping_any_command_is_one_line(capsys, monkeypatch):
    """``python -m fxshard``'s own catch: a command that imports torchtitan without require()."""
    import fxshard.cli.demo
    from fxshard.__main__ import main

    def needs(name):
        def run_demo(args):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return run_demo

    monkeypatch.setattr(fxshard.cli.demo, "run_demo", needs("torchtitan"))
    assert main(["demo"]) == 2
    assert capsys.readouterr().err == ("fxshard demo: this needs torchtitan, which is not installed: "
                                       "pip install 'fxshard[torchtitan]'\n")
    monkeypatch.setattr(fxshard.cli.demo, "run_demo", needs("nosuchpackage"))  # not an extra's: the traceback stays
    with pytest.raises(ModuleNotFoundError, match="nosuchpackage"):
        main(["demo"])


def test_extras_are_pyproject_s():
    """Each package of EXTRA_OF is in that extra of the installed fxshard's metadata."""
    import importlib.metadata
    import re

    from fxshard.cli.extras import EXTRA_OF

    requires = importlib.metadata.requires("fxshard") or []
    by_extra: dict[str, set[str]] = {}
    for req in requires:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        by_extra.setdefault(extra.group(1) if extra else "", set()).add(name)
    for module, extra in EXTRA_OF.items():
        assert module in by_extra.get(extra, set()), f"{module} is not in fxshard[{extra}]: {sorted(by_extra.get(extra, ()))}"
    assert "numpy" in by_extra[""], "numpy is a base dependency: torch warns at import without it"
