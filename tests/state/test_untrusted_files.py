"""Checkpoints from elsewhere (fxshard/state/files.py, checkpoint.py, hf_checkpoint.py):
every file one names is read only inside its directory, and everything is checked before
it is used.  Each test tampers with one kind of file, as an attacker or a careless copy
would, and checks that the load is refused with the file named (and the model left as it
was), or that it loads right.  Tiny models, one process; one 2-rank gloo test."""
from __future__ import annotations

import json
import os
import pickle
import signal
import shutil
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import fxshard
from fxshard.errors import PlanError
from fxshard.state.checkpoint import COMMIT_FILE
from fxshard.state.files import confined_file, regular_file

from harness import spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@contextmanager
def _no_hang(seconds: int = 20):
    """A FIFO opened for reading blocks until a writer comes: the refusal must come first."""
    def stop(*_):
        raise TimeoutError("the load hung: it opened a FIFO")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- the helper


def test_confined_file_refuses_what_leaves_the_directory(tmp_path):
    inside, outside = tmp_path / "ckpt", tmp_path / "other"
    inside.mkdir(), outside.mkdir()
    (inside / "a.bin").write_bytes(b"x")
    (outside / "b.bin").write_bytes(b"y")
    assert confined_file(inside, "a.bin", what="t") == str(inside / "a.bin")
    for bad in ("../other/b.bin", str(outside / "b.bin"), "sub/../../other/b.bin", "", "a\0b"):
        with pytest.raises(PlanError, match="outside|not a file name"):
            confined_file(inside, bad, what="t")
    os.symlink(outside / "b.bin", inside / "link.bin")
    with pytest.raises(PlanError, match="link.bin.*symlink.*outside"):
        confined_file(inside, "link.bin", what="t")
    os.symlink(inside / "a.bin", inside / "near.bin")  # a link inside the directory is its file
    assert confined_file(inside, "near.bin", what="t")
    (inside / "dir").mkdir()
    os.mkfifo(inside / "fifo")
    with _no_hang():
        with pytest.raises(PlanError, match="fifo.*FIFO"):
            confined_file(inside, "fifo", what="t")
    with pytest.raises(PlanError, match="dir.*a directory"):
        confined_file(inside, "dir", what="t")
    with pytest.raises(PlanError, match="missing.bin.*does not exist"):
        confined_file(inside, "missing.bin", what="t")
    with pytest.raises(PlanError, match="a device"):
        regular_file("/dev/null", what="t")


def test_hf_hub_cache_snapshot_links_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_bytes(b"w")
    os.symlink("../../blobs/f00d", snap / "model.safetensors")  # what snapshot_download writes
    assert confined_file(snap, "model.safetensors", what="t")
    (tmp_path / "elsewhere").write_bytes(b"w")
    os.symlink("../../../elsewhere", snap / "other.safetensors")
    with pytest.raises(PlanError, match="outside"):
        confined_file(snap, "other.safetensors", what="t")


# ----------------------------------------------------------------------------- DCP checkpoints


def _mlp(layers: int = 2, seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]).to(dtype)


def _save(path, layers: int = 2, seed: int = 0, state=None) -> nn.Module:
    model = _mlp(layers, seed)
    fxshard.save(model, path, state=state)
    return model


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _edit_metadata(path, edit) -> None:
    """Rewrite the checkpoint's ``.metadata`` (a pickle DCP writes) after ``edit(metadata)``."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own file
    edit(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _refused(path, match: str, **kw) -> None:
    """The load is a PlanError matching ``match`` and the model keeps its values."""
    target = _mlp(seed=7)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with _no_hang():
        with pytest.raises(PlanError, match=match):
            fxshard.load(target, path, **kw)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items()), "a refused load changed the model"


def test_a_checkpoint_loads_right(tmp_path):
    saved = _save(tmp_path / "c", state={"step": 3})
    target = _mlp(seed=1)
    assert fxshard.load(target, tmp_path / "c") == {"step": 3}
    assert _same(saved, target)
    commit = json.loads((tmp_path / "c" / COMMIT_FILE).read_text())
    assert {".metadata", "__0_0.distcp", "state.0.pt"} <= set(commit["files"])
    assert all(len(f["sha256"]) == 64 for f in commit["files"].values())


def test_a_checkpoint_of_an_older_fxshard_without_a_file_list_loads(tmp_path):
    saved = _save(tmp_path / "c")
    commit = tmp_path / "c" / COMMIT_FILE
    commit.write_text(json.dumps({"seq": 1, "world_size": 1}))
    target = _mlp(seed=1)
    fxshard.load(target, tmp_path / "c")
    assert _same(saved, target)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_storage_paths_outside_the_checkpoint_are_refused(tmp_path, where):
    _save(tmp_path / "c")
    _save(tmp_path / "other", seed=5)
    name = "../other/__0_0.distcp" if where == "relative" else str(tmp_path / "other" / "__0_0.distcp")

    def redirect(md):
        for info in md.storage_data.values():
            info.relative_path = name
    _edit_metadata(tmp_path / "c", redirect)
    _refused(tmp_path / "c", r"\.metadata names the file .*other/__0_0\.distcp.*outside")


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    _save(tmp_path / "c")
    _save(tmp_path / "other", seed=5)
    os.remove(tmp_path / "c" / "__0_0.distcp")
    os.symlink(tmp_path / "other" / "__0_0.distcp", tmp_path / "c" / "__0_0.distcp")
    _refused(tmp_path / "c", r"'__0_0\.distcp'.*symlink.*outside")


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "state.0.pt"])
def test_a_fifo_is_refused_without_opening_it(tmp_path, name):
    _save(tmp_path / "c", state={"step": 1})
    os.remove(tmp_path / "c" / name)
    os.mkfifo(tmp_path / "c" / name)
    _refused(tmp_path / "c", rf"{name}.*FIFO")


def _chunks(edit):
    def apply(md):
        m = md.state_dict_metadata["model.0.weight"]
        m.chunks = edit(m.chunks)
    return apply


@pytest.mark.parametrize("case,edit,match", [
    ("missing", lambda cs: [], r"'model.0.weight'.*hold 0 of its 16 elements"),
    ("half", lambda cs: [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4]))],
     r"'model.0.weight'.*hold 8 of its 16"),
    ("overlapping", lambda cs: [*cs, ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 4]))],
     r"'model.0.weight' has overlapping chunks"),
    ("outside", lambda cs: [ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([4, 4]))],
     r"'model.0.weight'.*outside it"),
])
def test_chunks_that_do_not_cover_a_tensor_once_are_refused(tmp_path, case, edit, match):
    _save(tmp_path / "c")
    _edit_metadata(tmp_path / "c", _chunks(edit))
    _refused(tmp_path / "c", r"\.metadata: .*" + match)


def test_a_piece_beyond_its_file_is_refused(tmp_path):
    _save(tmp_path / "c")

    def grow(md):
        next(iter(md.storage_data.values())).length += 10 ** 6
    _edit_metadata(tmp_path / "c", grow)
    _refused(tmp_path / "c", r"__0_0\.distcp', which has \d+ bytes")


def test_extra_and_missing_keys(tmp_path):
    """A 3-layer checkpoint does not load into a 2-layer model, nor a 2-layer one into 3
    layers, unless strict=False (then the common tensors load, the others are kept)."""
    three = _save(tmp_path / "three", layers=3)
    _refused(tmp_path / "three", r"has tensors the model does not: \['2.bias', '2.weight'\]")
    two = _mlp(2, seed=1)
    fxshard.load(two, tmp_path / "three", strict=False)
    assert _same(two, nn.Sequential(*list(three)[:2]))
    _save(tmp_path / "two", layers=2, seed=4)
    bigger = _mlp(3, seed=1)
    with pytest.raises(PlanError, match=r"two has no \['2.weight', '2.bias'\]"):
        fxshard.load(bigger, tmp_path / "two")
    kept = bigger[2].weight.clone()
    fxshard.load(bigger, tmp_path / "two", strict=False)
    assert torch.equal(bigger[2].weight, kept) and torch.equal(bigger[0].weight, _mlp(2, seed=4)[0].weight)


def test_another_dtype_is_refused(tmp_path):
    _save(tmp_path / "c")
    with pytest.raises(PlanError, match=r"0.weight is torch.float32 in .*, the model's is torch.bfloat16"):
        fxshard.load(_mlp(dtype=torch.bfloat16), tmp_path / "c")


def test_a_flipped_byte_is_refused_and_names_the_file(tmp_path):
    saved = _save(tmp_path / "c")
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    _refused(tmp_path / "c", r"__0_0\.distcp is not the file that was written \(its sha256 differs")
    # check_digests=False skips the digests, not the sizes: a truncated file is refused all the same
    data.write_bytes(bytes(raw[:-100]))
    _refused(tmp_path / "c", r"__0_0\.distcp has \d+ bytes, \d+ were written", check_digests=False)
    assert saved is not None


def test_a_damaged_piece_is_a_plan_error_naming_its_file(tmp_path):
    """A piece DCP cannot read (here: its length cut short, the digests not checked) is a
    PlanError naming the file, not DCP's CheckpointException."""
    _save(tmp_path / "c")

    def cut(md):
        for info in md.storage_data.values():
            info.length -= 50
    _edit_metadata(tmp_path / "c", cut)
    commit = tmp_path / "c" / COMMIT_FILE
    c = json.loads(commit.read_text())
    c["files"][".metadata"]["size"] = os.path.getsize(tmp_path / "c" / ".metadata")
    commit.write_text(json.dumps(c))
    _refused(tmp_path / "c", r"__0_0\.distcp does not read as the \.metadata says", check_digests=False)


def test_an_unlisted_file_and_a_damaged_commit_file_are_refused(tmp_path):
    _save(tmp_path / "c")
    shutil.copy(tmp_path / "c" / "__0_0.distcp", tmp_path / "c" / "extra.distcp")

    def to_extra(md):
        for info in md.storage_data.values():
            info.relative_path = "extra.distcp"
    _edit_metadata(tmp_path / "c", to_extra)
    _refused(tmp_path / "c", r"names 'extra\.distcp', a file the checkpoint's fxshard_commit\.json does not list")
    (tmp_path / "c" / COMMIT_FILE).write_text("{not json")
    _refused(tmp_path / "c", r"fxshard_commit\.json: it is not JSON")


def test_a_missing_rank_state_file_is_refused_in_one_process(tmp_path):
    """The commit file says 2 ranks saved; with state.1.pt gone no rank may resume with
    rank 0's state (here one process loads: its own state.0.pt is there)."""
    _save(tmp_path / "c", state={"step": 1})
    commit = tmp_path / "c" / COMMIT_FILE
    c = json.loads(commit.read_text())
    c["world_size"] = 2
    commit.write_text(json.dumps(c))
    _refused(tmp_path / "c", r"saved by 2 ranks.*state\.1\.pt is missing")


def _two_ranks(rank, world_size, root):
    import torch.distributed as dist

    model = _mlp(seed=0)
    fxshard.save(model, os.path.join(root, "c"), state={"rank": rank})
    if rank == 0:
        assert sorted(json.loads(open(os.path.join(root, "c", COMMIT_FILE)).read())["files"]) == \
            [".metadata", "__0_0.distcp", "__1_0.distcp", "state.0.pt", "state.1.pt"]
    target = _mlp(seed=1)
    assert fxshard.load(target, os.path.join(root, "c")) == {"rank": rank}
    assert _same(model, target)
    dist.barrier()
    if rank == 0:  # a byte of rank 1's file flipped: found by whichever rank digests it, refused on both
        data = os.path.join(root, "c", "__1_0.distcp")
        raw = bytearray(open(data, "rb").read())
        raw[len(raw) // 2] ^= 0x01
        open(data, "wb").write(bytes(raw))
    dist.barrier()
    with pytest.raises(PlanError, match=r"__1_0\.distcp is not the file|rank\(s\) \[\d\] found a damaged file"):
        fxshard.load(_mlp(seed=1), os.path.join(root, "c"))
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(root, "c", "state.1.pt"))
    dist.barrier()
    with pytest.raises(PlanError, match=r"saved by 2 ranks.*state\.1\.pt is missing"):
        fxshard.load(_mlp(seed=1), os.path.join(root, "c"), check_digests=False)


def test_two_ranks_a_tampered_or_missing_rank_file_is_refused_on_every_rank(tmp_path):
    spawn(_two_ranks, 2, str(tmp_path))


# ----------------------------------------------------------------------------- HF safetensors

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from fxshard import MeshSpec, Plan  # noqa: E402
from fxshard.state.hf_checkpoint import checkpoint_files  # noqa: E402
from fxshard.testing.hf_tiny import tiny_config  # noqa: E402

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Llama saved in several files with an index, and its transformed meta model
    materialized (rank 0 of an offline tp=2)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    torch.manual_seed(0)
    single = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    root = tmp_path_factory.mktemp("hf")
    single.save_pretrained(root / "sharded", max_shard_size="40KB")
    single.save_pretrained(root / "single")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    mesh = MeshSpec(("tp",), (2,), coordinate=(0,))
    sharded = fxshard.transform(meta, Plan.from_hf(mesh, meta), example_kwargs={"input_ids": IDS})
    fxshard.materialize(sharded, meta, init=None)
    return root, sharded, single.state_dict()


def _copy(hf, kind: str, dst):
    shutil.copytree(hf[0] / kind, dst)
    return dst


def _index(path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _write_index(path, index) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_hf_checkpoints_load_right(hf):
    root, sharded, full = hf
    for kind in ("sharded", "single"):
        with torch.no_grad():
            sharded.get_parameter("model.norm.weight").zero_()
        fxshard.load_hf_checkpoint(sharded, root / kind)
        assert torch.equal(sharded.get_parameter("model.norm.weight"), full["model.norm.weight"]), kind


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_index_naming_files_outside_is_refused(hf, tmp_path, where):
    path = _copy(hf, "sharded", tmp_path / "ckpt")
    elsewhere = _copy(hf, "single", tmp_path / "elsewhere") / "model.safetensors"
    index = _index(path)
    name = "../elsewhere/model.safetensors" if where == "relative" else str(elsewhere)
    index["weight_map"]["model.norm.weight"] = name
    _write_index(path, index)
    with pytest.raises(PlanError, match=r"index\.json names the file .*elsewhere/model\.safetensors.*outside"):
        fxshard.load_hf_checkpoint(hf[1], path)


def test_a_symlinked_safetensors_out_of_the_directory_is_refused(hf, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(hf[0] / "single" / "config.json", path)
    os.symlink(hf[0] / "single" / "model.safetensors", path / "model.safetensors")
    with pytest.raises(PlanError, match=r"'model\.safetensors'.*symlink.*outside"):
        fxshard.load_hf_checkpoint(hf[1], path)


def test_a_fifo_in_the_index_is_refused_without_opening_it(hf, tmp_path):
    path = _copy(hf, "sharded", tmp_path / "ckpt")
    index = _index(path)
    index["weight_map"]["model.norm.weight"] = "pipe.safetensors"
    _write_index(path, index)
    os.mkfifo(path / "pipe.safetensors")
    with _no_hang():
        with pytest.raises(PlanError, match=r"pipe\.safetensors.*FIFO"):
            fxshard.load_hf_checkpoint(hf[1], path)


def test_a_stale_index_beside_model_safetensors_is_refused(hf, tmp_path):
    path = _copy(hf, "single", tmp_path / "ckpt")
    shutil.copy(hf[0] / "sharded" / "model.safetensors.index.json", path)
    with pytest.raises(PlanError, match=r"(?s)both model\.safetensors and model\.safetensors\.index\.json.*remove the stale"):
        checkpoint_files(path)
    with pytest.raises(PlanError, match="both"):
        fxshard.load_hf_checkpoint(hf[1], path)
    # the trainer on one process (from_pretrained) refuses it too: one directory, one set of weights
    from fxshard.trainer.models import ModelSource

    with pytest.raises(PlanError, match="both"):
        ModelSource.resolve(str(path)).build(meta=False)


def test_a_truncated_safetensors_names_the_file(hf, tmp_path):
    path = _copy(hf, "single", tmp_path / "ckpt")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(PlanError, match=r"ckpt/model\.safetensors is not a readable safetensors file"):
        fxshard.load_hf_checkpoint(hf[1], path)
    f.write_bytes(b"\x01")  # not even a header's length
    with pytest.raises(PlanError, match=r"ckpt/model\.safetensors is not a readable"):
        checkpoint_files(path)


def _single_file_with(hf, tmp_path, tensor: str, value: torch.Tensor, config_dtype: str | None = None):
    path = _copy(hf, "single", tmp_path / "ckpt")
    sd = {k: v.clone().contiguous() for k, v in hf[2].items()}
    sd[tensor] = value
    save_file(sd, path / "model.safetensors")
    if config_dtype is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["dtype"] = config_dtype
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_relabelled_dtypes_are_refused(hf, tmp_path):
    """F32 bytes relabelled I32 in the header (the same length), and int8, bool and FP8
    stored for a float parameter: refused, naming the tensor, the stored dtype and the file."""
    path = _copy(hf, "single", tmp_path / "ckpt")
    f = path / "model.safetensors"
    raw = f.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    header["model.norm.weight"]["dtype"] = "I32"
    new = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(new) == header_len
    f.write_bytes(raw[:8] + new + raw[8 + header_len:])
    with pytest.raises(PlanError, match=r"model\.norm\.weight is stored as I32 in .*ckpt/model\.safetensors"):
        fxshard.load_hf_checkpoint(hf[1], path)
    norm = hf[2]["model.norm.weight"]
    for value, name in ((norm.to(torch.int8), "I8"), (norm.bool(), "BOOL"),
                        (norm.to(torch.float8_e4m3fn), "F8_E4M3")):
        shutil.rmtree(tmp_path / "ckpt")
        path = _single_file_with(hf, tmp_path, "model.norm.weight", value)
        with pytest.raises(PlanError, match=rf"model\.norm\.weight is stored as {name} in"):
            fxshard.load_hf_checkpoint(hf[1], path)


def test_float_dtypes_convert_by_the_stated_rule(hf, tmp_path):
    """BF16 stored for a float32 model is converted; F16 stored where config.json says the
    weights are bfloat16 is a relabelling, refused."""
    root, sharded, full = hf
    path = _single_file_with(hf, tmp_path, "model.norm.weight", (full["model.norm.weight"] + 0.5).bfloat16(),
                             config_dtype="bfloat16")
    fxshard.load_hf_checkpoint(sharded, path)
    assert torch.equal(sharded.get_parameter("model.norm.weight"), (full["model.norm.weight"] + 0.5).bfloat16().float())
    shutil.rmtree(path)
    path = _single_file_with(hf, tmp_path, "model.norm.weight", full["model.norm.weight"].half(),
                             config_dtype="bfloat16")
    with pytest.raises(PlanError, match=r"stored as F16 .* config\.json says the weights are torch\.bfloat16"):
        fxshard.load_hf_checkpoint(sharded, path)
