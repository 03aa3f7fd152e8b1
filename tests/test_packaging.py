"""The package as pip builds it: a wheel, installed with torch alone in a fresh virtual
environment outside the checkout, imports every module and runs the demo.

Editable installs (and so every other test) read the checkout, which hid a wheel that
left out ``fxshard.layout.op_rules``: ``import fxshard`` failed once installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
import fxshard
assert "site-packages" in fxshard.__file__, fxshard.__file__
failed = []
for info in pkgutil.walk_packages(fxshard.__path__, "fxshard."):
    try:
        importlib.import_module(info.name)
    except Exception as e:
        failed.append(f"{info.name}: {type(e).__name__}: {e}")
import fxshard.passes, fxshard.layout.op_rules
print("\\n".join(failed) or "every module imported")
sys.exit(1 if failed else 0)
"""


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: the test environment's setuptools builds it, as nothing is fetched
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        cwd=out)
    (built,) = out.glob("fxshard-*.whl")
    return built


def test_wheel_holds_every_package_and_no_top_level_passes(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fxshard"}, f"the wheel installs top-level {sorted(tops - {'fxshard'})}: passes/ belongs under fxshard"
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "fxshard").rglob("__init__.py")}
    packages |= {("fxshard/passes/" + p.parent.relative_to(REPO / "passes").as_posix()).removesuffix("/.")
                 for p in (REPO / "passes").rglob("__init__.py")}
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in names)
    assert not missing, f"the wheel leaves out {missing}"


@pytest.mark.slow
def test_wheel_installs_with_torch_alone_and_runs_the_demo(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    # the torch this suite runs (a local CPU build: pinned, so pip never resolves a CUDA one)
    run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}", str(wheel)], cwd=tmp_path)
    listed = run([python, "-m", "pip", "list", "--format=freeze"], cwd=tmp_path).stdout.lower()
    assert "transformers" not in listed and "fxshard" in listed
    print(run([python, "-c", IMPORT_EVERY_MODULE], cwd=tmp_path).stdout)
    demo = run([python, "-m", "fxshard", "demo"], cwd=tmp_path)
    assert "max |loss difference|" in demo.stdout, demo.stdout[-2000:]
