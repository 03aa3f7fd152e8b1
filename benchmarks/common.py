"""Shared helpers of the benchmark scripts: results files, machine description, tables,
simulated ranks, collective logging.

Every script writes ``benchmarks/results/<name>.json`` (git-ignored)::

    {"benchmark": name, "command": "python benchmarks/...", "machine": {...}, "config": {...}, "results": [...]}
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` from anywhere: import fxshard from the checkout
    sys.path.insert(0, str(ROOT))


def machine() -> dict:
    """What the figures were measured on (printed next to every table)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def describe_machine(info: dict | None = None) -> str:
    m = info or machine()
    gpu = f", GPU {m['cuda']}" if m.get("cuda") else ""
    return f"{m['cpu']} ({m['cores']} cores, load {m['load_avg_1m']}){gpu}; torch {m['torch']}, Python {m['python']}"


def command_line() -> str:
    """The command that reproduces this run (relative to the repository root)."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return " ".join(["python", str(script), *sys.argv[1:]])


def write_json(name: str, config: dict, results, out: str | None = None) -> Path:
    """Write the results file; returns its path (``out`` or ``benchmarks/results/<name>.json``)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "command": command_line(), "machine": machine(),
               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "config": config, "results": results}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A fixed-width text table; ``columns`` are ``(key, header, format)`` (format like ``".2f"``).

    Missing values print as ``-``; strings are left-aligned, numbers right-aligned.
    """
    cells = [[_cell(r.get(key), fmt) for key, _, fmt in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    numeric = [all(isinstance(r.get(k), (int, float)) or r.get(k) is None for r in rows) for k, _, _ in columns]
    def line(vals):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()
    out = [line([h for _, h, _ in columns]), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def _cell(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt)
    return str(v)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@contextlib.contextmanager
def simulated(mesh_shape: dict[str, int], device: str = "cpu") -> Iterator:
    """``prod(mesh_shape)`` simulated ranks in this process (fake process group +
    ``LocalTensorMode``); yields the DeviceMesh.  As ``tests/harness.py``, plus ``device``."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = math.prod(mesh_shape.values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh(device.split(":")[0], tuple(mesh_shape.values()), mesh_dim_names=tuple(mesh_shape))
        with LocalTensorMode(world_size):
            yield mesh
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Suspend simulated ranks for the block (build models and references in it)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    lm = enabled_local_tensor_mode()
    if lm is None:
        yield
    else:
        with lm.disable():
            yield


def rank_value(t, rank: int):
    """Rank ``rank``'s tensor of a LocalTensor (``t`` itself when plain)."""
    local = getattr(t, "_local_tensors", None)
    return t if local is None else local[rank]


def save_plot(fig, name: str, out_dir: Path | None = None) -> Path:
    path = (out_dir or RESULTS) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def pyplot():
    """matplotlib's pyplot with a file-only backend, or ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
