"""Communication: collectives and bytes per training step, per model and plan.

For each case (model family x plan) one training step (forward with the loss,
backward, SGD step) runs on ``--tp`` simulated ranks (fake process group +
``LocalTensorMode``, one process; the MoE case, whose all-to-all sizes follow the
routing, on ``--tp`` real gloo ranks, as the MoE tests run it) and every ``torch.ops._c10d_functional`` call
is recorded with its size -- what gloo/NCCL would be asked to do:

* ``fxshard``: the transformed ``WithLoss(model)``, measured; its static
  ``fxshard.comm_summary`` must list the same forward/backward calls (column ``check``);
* ``dtensor``: ``parallelize_module`` with the equivalent torch plan, measured (and the
  call count cross-checked with ``torch.distributed.tensor.debug.CommDebugMode``);
* ``minimum``: the analytical Megatron minimum for the same placements
  (:func:`megatron_minimum`, formula below).

Bytes: ``buffer`` is the larger buffer of each call, as nccl-tests counts it (the
all-reduced tensor, the gathered output, the unscattered input); ``wire`` is what one
rank sends with ring algorithms: ``2 (n-1)/n`` of the buffer for an all-reduce,
``(n-1)/n`` for all-gather / reduce-scatter / all-to-all.

    python benchmarks/communication.py              # tp=4, every case
    python benchmarks/communication.py --tp 2 --cases llama_dense,llama_sp
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, fmt_bytes, plain, simulated, table, write_json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fxshard  # noqa: E402
from fxshard.testing.bench_contenders import localize_llama_heads, torch_llama_plan  # noqa: E402
from fxshard.testing.launch import spawn  # noqa: E402
from fxshard.debug.comm_summary import comm_summary  # noqa: E402
from fxshard.testing.models import WithLoss, gpt2, gpt2_plan, llama, llama_plan, tokens  # noqa: E402

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
_C10D_KIND = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
# the loss-parallel and MoE ops of fxshard call these through torch.ops._c10d_functional too
PHASES = ("forward", "backward", "optimizer")


# --------------------------------------------------------------------------- measuring


class CollectiveLog(TorchDispatchMode):
    """Records ``(phase, kind, buffer bytes)`` of every functional collective call.

    Example::

        log = CollectiveLog()
        with log.phase("forward"):
            out = model(x)
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []
        self.current = "forward"

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current = name
        with self:
            yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first (as CommDebugMode does)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in _C10D_KIND:
            x = args[0]
            nbytes = x.numel() * x.element_size()
            if name == "all_gather_into_tensor":
                nbytes *= args[1]  # the gathered output
            self.calls.append((self.current, _C10D_KIND[name], nbytes))
        return func(*args, **(kwargs or {}))


def _wire(kind: str, nbytes: float, n: int) -> float:
    return nbytes * (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)


@dataclass
class Tally:
    """Calls per phase and kind, and bytes, of one contender on one case."""

    calls: list  # (phase, kind, buffer bytes, count)
    n: int

    def count(self, phase: str | None = None) -> int:
        return sum(c for p, _, _, c in self.calls if phase in (None, p))

    def kinds(self) -> str:
        per = Counter()
        for _, k, _, c in self.calls:
            per[k] += c
        return " + ".join(f"{per[k]} {SHORT[k]}" for k in KINDS if per[k]) or "none"

    def buffer(self) -> float:
        return sum(b * c for _, _, b, c in self.calls)

    def wire(self) -> float:
        return sum(_wire(k, b, self.n) * c for _, k, b, c in self.calls)

    def row(self, case: str, contender: str, minimum: "Tally | None", **extra) -> dict:
        return dict(case=case, contender=contender, forward=self.count("forward"), backward=self.count("backward"),
                    optimizer=self.count("optimizer"), total=self.count(), by_kind=self.kinds(),
                    buffer_bytes=self.buffer(), wire_bytes=self.wire(),
                    buffer=fmt_bytes(self.buffer()), wire=fmt_bytes(self.wire()),
                    wire_vs_min=self.wire() / minimum.wire() if minimum and minimum.wire() else None,
                    calls_vs_min=self.count() / minimum.count() if minimum and minimum.count() else None, **extra)


def _tally(log_calls, n) -> Tally:
    return Tally([(p, k, b, c) for (p, k, b), c in Counter(log_calls).items()], n)


# --------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """A model family and a plan, for fxshard and (when one exists) for DTensor."""

    name: str
    family: str  # "llama" | "gpt2" | "moe" | "hf_moe:<HF model_type>" | "hf_moe_dispatch:<HF model_type>"
    sequence_parallel: bool
    loss_parallel: bool
    describe: str
    dtensor_note: str | None = None  # why there is no DTensor contender
    axis: str = "tp"


CASES = {
    "llama_dense": Case("llama_dense", "llama", False, False, "Llama, Megatron TP (q/k/v, w1/w3 colwise; o, w2 rowwise)"),
    "llama_loss_parallel": Case("llama_loss_parallel", "llama", False, True, "Llama dense + colwise LM head, loss parallel"),
    "llama_sp": Case("llama_sp", "llama", True, False, "Llama sequence parallel, logits gathered"),
    "llama_sp_loss_parallel": Case("llama_sp_loss_parallel", "llama", True, True, "Llama sequence parallel + loss parallel"),
    "gpt2_dense": Case("gpt2_dense", "gpt2", False, False, "GPT-2 TP, vocab-parallel wte, colwise head (logits gathered)",
                       dtensor_note="fused c_attn: ColwiseParallel shards q|k|v rows contiguously (wrong); no torch style"),
    "gpt2_sp_loss_parallel": Case("gpt2_sp_loss_parallel", "gpt2", True, True, "GPT-2 sequence parallel + loss parallel",
                                  dtensor_note="fused c_attn: ColwiseParallel shards q|k|v rows contiguously (wrong); no torch style"),
    # expert parallel: the routing decides the all-to-all sizes; this case runs on real gloo
    # ranks (--tp of them, on the "ep" axis), as the MoE tests do
    "moe_expert_parallel": Case("moe_expert_parallel", "moe", False, False,
                                "Mixtral-style MoE (fxshard.testing.moe_models.mixtral, 2 experts per rank, top-2), "
                                "expert parallel, batch sharded over ep (real gloo ranks)",
                                dtensor_note="no parallelize_module style for expert parallelism", axis="ep"),
    # HF transformers MoE (routed experts, Plan.from_hf on an ("ep",) mesh): tokens replicated over ep,
    # each rank its experts' share, one all-reduce per MoE layer (simulated ranks)
    "hf_mixtral_ep": Case("hf_mixtral_ep", "hf_moe:mixtral", False, False,
                          "HF MixtralForCausalLM (tiny: 4 experts, top-2), Plan.from_hf on ('ep',): routed experts",
                          dtensor_note="HF's own EP is the contender (same scheme): not measured here", axis="ep"),
    "hf_qwen2_moe_ep": Case("hf_qwen2_moe_ep", "hf_moe:qwen2_moe", False, False,
                            "HF Qwen2MoeForCausalLM (tiny: 4 experts, top-2, shared expert), Plan.from_hf on ('ep',)",
                            dtensor_note="HF's own EP is the contender (same scheme): not measured here", axis="ep"),
    # the batch sharded over ep and each rank's tokens dispatched to their experts' ranks
    # (routed_experts(dispatch="all_to_all")): real gloo ranks, as the all-to-alls need
    "hf_mixtral_ep_dispatch": Case("hf_mixtral_ep_dispatch", "hf_moe_dispatch:mixtral", False, False,
                                   "HF MixtralForCausalLM, batch sharded over ep, routed_experts(dispatch='all_to_all') "
                                   "(real gloo ranks)", dtensor_note="HF's EP keeps tokens replicated: no such scheme",
                                   axis="ep"),
}

DEFAULT_CASES = list(CASES)


@dataclass(frozen=True)
class Shapes:
    batch: int = 4
    seqlen: int = 16
    dim: int = 64
    n_layers: int = 2
    vocab: int = 128


def _llama(s: Shapes):
    return llama(seed=0, dim=s.dim, n_layers=s.n_layers, n_heads=8, n_kv_heads=4, vocab_size=s.vocab,
                 ffn_hidden=2 * s.dim, max_seq_len=max(32, s.seqlen))


def _gpt2(s: Shapes):
    return gpt2(seed=0, dim=s.dim, n_layers=s.n_layers, n_heads=4, vocab_size=s.vocab, n_positions=max(32, s.seqlen))


def _moe(s: Shapes, n: int):
    from fxshard.testing.moe_models import mixtral

    return mixtral(seed=0, dim=s.dim, n_layers=s.n_layers, vocab_size=s.vocab, n_experts=2 * n, top_k=2,
                   ffn_hidden=2 * s.dim, max_seq_len=max(32, s.seqlen))


def _fx_plan(case: Case) -> dict:
    if case.family == "llama":
        plan = llama_plan("tp", sequence_parallel=case.sequence_parallel, loss_parallel=case.loss_parallel)
    elif case.family == "gpt2":
        plan = gpt2_plan("tp", sequence_parallel=case.sequence_parallel, loss_parallel=case.loss_parallel)
    else:
        from fxshard.testing.moe_models import mixtral_plan

        plan = mixtral_plan("ep")
    return {"model." + k: v for k, v in plan.items()}


# --------------------------------------------------------------------------- the minimum


def megatron_minimum(case: Case, s: Shapes, n: int, norm_params: int = 0, n_experts: int = 0, top_k: int = 2) -> Tally:
    """The fewest collectives and bytes that the case's placements need, as Megatron-LM
    implements them (Shoeybi et al. 2019; sequence parallelism: Korthikanti et al. 2022).

    With ``T = batch * seqlen`` tokens, hidden ``d``, vocab ``V``, ``L`` layers, fp32
    (4 bytes), per training step on one rank:

    * each attention block and each MLP block (2 per layer):
      tensor parallel: forward all-reduce(T d) ("g"), backward all-reduce(T d) ("f");
      sequence parallel: forward all-gather(T d) + reduce-scatter(T d), backward the same pair;
    * sequence parallel also all-reduces the gradients of the replicated parameters applied
      to sequence shards (norm weights/biases, row-parallel biases): one bucketed
      all-reduce of ``norm_params`` elements;
    * token embedding: replicated: nothing; vocab parallel: forward all-reduce(T d)
      (reduce-scatter(T d) + backward all-gather(T d) when the output is sequence-sharded);
    * learned positions (GPT-2) under sequence parallelism: each rank looks up its own
      rows of the replicated table, whose gradient must then be made whole on every
      rank: one collective, a backward all-gather of the ``seqlen d`` rows (fewer bytes
      than summing the whole ``n_positions d`` table in the bucket; Megatron-LM instead
      adds the positions before one scatter of the whole ``T d``, and so all-reduces the
      word embeddings: more bytes);
    * LM head: replicated: nothing; column parallel on a replicated input: backward
      all-reduce(T d); on a sequence-sharded input: forward all-gather(T d), backward
      reduce-scatter(T d); logits gathered: forward all-gather(T V); loss parallel: three
      all-reduces of one value per token (max, target logit, sum of exponentials), no
      backward communication (the gradient ``softmax - onehot`` is local);
    * MoE layer (expert parallel over ``n`` ranks, batch sharded over them, ``E`` experts,
      top-``k``): forward an all-to-all of the per-expert token counts (``E`` int64), the
      dispatch and the combine all-to-alls of the ``T/n * k`` routed tokens of ``d``;
      backward the two reverse all-to-alls; and, as the batch is sharded, the gradients of
      every replicated (non-expert) parameter summed: one bucketed all-reduce of their
      ``norm_params`` elements (DDP-style).
    """
    T, d, V, L, f = s.batch * s.seqlen, s.dim, s.vocab, s.n_layers, 4
    act, calls = T * d * f, []

    def add(phase, kind, nbytes, count=1):
        if count:
            calls.append((phase, kind, nbytes, count))

    if case.family == "moe":
        routed = T // n * top_k * d * f
        add("forward", "all_to_all", n_experts * 8, L)
        add("forward", "all_to_all", routed, 2 * L)
        add("backward", "all_to_all", routed, 2 * L)
        add("backward", "all_reduce", norm_params * f)
        return Tally(calls, n)
    if case.sequence_parallel:
        add("forward", "all_gather", act, 2 * L)
        add("forward", "reduce_scatter", act, 2 * L)
        add("backward", "reduce_scatter", act, 2 * L)
        add("backward", "all_gather", act, 2 * L)
        add("backward", "all_reduce", norm_params * f)
    else:
        add("forward", "all_reduce", act, 2 * L)
        add("backward", "all_reduce", act, 2 * L)
    if case.family == "gpt2" and case.sequence_parallel:
        add("backward", "all_gather", s.seqlen * d * f)
    vocab_parallel_embedding = case.family == "gpt2" or case.sequence_parallel
    if vocab_parallel_embedding and case.sequence_parallel:
        add("forward", "reduce_scatter", act)
        add("backward", "all_gather", act)
    elif vocab_parallel_embedding:
        add("forward", "all_reduce", act)
    colwise_head = case.family == "gpt2" or case.sequence_parallel or case.loss_parallel
    if colwise_head and case.sequence_parallel:
        add("forward", "all_gather", act)
        add("backward", "reduce_scatter", act)
    elif colwise_head:
        add("backward", "all_reduce", act)
    if colwise_head and case.loss_parallel:
        add("forward", "all_reduce", T * f, 3)
    elif colwise_head:
        add("forward", "all_gather", T * V * f)
    return Tally(calls, n)


def _sequence_parallel_params(case: Case, s: Shapes) -> int:
    """Elements of the replicated parameters applied to sequence shards (their grads are summed)."""
    if not case.sequence_parallel:
        return 0
    L, d = s.n_layers, s.dim
    if case.family == "llama":
        return (2 * L + 1) * d  # attention_norm, ffn_norm per layer, final norm
    return (2 * L + 1) * 2 * d + 2 * L * d  # LayerNorm weight+bias, and the two row-parallel biases per layer


# --------------------------------------------------------------------------- running one case


def _step(log: CollectiveLog, forward: Callable[[], torch.Tensor], params) -> torch.Tensor:
    opt = torch.optim.SGD(params, lr=0.01)
    with log.phase("forward"):
        loss = forward()
    with log.phase("backward"):
        loss.backward()
    with log.phase("optimizer"):
        opt.step()
    return loss


def _fxshard(case: Case, s: Shapes, mesh, n: int):
    with plain():
        model = _llama(s) if case.family == "llama" else _gpt2(s)
        ids, tgt = tokens(s.batch, s.seqlen, s.vocab, seed=1), tokens(s.batch, s.seqlen, s.vocab, seed=2)
        reference = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).item()
    plan = _fx_plan(case)
    sharded = fxshard.transform(WithLoss(model), fxshard.Plan(mesh, plan), (ids, tgt))
    static = comm_summary(sharded)
    log = CollectiveLog()
    loss = _step(log, lambda: sharded(ids, tgt), sharded.parameters())
    tally = _tally(log.calls, n)
    static_calls = Counter((r.phase, r.kind, r.bytes) for r in static.rows)
    measured = Counter({(p, k, b): c for p, k, b, c in tally.calls if p != "optimizer"})
    loss_ok = max(abs(_value(loss, r) - reference) for r in range(n)) < 1e-4
    return tally, dict(static_ok="yes" if static_calls == measured else "NO", loss_ok="yes" if loss_ok else "NO")


def _dtensor(case: Case, s: Shapes, mesh, n: int):
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    if case.dtensor_note:
        return None, f"n/a: {case.dtensor_note}"
    with plain():
        model = _llama(s)
        ids, tgt = tokens(s.batch, s.seqlen, s.vocab, seed=1), tokens(s.batch, s.seqlen, s.vocab, seed=2)
        reference = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).item()
    pm = localize_llama_heads(parallelize_module(copy.deepcopy(model), mesh,
                                                 torch_llama_plan(case.sequence_parallel, case.loss_parallel)), n)

    def forward():  # runs inside loss_parallel() (not nested: leaving a nested one disables it)
        return F.cross_entropy(pm(ids).flatten(0, 1), tgt.flatten())

    log, cdm = CollectiveLog(), CommDebugMode()
    with cdm:
        with loss_parallel() if case.loss_parallel else contextlib.nullcontext():
            loss = _step(log, forward, pm.parameters())
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss_ok = max(abs(_value(loss, r) - reference) for r in range(n)) < 1e-4
    tally = _tally(log.calls, n)
    return tally, dict(commdebugmode=cdm.get_total_counts(), loss_ok="yes" if loss_ok else "NO",
                       static_ok="yes" if cdm.get_total_counts() == tally.count() else "NO")


def _value(t, rank):
    local = getattr(t, "_local_tensors", None)
    return float((t if local is None else local[rank]).item())


def _hf_moe(case: Case, s: Shapes, n: int) -> list[dict]:
    """fxshard on an HF MoE model, measured on ``n`` simulated ep ranks, against the
    minimum of its scheme: per MoE layer the all-reduce of the experts' output [N, H]
    forward, and backward the all-reduces of the gradients of the tokens [N, H] and of the
    routing weights [N, k] that enter the experts (nothing else is sharded)."""
    from fxshard.testing.hf_tiny import tiny_model

    family = case.family.split(":", 1)[1]
    with plain():
        model = tiny_model(family)
        ids, labels = tokens(s.batch, s.seqlen, s.vocab, seed=1), tokens(s.batch, s.seqlen, s.vocab, seed=2)
        reference = model(input_ids=ids, labels=labels).loss.item()
    cfg = model.config
    layers = [i for i, layer in enumerate(model.model.layers) if hasattr(getattr(layer, "mlp", None), "experts")]
    n_tok, hidden, k = s.batch * s.seqlen, cfg.hidden_size, cfg.num_experts_per_tok
    per_layer = [("forward", "all_reduce", n_tok * hidden * 4), ("backward", "all_reduce", n_tok * hidden * 4),
                 ("backward", "all_reduce", n_tok * k * 4)]
    minimum = Tally([(p, kind, b, len(layers)) for p, kind, b in per_layer], n)
    with simulated({"ep": n}) as mesh:
        sharded = fxshard.transform(model, fxshard.Plan.from_hf(mesh, model), example_kwargs={"input_ids": ids, "labels": labels})
        static = comm_summary(sharded)
        log = CollectiveLog()
        loss = _step(log, lambda: sharded(input_ids=ids, labels=labels).loss, sharded.parameters())
        tally = _tally(log.calls, n)
    static_calls = Counter((r.phase, r.kind, r.bytes) for r in static.rows)
    measured = Counter({(p, kind, b): c for p, kind, b, c in tally.calls if p != "optimizer"})
    loss_ok = max(abs(_value(loss, r) - reference) for r in range(n)) < 1e-4
    return [tally.row(case.name, "fxshard", minimum, static_ok="yes" if static_calls == measured else "NO",
                      loss_ok="yes" if loss_ok else "NO"),
            dict(case=case.name, contender="dtensor", note=f"n/a: {case.dtensor_note}"),
            minimum.row(case.name, "minimum", minimum)]


def run_case(case: Case, s: Shapes, n: int) -> list[dict]:
    if case.family == "moe" or case.family.startswith("hf_moe_dispatch:"):
        return _run_moe_case(case, s, n)
    if case.family.startswith("hf_moe:"):
        return _hf_moe(case, s, n)
    rows = []
    minimum = megatron_minimum(case, s, n, _sequence_parallel_params(case, s))
    with simulated({case.axis: n}) as mesh:
        for contender, measure in (("fxshard", _fxshard), ("dtensor", _dtensor)):
            tally, extra = measure(case, s, mesh, n)
            if tally is None:
                rows.append(dict(case=case.name, contender=contender, note=extra))
            else:
                rows.append(tally.row(case.name, contender, minimum, **extra))
    rows.append(minimum.row(case.name, "minimum", minimum))
    return rows


# --------------------------------------------------------------------------- MoE on real ranks


def _moe_rank(rank: int, n: int, s: Shapes, out_path: str) -> None:
    """One rank of the MoE case: the collectives of one step, the local loss, the static counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("ep",))
    # a sum over each rank's tokens: a mean per rank is refused over a batch-sharded axis (the
    # mean of the ranks' means is not the global mean once targets are ignored)
    model = WithLoss(_moe(s, n), reduction="sum")
    ids, tgt = tokens(s.batch, s.seqlen, s.vocab, seed=1), tokens(s.batch, s.seqlen, s.vocab, seed=2)
    batch_sharded = {"tokens": {"ep": Shard(0)}, "targets": {"ep": Shard(0)}}
    plan = fxshard.Plan(mesh, _fx_plan(CASES["moe_expert_parallel"]), inputs=batch_sharded)
    sharded = fxshard.transform(model, plan, (ids, tgt))
    static = comm_summary(sharded)
    mine = slice(rank * s.batch // n, (rank + 1) * s.batch // n)
    log = CollectiveLog()
    loss = _step(log, lambda: sharded(ids[mine], tgt[mine]), sharded.parameters())
    gathered = [None] * n
    dist.all_gather_object(gathered, dict(calls=log.calls, loss=loss.item(),
                                          static={p: static.count(p) for p in ("forward", "backward")}))
    if rank == 0:
        replicated = sum(p.numel() for name, p in model.named_parameters() if ".experts." not in name)
        reference = F.cross_entropy(model.model(ids).flatten(0, 1), tgt.flatten()).item()
        with open(out_path, "w") as fh:
            json.dump(dict(ranks=gathered, replicated_params=replicated, reference=reference,
                           n_experts=model.model.args.n_experts, top_k=model.model.args.top_k), fh)


def _hf_dispatch_rank(rank: int, n: int, s: Shapes, family: str, out_path: str) -> None:
    """One rank of the HF dispatch case: the collectives of one step, the rank's summed
    loss, the static counts (which cannot list the all-to-alls inside the experts' call)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fxshard.testing.hf_tiny import tiny_model

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("ep",))
    model = tiny_model(family)
    ids, tgt = tokens(s.batch, s.seqlen, s.vocab, seed=1), tokens(s.batch, s.seqlen, s.vocab, seed=2)
    spec = fxshard.routed_experts(ep="ep", tokens=Shard(0), dispatch="all_to_all")
    plan = fxshard.Plan(mesh, {"model.layers.*.mlp.experts": spec}, inputs={"input_ids": {"ep": Shard(0)}})
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids})
    static = comm_summary(sharded)
    mine = slice(rank * s.batch // n, (rank + 1) * s.batch // n)

    def loss():
        logits = sharded(input_ids=ids[mine]).logits
        return F.cross_entropy(logits.flatten(0, 1), tgt[mine].flatten(), reduction="sum")

    log = CollectiveLog()
    value = _step(log, loss, sharded.parameters())
    gathered = [None] * n
    dist.all_gather_object(gathered, dict(calls=log.calls, loss=value.item(),
                                          static=[(r.phase, r.kind) for r in static.rows]))
    if rank == 0:
        cfg = model.config
        layers = sum(1 for name, _ in model.named_modules() if name.endswith("mlp.experts"))
        replicated = sum(p.numel() for name, p in model.named_parameters() if ".experts." not in name)
        reference = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), tgt.flatten()).item()
        n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        with open(out_path, "w") as fh:
            json.dump(dict(ranks=gathered, replicated_params=replicated, reference=reference, n_experts=n_experts,
                           top_k=cfg.num_experts_per_tok, dim=cfg.hidden_size, n_layers=layers), fh)


def _run_moe_case(case: Case, s: Shapes, n: int) -> list[dict]:
    """fxshard on ``n`` real gloo ranks: calls are the same on every rank, all-to-all sizes
    follow the routing, so bytes are the mean over ranks."""
    if s.batch % n:
        return [dict(case=case.name, contender="fxshard", note=f"skipped: batch {s.batch} is not divisible by {n} ranks")]
    hf = case.family.startswith("hf_moe_dispatch:")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "moe.json")
        if hf:
            spawn(_hf_dispatch_rank, n, s, case.family.split(":", 1)[1], out_path)
        else:
            spawn(_moe_rank, n, s, out_path)
        with open(out_path) as fh:
            got = json.load(fh)
    if hf:  # the minimum of the scheme at the HF model's own width and MoE layers
        s = dataclasses.replace(s, dim=got["dim"], n_layers=got["n_layers"])
    per_rank = [[tuple(c) for c in r["calls"]] for r in got["ranks"]]
    if len({tuple((p, k) for p, k, _ in calls) for calls in per_rank}) != 1:
        raise AssertionError(f"{case.name}: the ranks ran different collectives: {per_rank}")
    mean_calls = [(p, k, sum(calls[i][2] for calls in per_rank) / n) for i, (p, k, _) in enumerate(per_rank[0])]
    tally = _tally(mean_calls, n)
    mean_loss = sum(r["loss"] for r in got["ranks"]) / (s.batch * s.seqlen)  # the ranks' sums over all tokens
    measured = {p: tally.count(p) for p in ("forward", "backward")}
    minimum = megatron_minimum(dataclasses.replace(case, family="moe"), s, n, got["replicated_params"], got["n_experts"],
                               got["top_k"])
    note = "bytes: mean over ranks (routing-dependent); check: call counts"
    if hf:  # the all-to-alls run inside the experts' call: the static summary lists the rest
        listed = Counter((p, k) for p, k, _ in per_rank[0] if p != "optimizer" and k != "all_to_all")
        static_ok = all(Counter(map(tuple, r["static"])) == listed for r in got["ranks"])
        note = "bytes: mean over ranks (routing-dependent); check: the calls but the experts' all-to-alls"
    else:
        static_ok = all(r["static"] == measured for r in got["ranks"])
    return [tally.row(case.name, "fxshard", minimum, loss_ok="yes" if abs(mean_loss - got["reference"]) < 1e-4 else "NO",
                      static_ok="yes" if static_ok else "NO", note=note),
            dict(case=case.name, contender="dtensor", note=f"n/a: {case.dtensor_note}"),
            minimum.row(case.name, "minimum", minimum)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4, help="simulated tensor-parallel ranks")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, from {list(CASES)}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


COLUMNS = [("case", "case", ""), ("contender", "contender", ""), ("forward", "fwd", "d"), ("backward", "bwd", "d"),
           ("optimizer", "opt", "d"), ("total", "calls", "d"), ("by_kind", "by kind", ""), ("buffer", "buffer", ""),
           ("wire", "wire/rank", ""), ("calls_vs_min", "calls/min", ".2f"), ("wire_vs_min", "wire/min", ".2f"),
           ("static_ok", "check", ""), ("loss_ok", "loss ok", ""), ("note", "note", "")]


def main(argv=None) -> int:
    args = parse_args(argv)
    s = Shapes(args.batch, args.seqlen, args.dim, args.n_layers, args.vocab)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(CASES)}")
    rows = []
    for name in names:
        rows += run_case(CASES[name], s, args.tp)
    print(f"communication per training step (forward + loss, backward, SGD) at tp={args.tp} (MoE: ep={args.tp}), "
          f"simulated ranks (MoE: real gloo ranks); "
          f"T = {s.batch}x{s.seqlen} tokens, dim {s.dim}, {s.n_layers} layers, vocab {s.vocab}, fp32")
    print(f"machine: {describe_machine()}")
    for name in names:
        print(f"  {name}: {CASES[name].describe}")
    print()
    print(table(rows, COLUMNS))
    print("\ncheck: fxshard: the static fxshard.comm_summary lists exactly the measured forward/backward calls; "
          "dtensor: CommDebugMode counts the same calls as the log.\nloss ok: the sharded loss equals the "
          "single-device loss.  minimum: megatron_minimum() in this script (formula in its docstring).")
    config = dict(tp=args.tp, cases=names, shapes=s.__dict__)
    path = write_json("communication", config, rows, args.out)
    print(f"results: {path}")
    bad = [r for r in rows if r.get("static_ok") == "NO" or r.get("loss_ok") == "NO"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
