"""The walkthrough notebook runs from top to bottom, and is stored as generated.

``notebooks/walkthrough.ipynb`` asserts its own results (sharded vs single-device
outputs, losses and gradients, collective counts), so executing it is a test of
fxshard.  It runs in a fresh kernel of *this* interpreter (so it imports the fxshard
under test, whatever kernelspecs are installed), in a temporary working directory
(the SVG it draws stays out of the repository).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "walkthrough.ipynb")
GENERATOR = os.path.join(REPO, "notebooks", "make_walkthrough.py")
KERNEL_NAME = "fxshard-walkthrough"


def _generator():
    spec = importlib.util.spec_from_file_location("make_walkthrough", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_manager(kernels_dir: str):
    """A kernel manager for a kernelspec that runs ``sys.executable``.

    The "python3" kernelspec, if any, may belong to another interpreter (one without
    fxshard, or another checkout's); a spec written for this interpreter cannot.
    """
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    write_kernel_spec(os.path.join(kernels_dir, KERNEL_NAME), overrides={"display_name": "fxshard test kernel"})
    specs = KernelSpecManager(kernel_dirs=[kernels_dir])
    assert specs.get_kernel_spec(KERNEL_NAME).argv[0] == sys.executable
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def test_notebook_is_stored_as_generated_and_without_outputs():
    stored = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(stored)
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{cell.id} has outputs: store it cleared"
    built = _generator().build()
    fix = "regenerate it: python notebooks/make_walkthrough.py"
    assert [c.source for c in stored.cells] == [c.source for c in built.cells], f"walkthrough.ipynb differs from make_walkthrough.py; {fix}"
    assert [c.cell_type for c in stored.cells] == [c.cell_type for c in built.cells], fix


def test_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tmp_path / "run"
    workdir.mkdir()
    km = _kernel_manager(str(tmp_path / "kernels"))
    client = nbclient.NotebookClient(nb, km=km, timeout=300, kernel_name=KERNEL_NAME,
                                     resources={"metadata": {"path": str(workdir)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any assert fails
    elapsed = time.perf_counter() - start

    text = _all_text(nb)
    assert "fxshard_all_reduce(" in text and "fxshard dump of Llama" in text
    assert "make this linear rowwise('tp')" in text            # section 4's PlanError reached the output
    assert "fxshard comm summary" in text and "tp=P because" in text
    assert not os.path.exists(os.path.join(REPO, "notebooks", "layer0.svg"))
    print(f"walkthrough executed in {elapsed:.1f} s")


def _all_text(nb) -> str:
    """The text of every stream output and of every text/plain result."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "data" in out:
                parts.append(out.data.get("text/plain", ""))
            elif out.output_type == "error":
                parts.append("\n".join(out.traceback))
    return "\n".join(parts)
