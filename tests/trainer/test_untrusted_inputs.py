"""What the trainer reads from a directory it was given and what it writes beside it.

* no code from a checkpoint directory: a ``config.json`` with an ``auto_map`` and an unknown
  ``model_type`` is refused naming the file, even at a terminal that answers "y" to
  transformers' "run the custom code?" (the directory's ``configuration_*.py`` would leave a
  marker file: it must not exist); with a known type the directory's code is ignored;
* nothing deleted or overwritten that the user did not name: ``--export-hf`` without
  ``--ckpt-dir`` leaves a directory ``DIR.fxshard-ckpt`` of the user's alone; an export onto
  the ``--model`` directory is refused before any work; an export into a directory with
  other files replaces only the export's own files;
* the run says what it does: a line per checkpoint written, the learning-rate schedule of a
  longer resume, one line on Ctrl-C naming the last committed checkpoint; a ``.jsonl`` with
  records of differing fields trains.

One process; the torchrun cases are in ``test_train_cli.py``.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from fxshard.__main__ import main  # noqa: E402
from fxshard.trainer.errors import TrainerError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = os.path.join(ROOT, "examples", "data", "genesis.txt")
TIMEOUT = 300


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from fxshard.testing.hf_checkpoints import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama", text_files=[TEXT])


def _env(tmp_path) -> dict:
    # transformers copies a directory's code into HF_HOME/modules before running it: keep that here
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HOME": str(tmp_path / "hf_home")}


def _argv(cache, *extra, steps=3) -> list[str]:
    return ["train", "--model", "llama", "--data", TEXT, "--steps", str(steps), "--batch", "4", "--seq", "32",
            "--data-cache", cache, *extra]


# ----------------------------------------------------------------------------- no code from a directory

def _with_code(path, marker, model_type: str, config: dict | None = None):
    """A checkpoint directory whose config's ``auto_map`` names its own code, which leaves ``marker`` when run."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(config or {}, model_type=model_type,
               auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    code = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the directory code ran')\n"
            f"from transformers import PretrainedConfig\n\n\nclass EvilConfig(PretrainedConfig):\n"
            f"    model_type = {model_type!r}\n")
    for name in ("configuration_evil.py", "modeling_evil.py"):
        with open(os.path.join(path, name), "w") as f:
            f.write(code)
    return path


def _at_a_terminal(argv: list[str], env: dict, answer: bytes = b"y\n") -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdin, stdout and stderr, ``answer`` typed ahead
    (and again while it runs): what a user at a terminal answering yes does."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + TIMEOUT
    try:
        os.write(master, answer)
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                if b"[y/N]" in chunk:
                    os.write(master, answer)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, out.decode(errors="replace")


def test_the_pty_harness_sees_code_run_when_transformers_is_asked(tmp_path):
    """The control: transformers' own default at a terminal answered "y" runs the directory's
    code (the marker appears), so its absence below means something."""
    marker = tmp_path / "ran"
    ckpt = _with_code(tmp_path / "evil", marker, "evil_llama")
    code = f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(ckpt)!r})"
    rc, out = _at_a_terminal([sys.executable, "-c", code], _env(tmp_path))
    assert marker.exists(), f"the control did not run the directory's code (rc {rc}):\n{out[-2000:]}"


def test_a_config_with_auto_map_and_an_unknown_type_is_refused_at_a_terminal(tmp_path):
    marker = tmp_path / "ran"
    ckpt = _with_code(tmp_path / "evil", marker, "evil_llama")
    rc, out = _at_a_terminal([sys.executable, "-m", "fxshard", "train", "--model", str(ckpt), "--data", TEXT,
                              "--steps", "1", "--data-cache", str(tmp_path / "tokens")], _env(tmp_path))
    assert not marker.exists(), "the checkpoint directory's code ran"
    assert rc == 2, out[-3000:]
    config = os.path.join(str(ckpt), "config.json")
    assert f"{config}: model_type 'evil_llama' is not one transformers ships" in out, out[-3000:]
    assert "auto_map names code" in out and "never runs" in out and "[y/N]" not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_every_loader_refuses_the_directory_without_running_it(tmp_path):
    from fxshard.errors import PlanError
    from fxshard.planner.model import PlannedModel
    from fxshard.trainer.export import load_exportable
    from fxshard.trainer.models import ModelSource, load_hf_config

    marker = tmp_path / "ran"
    ckpt = str(_with_code(tmp_path / "evil", marker, "evil_llama"))
    for load in (lambda: ModelSource.resolve(ckpt), lambda: load_hf_config(ckpt),
                 lambda: load_exportable(str(tmp_path / "ckpt" / "step000001"), model_dir=ckpt)):
        with pytest.raises(TrainerError, match=re.escape(os.path.join(ckpt, "config.json"))):
            load()
    with pytest.raises(PlanError, match="auto_map names code"):
        PlannedModel.resolve(ckpt)
    (tmp_path / "evil" / "config.json").write_text("[1, 2]")
    with pytest.raises(TrainerError, match="is a JSON list, not a config"):
        ModelSource.resolve(ckpt)
    assert not marker.exists()


def test_a_known_type_with_auto_map_builds_the_library_class_and_runs_no_code(tmp_path, llama_dir):
    import shutil

    from fxshard.trainer.data import load_tokenizer
    from fxshard.trainer.models import ModelSource

    marker = tmp_path / "ran"
    ckpt = tmp_path / "llama_with_code"
    shutil.copytree(llama_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    _with_code(ckpt, marker, "llama", config)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (ckpt / "tokenization_evil.py").write_text((ckpt / "configuration_evil.py").read_text())
    source = ModelSource.resolve(str(ckpt))
    model = source.build(meta=False)
    assert type(model).__module__.startswith("transformers.models.llama"), type(model)
    load_tokenizer(str(ckpt), vocab_size=source.vocab_size())
    assert not marker.exists()


# ----------------------------------------------------------------------------- nothing deleted that was not named

def test_export_without_ckpt_dir_leaves_a_users_directory_of_the_old_scratch_name(tmp_path, cache):
    """It was ``shutil.rmtree(DIR + ".fxshard-ckpt")``: a user's folder of that name went."""
    out = tmp_path / "out"
    users = tmp_path / "out.fxshard-ckpt"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    (out).mkdir()
    (out / "README.md").write_text("my model card")
    (out / "tokenizer.json").write_text("an older tokenizer: the export's own file, replaced")
    assert main(_argv(cache, "--export-hf", str(out), steps=2)) == 0
    assert (users / "notes.txt").read_text() == "mine"
    assert (out / "README.md").read_text() == "my model card"
    assert json.loads((out / "tokenizer.json").read_text())["model"], "the export's tokenizer did not replace the old"
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert not any(".fxshard-ckpt-" in n or n.startswith(".fxshard-export-") for n in os.listdir(tmp_path)), \
        os.listdir(tmp_path)  # the scratch checkpoint fxshard made is gone
    assert not any(n.startswith(".fxshard-export-") for n in os.listdir(out))


def test_export_onto_the_model_directory_is_refused_before_any_work(tmp_path, cache, llama_dir, capsys):
    before = {n: os.path.getmtime(os.path.join(llama_dir, n)) for n in os.listdir(llama_dir)}
    for target in (llama_dir, os.path.join(llama_dir, "exported"), os.path.join(llama_dir, ".", "")):
        argv = _argv(cache, "--export-hf", str(target), steps=1)
        argv[argv.index("llama")] = str(llama_dir)
        assert main(argv) == 2
        err = capsys.readouterr()
        assert "which the export reads" in err.err and "--model" in err.err and "step 1" not in err.out, err
    link = tmp_path / "link"
    link.symlink_to(llama_dir)
    argv = _argv(cache, "--export-hf", str(link), steps=1)
    argv[argv.index("llama")] = str(llama_dir)
    assert main(argv) == 2 and "which the export reads" in capsys.readouterr().err
    assert {n: os.path.getmtime(os.path.join(llama_dir, n)) for n in os.listdir(llama_dir)} == before


def test_export_command_replaces_only_its_own_files(tmp_path, cache, capsys):
    from fxshard.trainer.export import export_checkpoint

    ckpt = tmp_path / "ckpt"
    assert main(_argv(cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "2", steps=2)) == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_text("an earlier export's shard")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "data.safetensors").write_text("the user's, not an export's name")
    assert main(["export", str(ckpt / "step000002"), str(out)]) == 0
    names = set(os.listdir(out))
    assert "model.safetensors" in names and {"notes.txt", "data.safetensors"} <= names
    # one set of weights: the earlier sharded export's files do not stay beside the new single file
    assert not {"model-00001-of-00002.safetensors", "model.safetensors.index.json"} & names, names
    # into the checkpoint it reads, or its config directory: refused
    for bad in (ckpt / "step000002", ckpt / "hf_model", ckpt / "step000002" / "x"):
        assert main(["export", str(ckpt / "step000002"), str(bad)]) == 2
        assert "which the export reads" in capsys.readouterr().err
    # a file of an export's name that is a directory of the user's: refused, nothing moved
    other = tmp_path / "other"
    (other / "config.json").mkdir(parents=True)
    with pytest.raises(TrainerError, match="config.json is a directory the export did not write"):
        export_checkpoint(str(ckpt / "step000002"), str(other))
    assert os.listdir(other) == ["config.json"]


def test_scratch_directory_is_deleted_only_with_its_marker(tmp_path):
    from fxshard.trainer.export import SCRATCH_MARKER, make_scratch_dir, remove_scratch_dir

    scratch = make_scratch_dir(str(tmp_path / "out"))
    assert os.path.basename(scratch).startswith("out.fxshard-ckpt-") and os.path.isfile(os.path.join(scratch, SCRATCH_MARKER))
    assert make_scratch_dir(str(tmp_path / "out")) != scratch, "a second run gets its own"
    users = tmp_path / "users"
    users.mkdir()
    (users / "a.txt").write_text("mine")
    assert not remove_scratch_dir(str(users)) and (users / "a.txt").exists()
    link = tmp_path / "link"
    link.symlink_to(scratch)
    assert not remove_scratch_dir(str(link)) and os.path.isdir(scratch)
    assert remove_scratch_dir(scratch) and not os.path.exists(scratch)


# ----------------------------------------------------------------------------- what a run says

def test_a_line_per_checkpoint_and_the_schedule_of_a_longer_resume(tmp_path, cache, capsys):
    """A resumed run follows its own --steps: the cosine of a 6-step run from step 4 on, said
    in one line at start, and its lrs those of an uninterrupted 6-step run."""
    import math

    from fxshard.trainer.loop import lr_lambda

    ckpt = tmp_path / "ckpt"
    logs = tmp_path / "logs"
    assert main(_argv(cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--lr", "0.01", "--warmup", "1",
                      "--log-dir", str(logs), steps=4)) == 0
    out = capsys.readouterr().out
    saved = re.findall(r"^checkpoint (\S+) at step (\d+) \((\d+\.\d) s\)$", out, re.M)
    assert [(p, int(s)) for p, s, _ in saved] == [(str(ckpt / "step000002"), 2), (str(ckpt / "step000004"), 4)], out
    assert main(_argv(cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--lr", "0.01", "--warmup", "1",
                      "--log-dir", str(logs), steps=6)) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("lr schedule:")]
    new, old = 0.01 * lr_lambda(1, 6)(4), 0.01 * lr_lambda(1, 4)(4)
    assert line == [f"lr schedule: the checkpoint's run had --lr 0.01 --warmup 1 --steps 4, this run follows --lr 0.01 "
                    f"--warmup 1 --steps 6 from step 5 on (its lr {new:.3g}, where the checkpoint's schedule had "
                    f"{old:.3g})"], out
    recs = {r["step"]: r for r in map(json.loads, open(logs / "metrics.jsonl")) if "lr" in r}
    for step in (5, 6):
        assert math.isclose(recs[step]["lr"], 0.01 * lr_lambda(1, 6)(step - 1), rel_tol=1e-12), (step, recs[step])
    # the same flags again: resumed, nothing to say about the schedule
    assert main(_argv(cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--lr", "0.01", "--warmup", "1",
                      steps=6)) == 0
    assert "lr schedule:" not in capsys.readouterr().out


def test_mixed_jsonl_records_train(tmp_path, cache):
    docs = [d for d in open(TEXT).read().split("\n\n") if d.strip()][:300]
    extra = [{"source": "web"}, {"id": 3, "meta": {"a": 1}}, {}, {"score": 0.5, "source": ["x"]}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"body": d, **extra[i % 4]}) + "\n" for i, d in enumerate(docs)))
    (tmp_path / "other.jsonl").write_text(json.dumps({"lang": "en", "body": docs[0]}) + "\n")
    argv = _argv(cache, "--log-dir", str(tmp_path / "logs"), "--text-field", "body", steps=2)
    argv[argv.index(TEXT)] = str(path)
    argv.insert(argv.index(str(path)) + 1, str(tmp_path / "other.jsonl"))
    assert main(argv) == 0
    assert len(open(tmp_path / "logs" / "metrics.jsonl").readlines()) == 2


def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint(tmp_path, cache):
    """SIGINT while training: one line on stderr (not a traceback), exit status 130."""
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "fxshard", *_argv(cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "1", steps=100000)]
    # as a terminal starts it: SIGINT at its default (a shell's background job, such as a CI script run
    # with `&`, starts its children with SIGINT ignored, and Python then keeps ignoring it)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("checkpoint "):
                break
        assert lines and lines[-1].startswith("checkpoint "), "".join(lines)[-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    # the last line, and no traceback (before: 91 lines of one); what precedes is start-up noise of the
    # environment (an optional library's warnings), not the interrupt's
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    said = [ln for ln in err.splitlines() if ln.strip()][-1]
    from fxshard.state.checkpoint import latest_checkpoint

    latest = latest_checkpoint(str(ckpt))
    assert latest and re.fullmatch(rf"fxshard train: interrupted after step \d+; last committed checkpoint: "
                                   rf"{re.escape(latest)} \(the same command resumes from it\)", said), said


def test_the_interrupted_line_without_a_checkpoint(tmp_path):
    from fxshard.trainer.loop import interrupted_message

    assert interrupted_message(None, 3) == "fxshard train: interrupted after step 3; no checkpoint was written (no --ckpt-dir)"
    assert interrupted_message(str(tmp_path / "none"), None) == (
        f"fxshard train: interrupted before the first step; no checkpoint committed in {tmp_path / 'none'} yet")
