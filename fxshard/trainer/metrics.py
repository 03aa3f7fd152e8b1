"""What a run shows: throughput, model FLOPs, MFU, peak memory, one line and one record
per logged step (``metrics.jsonl``, TensorBoard when it is installed).

* ``tokens_per_s``: the global tokens of the steps since the last record over their wall
  time (evaluation and checkpoint saves excluded);
* ``tflops``: model FLOPs per device per second, ``flops_per_token x tokens_per_s /
  world``, with torchtitan's count ``6 N + 12 L H Q T`` (``N`` the parameters a token
  uses, input embeddings left out, an MoE's routed experts counted ``top_k / experts``;
  ``L`` layers, ``H`` heads, ``Q`` head dim, ``T`` sequence): recomputation under
  activation checkpointing is not counted, as MFU's definition asks;
* ``mfu``: ``tflops`` over the device's dense peak (:data:`PEAK_TFLOPS`, bf16 under
  ``--bf16``, else fp32), or ``--peak-tflops``; ``None`` where neither is known (CPUs);
* ``peak_mem_gib``: the largest of the ranks' peaks (CUDA's ``max_memory_allocated``; on
  CPU the process's peak resident set).

Example::

    log = MetricsLogger("runs/a", rank=0)
    log.record({"step": 10, "loss": 2.31, ...})
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.nn as nn

# dense peak TFLOPs per device (bf16 tensor cores, fp32 without TF32), from the vendors' data sheets
PEAK_TFLOPS = {
    "H200": (989.0, 67.0),
    "H100 SXM": (989.0, 67.0), "H100 NVL": (835.0, 60.0), "H100 PCIe": (756.0, 51.0), "H100": (989.0, 67.0),
    "GH200": (989.0, 67.0),
    "B200": (2250.0, 80.0), "B100": (1750.0, 60.0),
    "A100": (312.0, 19.5), "A800": (312.0, 19.5),
    "L40S": (362.0, 91.6), "L4": (121.0, 30.3), "A10G": (70.0, 31.2), "A10": (125.0, 31.2),
    "RTX 4090": (165.0, 82.6), "V100": (125.0, 15.7),
}


def device_peak_tflops(device: torch.device, bf16: bool) -> float | None:
    """The dense peak of ``device`` from :data:`PEAK_TFLOPS`, or ``None`` (CPUs, unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 SXM" before "H100"
        if key in name:
            return PEAK_TFLOPS[key][0 if bf16 else 1]
    return None


def flops_per_token(model: nn.Module, seq: int) -> float:
    """Model FLOPs of one token's forward and backward (module docstring)."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else None
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "moe_topk", None)
    n = 0.0
    for name, p in model.named_parameters():  # a tied head counts once, as the embedding it is left out with
        if id(p) in embeddings:
            continue
        share = top_k / experts if experts and top_k and ".experts." in f".{name}." else 1.0
        n += p.numel() * share
    if text is not None:
        layers, heads = text.num_hidden_layers, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    else:  # torchtitan: its layers know their attention
        blocks = getattr(model, "layers", [])
        layers = len(blocks)
        attn = getattr(next(iter(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks), None), "attention", None)
        heads = getattr(attn, "n_heads", 0)
        head_dim = getattr(attn, "head_dim", 0)
    return 6.0 * n + 12.0 * layers * heads * head_dim * seq


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory (CUDA: allocated by torch; CPU: resident set)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


class Throughput:
    """Tokens and wall time since the last record (what is not training, paused out)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tokens, self.seconds, self.started = 0, 0.0, None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.started = time.perf_counter()

    def stop(self, tokens: int) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self.started
        self.tokens += tokens
        self.started = None

    def take(self) -> float:
        """Tokens per second since the last take."""
        rate = self.tokens / self.seconds if self.seconds else 0.0
        self.tokens, self.seconds = 0, 0.0
        return rate


class MetricsLogger:
    """Rank 0 prints a line per record and appends it to ``log_dir/metrics.jsonl`` (and to
    TensorBoard event files in ``log_dir`` when ``torch.utils.tensorboard`` imports)."""

    def __init__(self, log_dir: str | None, rank: int, resume_step: int = 0):
        self.rank, self.file, self.tb = rank, None, None
        if rank != 0 or not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, "metrics.jsonl")
        if resume_step and os.path.exists(path):  # a resumed run: the records after its checkpoint go
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            with open(path, "w") as f:
                f.writelines(kept)
        self.file = open(path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.tb = SummaryWriter(log_dir, purge_step=resume_step + 1 if resume_step else None)

    def print(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def record(self, rec: dict) -> None:
        if self.rank != 0:
            return
        print(format_record(rec), flush=True)
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if self.tb is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", value, rec["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def format_record(rec: dict) -> str:
    """``step 10 loss 2.31234567 grad_norm 1.2345 lr 3.00e-03 tokens/s 12,345 tflops 0.42 mfu 31.2% mem 1.23 GiB``."""
    parts = [f"step {rec['step']}"]
    if "loss" in rec:
        parts.append(f"loss {rec['loss']:.8f}")
    if "eval_loss" in rec:
        parts.append(f"eval_loss {rec['eval_loss']:.8f}")
    if "grad_norm" in rec:
        parts.append(f"grad_norm {rec['grad_norm']:.4f}")
    if "lr" in rec:
        parts.append(f"lr {rec['lr']:.2e}")
    if "tokens_per_s" in rec:
        parts.append(f"tokens/s {rec['tokens_per_s']:,.0f}")
    if "tflops" in rec:
        parts.append(f"tflops {rec['tflops']:.3f}")
    if "mfu" in rec:
        parts.append("mfu n/a" if rec["mfu"] is None else f"mfu {100 * rec['mfu']:.1f}%")
    if "peak_mem_gib" in rec:
        parts.append(f"mem {rec['peak_mem_gib']:.2f} GiB")
    return " ".join(parts)
