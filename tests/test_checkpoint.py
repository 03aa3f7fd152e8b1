"""fxshard.save / fxshard.load: DCP checkpoints of shards and optimizer state, saved at
one mesh and loaded at another (tp=4 -> tp=2, dp x tp, one device), on real gloo ranks.

The reference is the uninterrupted run: 4 AdamW steps at tp=4.  A run that saves after 2
steps and continues elsewhere for 2 more must end at the same weights (to float
round-off across meshes, exactly at the same mesh).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import Plan
from fxshard.state.checkpoint import ShardView, _runs_of_view
from fxshard.state.shards import shard_runs
from fxshard.testing.models import LlamaArgs, llama, llama_plan, tokens

from harness import make_mesh, spawn
from fxshard.meta import program_meta

ARGS = LlamaArgs(n_heads=8, n_kv_heads=4, fused_qkv=True, fused_w13=True)  # fused: a shard is several boxes
IDS = tokens(4, 8, 128, seed=1)
TGT = tokens(4, 8, 128, seed=2)


def _model():
    return llama(seed=0, args=ARGS)


def _loss(logits):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), TGT.flatten())


def _steps(model, opt, n, ids=IDS):
    for _ in range(n):
        opt.zero_grad()
        _loss(model(ids)).backward()
        opt.step()


def _sharded(mesh_shape, batch_on_dp=False):
    mesh = make_mesh(mesh_shape)
    inputs = {"tokens": {"dp": Shard(0)}} if batch_on_dp else {}
    plan = Plan(mesh, llama_plan("tp", fused=True, args=ARGS), inputs=inputs)
    return fxshard.transform(_model(), plan, (IDS,))


def _opt(module):
    return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _train_save_train(module, opt, steps, root, name, rank):
    """2 steps, a save into ``root/name``, 2 more: the uninterrupted run's full state
    (rank 0 also writes it to ``root/name_full.pt`` for the one-device checks)."""
    steps(module, opt, 2)
    fxshard.save(module, os.path.join(root, name), optimizer=opt)
    steps(module, opt, 2)
    full = fxshard.full_state_dict(module)
    if rank == 0:
        torch.save(full, os.path.join(root, f"{name}_full.pt"))
    return full


def _save_at_tp4(rank, world_size, root):
    sharded = _sharded({"tp": 4})
    opt = _opt(sharded)
    full = _train_save_train(sharded, opt, _steps, root, "step2", rank)
    # the same mesh again: exactly the uninterrupted run
    again = _sharded({"tp": 4})
    opt2 = _opt(again)
    fxshard.load(again, os.path.join(root, "step2"), optimizer=opt2)
    _steps(again, opt2, 2)
    for k, v in fxshard.full_state_dict(again).items():
        assert torch.equal(v, full[k]), f"tp=4 -> tp=4: {k}"


def _resume(rank, world_size, root, mesh_shape, batch_on_dp):
    sharded = _sharded(mesh_shape, batch_on_dp)
    opt = _opt(sharded)
    fxshard.load(sharded, os.path.join(root, "step2"), optimizer=opt)
    assert opt.state, "optimizer state was not restored"
    if batch_on_dp:
        dp = program_meta(sharded).mesh["dp"]
        coord = fxshard.bound_mesh().get_coordinate()[0]
        ids = IDS.chunk(dp)[coord]
        # a mean loss over the dp-sharded batch: average the per-rank losses' gradients
        for _ in range(2):
            opt.zero_grad()
            logits = sharded(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), TGT.chunk(dp)[coord].flatten())
            loss.backward()
            for p in sharded.parameters():
                fxshard.all_reduce(p.grad.div_(dp), "dp")
            opt.step()
    else:
        _steps(sharded, opt, 2)
    full = fxshard.full_state_dict(sharded)
    want = torch.load(os.path.join(root, "step2_full.pt"))
    for k, v in full.items():
        torch.testing.assert_close(v, want[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"{mesh_shape}: {k}: {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    spawn(_save_at_tp4, 4, root)
    return root


def test_resume_at_tp2(saved):
    spawn(_resume, 2, saved, {"tp": 2}, False)


def test_resume_at_dp2_tp2(saved):
    spawn(_resume, 4, saved, {"dp": 2, "tp": 2}, True)


def test_resume_on_one_device(saved):
    """The plain single-device model loads the tp=4 checkpoint without a process group."""
    model = _model()
    opt = _opt(model)
    fxshard.load(model, os.path.join(saved, "step2"), optimizer=opt)
    _steps(model, opt, 2)
    want = torch.load(os.path.join(saved, "step2_full.pt"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"one device: {k}: {m}")


def _fsdp_round_trip(rank, world_size, root):
    """dp x tp with FSDP2 over dp: a parameter is FSDP2's dim-0 piece of fxshard's shard.
    Saved, it is the global tensor; loaded into fresh FSDP2-wrapped shards, it is back."""
    mesh = make_mesh({"dp": 2, "tp": 2})
    plan = Plan(mesh, llama_plan("tp", fused=True, args=ARGS), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.fully_shard(fxshard.transform(_model(), plan, (IDS,)), mesh)
    fxshard.save(sharded, os.path.join(root, "fsdp"))
    want = fxshard.full_state_dict(sharded)
    if rank == 0:
        torch.save(want, os.path.join(root, "fsdp_full.pt"))
    other = fxshard.transform(llama(seed=9, args=ARGS), plan, (IDS,))
    fxshard.fully_shard(other, mesh)
    fxshard.load(other, os.path.join(root, "fsdp"))
    for k, v in fxshard.full_state_dict(other).items():
        assert torch.equal(v, want[k]), k

    # with AdamW: 2 steps, save, 2 more; a fresh model resumed from the save ends bit for bit the same
    _, mine = fxshard.shard_inputs(sharded, tokens=IDS)
    dp = mesh.get_local_rank("dp")
    targets = TGT.chunk(2)[dp]

    def steps(module, opt, n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(module(mine["tokens"]).flatten(0, 1), targets.flatten()).backward()
            opt.step()

    uninterrupted = _train_save_train(sharded, _opt(sharded), steps, root, "fsdp_adamw", rank)
    resumed = fxshard.fully_shard(fxshard.transform(llama(seed=9, args=ARGS), plan, (IDS,)), mesh)
    opt2 = _opt(resumed)
    fxshard.load(resumed, os.path.join(root, "fsdp_adamw"), optimizer=opt2)
    steps(resumed, opt2, 2)
    for k, v in fxshard.full_state_dict(resumed).items():
        assert torch.equal(v, uninterrupted[k]), f"FSDP2 AdamW resume: {k}"

    # the dp x tp FSDP2 save resumed at tp=4 (the whole batch on every rank: the mean of the halves' means)
    tp4 = fxshard.transform(_model(), Plan(make_mesh({"tp": 4}), llama_plan("tp", fused=True, args=ARGS)), (IDS,))
    opt4 = _opt(tp4)
    fxshard.load(tp4, os.path.join(root, "fsdp_adamw"), optimizer=opt4)
    _steps(tp4, opt4, 2)
    for k, v in fxshard.full_state_dict(tp4).items():
        torch.testing.assert_close(v, uninterrupted[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"FSDP2 save -> tp=4: {k}: {m}")


def test_fsdp_shards_save_and_load(tmp_path):
    spawn(_fsdp_round_trip, 4, str(tmp_path))
    plain = llama(seed=9, args=ARGS)
    fxshard.load(plain, tmp_path / "fsdp")
    want = torch.load(tmp_path / "fsdp_full.pt")
    assert all(torch.equal(v, want[k]) for k, v in plain.state_dict().items())
    assert all(torch.equal(v, _model().state_dict()[k]) for k, v in plain.state_dict().items())

    # every optimizer state has its parameter's global shape, written as boxes that cover it once
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(tmp_path / "fsdp_adamw")).read_metadata().state_dict_metadata
    for key, m in md.items():
        if key.startswith("optim.state.") and key.endswith((".exp_avg", ".exp_avg_sq")):
            fqn = key[len("optim.state."):].rsplit(".", 1)[0]
            assert tuple(m.size) == tuple(md[f"model.{fqn}"].size), key
            assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), f"{key}: boxes {m.chunks}"

    # the dp x tp FSDP2 save resumes on one device: the mean over the two halves of the batch
    model = _model()
    opt = _opt(model)
    fxshard.load(model, tmp_path / "fsdp_adamw", optimizer=opt)
    for _ in range(2):
        opt.zero_grad()
        halves = zip(IDS.chunk(2), TGT.chunk(2))
        (sum(torch.nn.functional.cross_entropy(model(i).flatten(0, 1), t.flatten()) for i, t in halves) / 2).backward()
        opt.step()
    want = torch.load(tmp_path / "fsdp_adamw_full.pt")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"FSDP2 save -> one device: {k}: {m}")


def test_plain_round_trip_and_wrong_model(tmp_path):
    model = _model()
    opt = _opt(model)
    _steps(model, opt, 1)
    fxshard.save(model, tmp_path / "c", optimizer=opt)
    other = llama(seed=3, args=ARGS)
    fxshard.load(other, tmp_path / "c")
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
    with pytest.raises(fxshard.PlanError, match="no optimizer state"):
        fxshard.save(model, tmp_path / "d")
        fxshard.load(other, tmp_path / "d", optimizer=_opt(other))
    bigger = llama(seed=0, args=ARGS, dim=2 * ARGS.dim)
    with pytest.raises(fxshard.PlanError, match="global shape"):
        fxshard.load(bigger, tmp_path / "c")


def test_shard_view_boxes_cover_fused_parts():
    """A fused q/k/v weight at tp=2: rank 1 holds three boxes (its rows of q, k and v)."""
    runs = shard_runs({"tp": Shard(0)}, (16, 4), {"tp": 2}, {"tp": 1}, blocks=(8, 4, 4))
    view = ShardView(torch.zeros(8, 4), runs, (16, 4))
    assert sorted(tuple(o) for o in view.boxes) == [(4, 0), (10, 0), (14, 0)]
    assert [tuple(c.sizes) for c in view.__create_chunk_list__()] == [(4, 4), (2, 4), (2, 4)]
    assert _runs_of_view(view) == runs


def test_commit_latest_keep_last_and_state(tmp_path):
    """A save is visible only once committed; a partial one (a rank killed mid-save) is
    skipped by latest_checkpoint and refused by load, naming it; keep_last prunes; the
    state comes back."""
    model = _model()
    opt = _opt(model)
    _steps(model, opt, 1)
    rng = torch.get_rng_state()
    for step in (1, 2, 3):
        fxshard.save(model, tmp_path / f"step{step}", optimizer=opt, state={"step": step, "rng": rng}, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step2", "step3"]
    assert fxshard.latest_checkpoint(tmp_path) == str(tmp_path / "step3")
    # what a save killed before its commit leaves: the staging folder with data but no marker
    fxshard.save(model, tmp_path / "step4", optimizer=opt)
    os.rename(tmp_path / "step4", tmp_path / "step4.partial")
    os.remove(tmp_path / "step4.partial" / "fxshard_commit.json")
    assert fxshard.latest_checkpoint(tmp_path) == str(tmp_path / "step3")
    with pytest.raises(fxshard.PlanError, match="(?s)step4 is not a committed checkpoint.*did not finish on every rank.*latest_checkpoint"):
        fxshard.load(model, tmp_path / "step4")
    again = _model()
    state = fxshard.load(again, fxshard.latest_checkpoint(tmp_path), optimizer=_opt(again))
    assert state["step"] == 3 and torch.equal(state["rng"], rng)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    assert fxshard.latest_checkpoint(tmp_path / "nowhere") is None


class _EmbedFirst(torch.nn.Module):
    """A tied pair registered embedding first: the tied tensor's first name is ``emb.weight``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


class _HeadFirst(_EmbedFirst):
    """The same tensors and names, registered head first: the first name is ``head.weight``."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.emb = torch.nn.Embedding(32, 8)
        self.emb.weight = self.head.weight


def test_tied_state_found_under_its_other_name(tmp_path):
    """A tied parameter's optimizer state is saved under its first name; loaded into a module
    whose first name for it is the other one, the state is found, not silently left at zero."""
    torch.manual_seed(0)
    saving = _EmbedFirst()
    ids, tgt = torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6))

    def step(m, o):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), tgt.flatten()).backward()
        o.step()

    opt = torch.optim.AdamW(saving.parameters(), lr=1e-2)
    for _ in range(2):
        step(saving, opt)
    fxshard.save(saving, tmp_path / "c", optimizer=opt)
    loading = _HeadFirst()
    loading_opt = torch.optim.AdamW(loading.parameters(), lr=1e-2)
    fxshard.load(loading, tmp_path / "c", optimizer=loading_opt)
    state = loading_opt.state[loading.head.weight]
    torch.testing.assert_close(state["exp_avg"], opt.state[saving.emb.weight]["exp_avg"])
    assert float(state["step"]) == 2.0
    step(saving, opt)
    step(loading, loading_opt)
    torch.testing.assert_close(loading.head.weight, saving.emb.weight)


class _CreatesFile:
    """What a tampered checkpoint holds: unpickled, it calls ``open(path, "w")``, creating the
    file (any other code could run there)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _small_checkpoint(path, state=None):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    fxshard.save(model, path, optimizer=opt, state=state)
    return model


def test_tampered_state_file_is_refused_not_run(tmp_path):
    _small_checkpoint(tmp_path / "c", state={"step": 1})
    control, ran = tmp_path / "control", tmp_path / "ran"
    torch.save(_CreatesFile(control), tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)  # the payload is live: unpickled, it runs
    assert control.exists()
    torch.save(_CreatesFile(ran), tmp_path / "c" / "state.0.pt")
    # the commit file's sizes and digests find it first; an older checkpoint (no file list) is unpickled safely
    with pytest.raises(fxshard.PlanError, match=r"state.0.pt (has \d+ bytes|is not the file that was written)"):
        fxshard.load(torch.nn.Linear(4, 3), tmp_path / "c")
    (tmp_path / "c" / "fxshard_commit.json").write_text(json.dumps({"seq": 1, "world_size": 1}))
    with pytest.raises(fxshard.PlanError, match="(?s)state.0.pt does not load as plain data.*tampered.*was not run"):
        fxshard.load(torch.nn.Linear(4, 3), tmp_path / "c")
    assert not ran.exists()


def test_tampered_dcp_metadata_is_refused_not_run(tmp_path):
    """DCP's .metadata is a pickle that torch's FileSystemReader reads with pickle.load."""
    import pickle

    import torch.distributed.checkpoint as dcp

    _small_checkpoint(tmp_path / "c")
    control, ran = tmp_path / "control", tmp_path / "ran"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_CreatesFile(control)))
    try:
        dcp.FileSystemReader(str(tmp_path / "c")).read_metadata()  # torch's own reader runs it
    except Exception:  # noqa: BLE001 - a file object is no Metadata; what matters is that it ran
        pass
    assert control.exists()
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_CreatesFile(ran)))
    with pytest.raises(fxshard.PlanError, match=r"(?s)\.metadata does not load as plain data \((builtins|io)\.open is not a part of DCP's metadata"):
        fxshard.load(torch.nn.Linear(4, 3), tmp_path / "c")
    assert not ran.exists()


def test_tampered_dcp_value_is_refused_not_run(tmp_path):
    """A value DCP stores as bytes (the optimizer's param_groups) is a torch.save pickle, which
    DCP's DefaultLoadPlanner reads with torch.load(weights_only=False)."""
    import json

    import torch.distributed.checkpoint as dcp

    model = _small_checkpoint(tmp_path / "c")
    control, ran = tmp_path / "control", tmp_path / "ran"
    for path, marker in ((tmp_path / "d", control), (tmp_path / "c", ran)):
        sd = {"model.weight": model.weight.detach(), "model.bias": model.bias.detach(),
              "optim.param_groups": _CreatesFile(marker)}
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    dcp.load({"optim.param_groups": None}, checkpoint_id=str(tmp_path / "d"), no_dist=True)  # DCP's own load runs it
    assert control.exists()
    (tmp_path / "c" / "fxshard_commit.json").write_text(json.dumps({"seq": 1, "world_size": 1}))
    other = torch.nn.Linear(4, 3)
    with pytest.raises(fxshard.PlanError, match="(?s)'optim.param_groups' in .* does not load as plain data.*not run"):
        fxshard.load(other, tmp_path / "c", optimizer=torch.optim.AdamW(other.parameters()))
    assert not ran.exists()


def test_save_refuses_state_that_is_not_plain_data(tmp_path):
    """Anything torch.load(weights_only=True) would not load is refused up front, by its key
    path, and nothing is written; an LR scheduler's state_dict() and the RNG state are plain."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4])  # its state holds a Counter
    for bad, where in (({"sched": sched}, r"state\['sched'\] is a torch.optim.lr_scheduler.MultiStepLR"),
                       ({"data": [1, {"next": lambda: 0}]}, r"state\['data'\]\[1\]\['next'\] is a builtins.function")):
        with pytest.raises(fxshard.PlanError, match=f"(?s){where}.*fix: .*state_dict()"):
            fxshard.save(model, tmp_path / "bad", optimizer=opt, state=bad)
        assert not os.listdir(tmp_path)
    opt.param_groups[0]["schedule"] = lambda step: 1.0  # an optimizer hyperparameter DCP would pickle
    with pytest.raises(fxshard.PlanError, match=r"optimizer.param_groups\[0\]\['schedule'\] is a builtins.function"):
        fxshard.save(model, tmp_path / "bad", optimizer=opt)
    del opt.param_groups[0]["schedule"]
    state = {"step": 3, "sched": sched.state_dict(), "rng": torch.get_rng_state(), "pos": (7, [1.5, None, "a"])}
    fxshard.save(model, tmp_path / "good", optimizer=opt, state=state)
    back = fxshard.load(torch.nn.Linear(4, 3), tmp_path / "good")
    assert back["sched"] == sched.state_dict() and back["pos"] == state["pos"] and torch.equal(back["rng"], state["rng"])
