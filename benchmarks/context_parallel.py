"""Context parallelism: communication per step and the attention's memory per rank.

Communication of a transformed Llama: the bytes of the c10d calls one forward and
backward makes on simulated ranks (measured), fxshard's static ``fxshard.comm_summary``,
and the analytical figure per method:

* all-gather: per layer, K and V gathered forward (``2 x B*H*T*D`` elements, the
  gathered buffer) and their gradients reduce-scattered backward (the same size);
* ring: per layer, ``n-1`` hops of the K and V blocks forward (``2 (n-1) x B*H*T/n*D``)
  and backward ``n-1`` hops of K, V and ``n`` of dK, dV (``(4n-2) x B*H*T/n*D``); the
  gradient accumulators travel in float32 (the model here is float32 throughout).

Memory: the peak of live tensor storage during one attention forward and backward
at a long sequence, on one device (torch's CPU flash kernel, and the math kernel that
materializes ``T x T`` scores) and on each of ``cp`` real gloo ranks (fxshard's ring
keeps one ``T/n x T/n`` block of scores at a time, the all-gather method a ``T/n x T``
one, in the math kernel a mask selects).

    python benchmarks/context_parallel.py                  # cp=2,4; T=4096 for memory
    python benchmarks/context_parallel.py --seq 8192 --no-memory
"""
from __future__ import annotations

import argparse
import json
import os
import weakref
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, fmt_bytes, simulated, table, write_json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
import torch.distributed._local_tensor  # noqa: E402

import fxshard  # noqa: E402
from fxshard.testing.launch import spawn  # noqa: E402
from fxshard.testing.models import llama, tokens  # noqa: E402


def _measured(model, method, n, ids):
    """Bytes of the attention's collectives (all but the gradients' all-reduce) of one
    forward and backward on ``n`` simulated ranks, read off the c10d calls."""
    from communication import CollectiveLog

    log = CollectiveLog()
    with simulated({"cp": n}) as mesh:
        plan = fxshard.Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp", method=method)},
                            inputs={"tokens": {"cp": Shard(1)}})
        sharded = fxshard.transform(model, plan, (ids,))
        x = fxshard.split_sequence(ids, "cp", sharded=sharded)
        with log.phase("forward"):
            out = sharded(x)
        with log.phase("backward"):
            out.float().pow(2).mean().backward()
    return {phase: sum(b for p, kind, b in log.calls if p == phase and kind != "all_reduce") for phase in ("forward", "backward")}


def comm_rows(cps, batch, seq, dim, heads, layers):
    rows = []
    hd = dim // heads
    for method in ("allgather", "ring"):
        for n in cps:
            model = llama(dim=dim, n_heads=heads, n_kv_heads=heads, n_layers=layers, max_seq_len=seq, vocab_size=128)
            plan = fxshard.Plan(fxshard.MeshSpec(("cp",), (n,)), {"layers.*.attention": fxshard.context_parallel("cp", method=method)},
                                inputs={"tokens": {"cp": Shard(1)}})
            ids = tokens(batch, seq, 128)
            s = fxshard.comm_summary(fxshard.transform(model, plan, (ids,)))
            fwd = sum(r.bytes for r in s.select("forward", axis="cp"))
            bwd = sum(r.bytes for r in s.select("backward", axis="cp") if r.op != "grad_sync_bucket")
            measured = _measured(model, method, n, ids)
            kv = batch * heads * seq * hd * 4  # one K (or V) of the whole sequence, float32
            if method == "allgather":
                want_f, want_b = layers * 2 * kv, layers * 2 * kv
            else:
                want_f, want_b = layers * 2 * (n - 1) * kv // n, layers * (4 * n - 2) * kv // n
            rows.append({"method": method, "cp": n, "fwd_bytes": fwd, "bwd_bytes": bwd, "fwd_measured": measured["forward"],
                         "bwd_measured": measured["backward"], "fwd_analytical": want_f,
                         "bwd_analytical": want_b, "calls": len([r for r in s.rows if r.axis == "cp" and r.op != "grad_sync_bucket"])})
    return rows


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once, counting every storage an op
    creates until it is freed (what the allocator must hold, allocator-independent)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.distributed._local_tensor.LocalTensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    n = st.nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, n)
        return out

    def _free(self, key, n):
        self._seen.discard(key)
        self.live -= n


def _attention_peak(rank, world, method, seq, heads, hd, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        fxshard.bind_mesh(mesh)
    t = seq // world
    q, k, v = (torch.randn(1, heads, t, hd, requires_grad=True) for _ in range(3))
    meter = LiveTensorBytes()
    with meter:
        _attention(method, world, q, k, v)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "peak_mib": meter.peak / 2**20}, f)
    if world > 1:
        dist.barrier()


def _attention(method, world, q, k, v):
    if method == "one device, flash":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif method == "one device, math":
        t = q.size(-2)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    elif method == "ring":
        o = fxshard.ring_attention(q, k, v, "cp", is_causal=True, load_balance=True)
    else:
        k_all, v_all = fxshard.all_gather(k, "cp", 2, grad="partial"), fxshard.all_gather(v, "cp", 2, grad="partial")
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=fxshard.context_parallel_mask(q, "cp", load_balance=True))
    o.sum().backward()


def memory_rows(cps, seq, heads, hd, tmp):
    rows = []
    configs = [("one device, flash", 1), ("one device, math", 1)] + [(m, n) for m in ("allgather", "ring") for n in cps]
    for i, (method, n) in enumerate(configs):
        out = os.path.join(tmp, f"mem_{i}")
        spawn(_attention_peak, n, method, seq, heads, hd, out)
        peaks = [json.load(open(f"{out}.{r}"))["peak_mib"] for r in range(n)]
        rows.append({"method": method, "cp": n, "seq": seq, "max_rank_peak_mib": max(peaks)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", default="2,4")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096, help="sequence length of the memory rows")
    p.add_argument("--comm-seq", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cps = [int(x) for x in a.cp.split(",")]
    print(describe_machine())
    comm = comm_rows(cps, a.batch, a.comm_seq, 64, 4, 2)
    print(f"\ncommunication per training step, Llama dim 64, 4 heads, 2 layers, B={a.batch}, T={a.comm_seq} (cp axis)")
    shown = [dict(r, fwd=fmt_bytes(r["fwd_measured"]), fwd_s=fmt_bytes(r["fwd_bytes"]), fwd_a=fmt_bytes(r["fwd_analytical"]),
                  bwd=fmt_bytes(r["bwd_measured"]), bwd_s=fmt_bytes(r["bwd_bytes"]), bwd_a=fmt_bytes(r["bwd_analytical"])) for r in comm]
    print(table(shown, [("method", "method", ""), ("cp", "cp", "d"), ("fwd", "forward measured", ""), ("fwd_s", "summary", ""),
                        ("fwd_a", "analytical", ""), ("bwd", "backward measured", ""), ("bwd_s", "summary", ""),
                        ("bwd_a", "analytical", ""), ("calls", "calls", "d")]))
    mem = []
    if not a.no_memory:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            mem = memory_rows(cps, a.seq, a.heads, a.head_dim, tmp)
        one = mem[1]["max_rank_peak_mib"]
        print(f"\nattention forward + backward, peak live tensor memory per rank, T={a.seq}, {a.heads} heads x {a.head_dim} "
              f"(fraction of one device's math attention)")
        for r in mem:
            r["of_one_device"] = r["max_rank_peak_mib"] / one
        print(table(mem, [("method", "method", ""), ("cp", "cp", "d"), ("max_rank_peak_mib", "peak per rank (MiB)", ".0f"),
                          ("of_one_device", "of one device", ".2f")]))
    path = write_json("context_parallel", vars(a), {"comm": comm, "memory": mem}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
