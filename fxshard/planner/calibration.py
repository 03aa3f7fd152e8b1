"""The constants of the planner's roofline: what a device computes, moves and sends per second.

A :class:`Calibration` holds the achieved dense matmul throughput, the memory bandwidth, a
cost per kernel, and per link class (``intra``: within a node, ``inter``: between nodes) the
bus bandwidth and the latency of one collective call.  Each says where its numbers come from
(:attr:`Calibration.source`).

- **Shipped** (:data:`PRESETS`): H100 SXM, H200 SXM and A100 SXM 80 GB from their data sheets
  (dense bf16 tensor-core peak, HBM bandwidth, NVLink per direction, one 400/200 Gb/s NIC per
  GPU), times the efficiency a well-tuned run reaches (matmul 0.7, memory 0.8, links 0.8:
  the usual fractions of nccl-tests' bus bandwidth and of cuBLAS on large GEMMs), and a ring
  step of 1.5 us within a node and 5 us between nodes (nccl-tests' small-message times);
  attention at FlashAttention-2's measured rate (its paper: 335 TFLOP/s forward and backward
  on an H100, 225 on an A100), which long sequences spend most of their time in;
  ``h100-hbm2e``: the 96 GB, 500 W H100s of torchtitan's published Llama 3.1 runs;
  ``cpu``: one process of this project's 2-core machine, measured once, gloo over loopback.
- **Measured** (:func:`calibrate`, ``python -m fxshard plan --calibrate out.json``): a few
  matmuls, a copy (256 MiB on a GPU; 2 MiB, cache-sized as small activations are, on a CPU),
  a stream of tiny kernels on this device, and, where a process group
  exists (under ``torchrun``), all-reduces of 4 KiB (latency) and 64 MiB (bandwidth; 16 MiB
  on a CPU) over the world; those go to the link class the world spans.  The cost per kernel
  is that of a small op's forward and backward through autograd, over three; attention is a
  causal ``scaled_dot_product_attention`` forward and backward.

Example::

    cal = Calibration.named("h100")           # or Calibration.load("out.json"), or calibrate()
    cal.link("inter").gbps                    # 40.0
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from fxshard.errors import PlanError


@dataclass(frozen=True)
class Link:
    gbps: float  # bus bandwidth, GB/s (nccl-tests' busbw: the ring's bytes per second per rank)
    latency_us: float  # one step of a ring (an all-reduce over n ranks takes 2 (n - 1) of them)


@dataclass(frozen=True)
class Calibration:
    """Roofline constants of one device and its links (see the module docstring)."""

    name: str
    matmul_tflops: float  # achieved, in the dtype planned (bf16 on GPUs, fp32 on a CPU)
    memory_gbps: float
    kernel_us: float  # fixed cost per kernel (launch, dispatch)
    links: dict[str, Link] = field(default_factory=dict)
    gpus_per_node: int = 8
    memory_gib: float | None = None  # the device's memory (data sheet)
    dtype: str = "bf16"  # the dtype the throughput is for, and the planner's default
    source: str = ""
    # the share of FSDP2's transfers that runs behind compute: NCCL on its own streams overlaps them; gloo on a
    # CPU runs them on the cores the compute needs
    overlap: float = 1.0
    # the cores a node's ranks share (a CPU); None: a device per rank.  The throughputs are one rank's alone
    cores: int | None = None
    # achieved attention throughput (flash attention's fused kernels run well below the matmul rate), counted as the
    # planner counts it: the forward's FLOPs (4 s^2 d per head, halved when causal) times 3 over the time of a
    # forward and backward; None: the matmul rate
    attention_tflops: float | None = None

    @property
    def attention_rate(self) -> float:
        """Attention FLOP/s as the time model counts them (the matmul rate where none is given)."""
        return (self.attention_tflops or self.matmul_tflops) * 1e12

    @classmethod
    def named(cls, name: str) -> "Calibration":
        """A shipped preset (``h100``, ``h200``, ``a100``, ``h100-hbm2e``: the H100s of torchtitan's
        published runs, ``cpu``) or a JSON file written by
        :meth:`save` / ``--calibrate``."""
        key = name.lower().replace("-", "").replace(" ", "")
        if key in PRESETS:
            return PRESETS[key]
        if name.endswith(".json"):
            return cls.load(name)
        raise PlanError(f"device {name!r}: no calibration of that name\n  fix: one of {sorted(PRESETS)}, the path of a "
                        f"JSON file from `python -m fxshard plan --calibrate out.json`, or a Calibration")

    @classmethod
    def load(cls, path: str) -> "Calibration":
        with open(path) as fh:
            data = json.load(fh)
        data["links"] = {k: Link(**v) for k, v in data.get("links", {}).items()}
        return cls(**data)

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(dataclasses.asdict(self), fh, indent=1)

    def link(self, kind: str) -> Link:
        return self.links.get(kind) or self.links.get("intra") or Link(1.0, 100.0)

    def describe(self) -> str:
        links = ", ".join(f"{k} {v.gbps:g} GB/s + {v.latency_us:g} us" for k, v in self.links.items())
        attention = f", attention {self.attention_tflops:g} TFLOP/s" if self.attention_tflops else ""
        return (f"{self.name}: matmul {self.matmul_tflops:g} TFLOP/s ({self.dtype}){attention}, memory {self.memory_gbps:g} GB/s, "
                f"{self.kernel_us:g} us per kernel, links {links}, FSDP2 overlap {self.overlap:g}; {self.source}")


def _gpu(name, tflops, hbm_tbps, nvlink_gbps, nic_gbps, memory_gib, attention_tflops, note="") -> Calibration:
    """``attention_tflops``: FlashAttention-2's forward and backward at head dim 128 (its paper's
    measurement, FLOPs counted as the kernel's: the backward 2.5 forwards), recounted as the
    planner counts (the backward 2 forwards: times 3 / 3.5)."""
    return Calibration(name, matmul_tflops=0.7 * tflops, memory_gbps=0.8 * hbm_tbps * 1000, kernel_us=6.0,
                       links={"intra": Link(0.8 * nvlink_gbps, 1.5), "inter": Link(0.8 * nic_gbps, 5.0)},
                       gpus_per_node=8, memory_gib=memory_gib, dtype="bf16",
                       attention_tflops=round(attention_tflops * 3 / 3.5, 1),
                       source=f"data sheet x efficiency (matmul 0.7 of {tflops:g} TFLOP/s dense bf16, memory 0.8 of "
                              f"{hbm_tbps:g} TB/s, links 0.8 of NVLink {nvlink_gbps:g} GB/s per direction and "
                              f"{nic_gbps:g} GB/s per GPU between nodes; attention: FlashAttention-2's "
                              f"{attention_tflops:.0f} TFLOP/s forward and backward){note}")


PRESETS: dict[str, Calibration] = {
    "h100": _gpu("H100 SXM", 989.0, 3.35, 450.0, 50.0, 80.0, 335.0),
    "h200": _gpu("H200 SXM", 989.0, 4.8, 450.0, 50.0, 141.0, 335.0),
    "a100": _gpu("A100 SXM 80GB", 312.0, 2.04, 300.0, 25.0, 80.0, 225.0),
    # the machine of torchtitan's published Llama 3.1 runs (its benchmarks/llama3_h100_202412_torchtitan.md: Grand
    # Teton, 96 GB of HBM2e at 2.4 TB/s, 500 W; "the actual peak TFLOPs number is between SXM and NVL": halfway
    # between the SXM's 989 and the NVL's 835), its attention scaled by the same
    "h100hbm2e": _gpu("H100 96GB HBM2e 500W", 912.0, 2.4, 450.0, 50.0, 96.0, 335.0 * 912 / 989,
                      note="; torchtitan's Grand Teton H100s: peak halfway between SXM and NVL, as its benchmark says"),
    # one process alone on this project's 2-core machine (python -m fxshard plan --calibrate), gloo on loopback
    "cpu": Calibration("cpu", matmul_tflops=0.05, memory_gbps=5.0, kernel_us=8.0,
                       links={"intra": Link(1.0, 500.0), "inter": Link(1.0, 500.0)}, gpus_per_node=1 << 20,
                       memory_gib=None, dtype="fp32", source="measured on the project's 2-core CPU, gloo over loopback",
                       overlap=0.0, cores=2),
}


def default_calibration(device: str | None = None) -> Calibration:
    """``device`` by name, else this machine's GPU if it is a known one, else ``cpu``."""
    if device is not None:
        return Calibration.named(device)
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100"):
            if key in gpu:
                return PRESETS[key]
    return PRESETS["cpu"]


def rank_memory_gib(cal: Calibration, world: int, *, this_machine: bool = True) -> tuple[float, str]:
    """The memory of one rank when none is given, and where it comes from: the calibration's
    (a GPU preset's data sheet); else this machine's GPU (its total, when ``this_machine`` or
    the calibration is a GPU's); else this machine's memory (its cgroup limit if lower) over
    the ranks that share it: ``LOCAL_WORLD_SIZE`` under torchrun, else ``world`` (at most
    ``gpus_per_node``).

    Example: ``rank_memory_gib(Calibration.named("cpu"), 4)   # (15.6, "this machine's 62.5 GiB over 4 ranks")``
    """
    if cal.memory_gib:
        return float(cal.memory_gib), f"the {cal.name}'s"
    if torch.cuda.is_available() and (this_machine or cal.cores is None):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory / 2**30, f"this machine's {props.name}"
    total = _machine_bytes()
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or max(1, min(world, cal.gpus_per_node))
    return total / local / 2**30, f"this machine's {total / 2**30:.1f} GiB over {local} rank{'s' * (local > 1)}"


def _machine_bytes() -> int:
    """Physical memory, or the cgroup's limit where it is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def calibrate(device: str | None = None, *, repeats: int = 5) -> Calibration:
    """Measure this device (and the world's links, when a process group exists).  Every rank
    of a process group must call it (the collectives are the world's); rank 0 measures the
    device alone while the others wait, and every rank returns rank 0's constants."""
    import torch.distributed as dist

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    grouped = dist.is_initialized() and dist.get_world_size() > 1
    if grouped:
        dist.barrier()
        found = [_device_constants(dev, repeats) if dist.get_rank() == 0 else None]
        dist.barrier()
        dist.broadcast_object_list(found, src=0)
        found = found[0]
    else:
        found = _device_constants(dev, repeats)
    base = default_calibration()
    on_gpu = dev.type == "cuda"
    links, where = dict(base.links), f"measured on {torch.cuda.get_device_name() if on_gpu else 'this CPU'}"
    if grouped:
        world = dist.get_world_size()
        small = torch.zeros(1024, device=dev)
        large = torch.zeros((16 if on_gpu else 4) << 20, device=dev)  # 64 MiB of fp32 (16 MiB on a CPU)
        lat = _best(lambda: dist.all_reduce(small), dev, repeats)
        t = _best(lambda: dist.all_reduce(large), dev, repeats)
        bus = 2 * (world - 1) / world * large.numel() * 4 / max(t - lat, 1e-9) / 1e9
        kind = "intra" if world <= base.gpus_per_node else "inter"
        links[kind] = Link(round(bus, 3), round(lat * 1e6 / (2 * (world - 1)), 1))  # a ring all-reduce: 2 (n - 1) steps
        where += f", {kind} link by all-reduces over {world} ranks ({dist.get_backend()})"
    else:
        where += f", links from the {base.name} preset (no process group)"
    cores = None if on_gpu else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return dataclasses.replace(base, name=f"measured ({dev.type})", links=links, dtype="bf16" if on_gpu else "fp32",
                               source=where, overlap=1.0 if on_gpu else 0.0, cores=cores, **found)


def _device_constants(dev: torch.device, repeats: int) -> dict:
    """Matmul throughput, copy bandwidth and the cost of a small op on ``dev``."""
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    n = 8192 if on_gpu else 1024
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    matmul = _best(lambda: a @ b, dev, repeats)
    # a GPU's activations stream from HBM; a CPU's small ones stay in its caches: a copy of their size
    big = torch.empty(256 << 20 if on_gpu else 2 << 20, dtype=torch.uint8, device=dev)
    copy = _best(lambda: big.clone(), dev, repeats)
    tiny = torch.zeros(8, device=dev, requires_grad=True)

    def chain():  # small ops forward and backward, as a program runs them: the time model counts a backward as 2 forwards
        x = tiny
        for _ in range(100):
            x = x * 1.0001
        x.sum().backward()

    kernel = _best(chain, dev, repeats) / 300
    # causal attention forward and backward at head dim 128, counted as the time model counts: 3 forwards' FLOPs
    b, h, s, d = (4, 16, 4096, 128) if on_gpu else (1, 4, 512, 64)
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    attn = _best(attention, dev, repeats)
    return {"matmul_tflops": round(2 * n ** 3 / matmul / 1e12, 4), "memory_gbps": round(2 * big.numel() / copy / 1e9, 2),
            "kernel_us": round(kernel * 1e6, 2), "attention_tflops": round(3 * 2 * b * h * s * s * d / attn / 1e12, 4)}


def _best(fn, dev: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up), in seconds."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best
