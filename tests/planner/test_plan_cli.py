"""``python -m fxshard plan`` as a new user meets it (issue 43, item 8): the device's memory
without a flag, ``train``'s flag names, and a ``best:`` line that is the train command."""
from __future__ import annotations

import argparse
import shlex

import pytest

pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)

pytest.importorskip("transformers")

from fxshard.__main__ import main  # noqa: E402
from fxshard.planner.calibration import Calibration, rank_memory_gib  # noqa: E402
from fxshard.trainer.arguments import add_train_arguments  # noqa: E402

SEQ = 16


def _best_line(out: str) -> str:
    lines = [l for l in out.splitlines() if l.startswith("best: ")]
    assert len(lines) == 1, out
    return lines[0][len("best: "):]


def _train_args(command: str) -> argparse.Namespace:
    words = shlex.split(command)
    assert words[:2] == ["torchrun", "--nproc-per-node"] or words[:3] == ["python", "-m", "fxshard"], words
    rest = words[words.index("train") + 1:]
    return add_train_arguments(argparse.ArgumentParser(exit_on_error=False)).parse_args(rest)


def test_without_a_memory_flag_on_a_cpu(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert main(["plan", "--model", "llama", "--world", "2", "--seq", str(SEQ), "--batch", "4", "--device", "cpu",
                 "--candidates", "dp=2"]) == 0
    out = capsys.readouterr().out
    gib, where = rank_memory_gib(Calibration.named("cpu"), 2)
    assert f"on 2 ranks of {gib:.4g} GiB (this machine's" in out and "over 2 ranks" in where
    assert "1 of 1 candidates fit" in out


def test_rank_memory_of_a_cpu_over_the_local_ranks(monkeypatch):
    cpu = Calibration.named("cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone, _ = rank_memory_gib(cpu, 1)
    assert 0.1 < alone < 1 << 20
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four, where = rank_memory_gib(cpu, 64)  # torchrun's local ranks, whatever the world
    assert four == pytest.approx(alone / 4) and where.endswith("over 4 ranks")
    assert rank_memory_gib(Calibration.named("h100"), 64) == (80.0, "the H100 SXM's")


def test_the_best_line_is_the_train_command(capsys):
    assert main(["plan", "--model", "llama", "--world", "4", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "16",
                 "--device", "cpu", "--candidates", "dp=2,tp=2,accum=2;pp=2,dp=2,m=2,ac", "--data", "a b.txt",
                 "c.jsonl"]) == 0
    command = _best_line(capsys.readouterr().out)
    args = _train_args(command)
    assert (args.model, args.seq, args.batch, args.data) == ("llama", SEQ, 16, ["a b.txt", "c.jsonl"])
    assert args.mesh in ("dp=2,tp=2", "pp=2,dp=2")
    if args.mesh == "dp=2,tp=2":
        assert args.accum == 2
    else:
        assert args.microbatches == 2 and args.schedule == "1F1B" and args.activation_checkpointing


def test_sharded_gradients_reach_the_train_command(capsys):
    """``grads=sharded`` (FSDP2 reduce-scattering every accumulation pass) is the trainer's
    ``--accum-grads sharded`` in the ``best:`` line; where it changes nothing it is not said."""
    assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "8",
                 "--device", "cpu", "--candidates", "dp=2,accum=2,grads=sharded"]) == 0
    args = _train_args(_best_line(capsys.readouterr().out))
    assert (args.mesh, args.accum, args.accum_grads) == ("dp=2", 2, "sharded")
    assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "8",
                 "--device", "cpu", "--candidates", "tp=2,accum=2,grads=sharded"]) == 0
    args = _train_args(_best_line(capsys.readouterr().out))
    assert (args.mesh, args.accum, args.accum_grads) == ("tp=2", 2, None)  # no FSDP2: nothing to shard
    assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "8",
                 "--device", "cpu", "--candidates", "dp=2,grads=halved"]) == 2
    assert "grads=sharded|unsharded" in capsys.readouterr().err


def test_the_old_flag_names_still_work_and_one_rank_is_python(capsys):
    assert main(["plan", "--model", "llama", "--world", "1", "--memory", "4", "--seq", str(SEQ), "--global-batch", "4",
                 "--device", "cpu"]) == 0
    command = _best_line(capsys.readouterr().out)
    assert command.startswith("python -m fxshard train --model llama --data TEXT_FILES ")
    args = _train_args(command)
    assert (args.batch, args.seq, args.mesh, args.data) == (4, SEQ, "", ["TEXT_FILES"])


def test_only_rank_0_prints(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "4",
                 "--device", "cpu", "--candidates", "dp=2"]) == 0
    assert main(["plan", "--model", "llama", "--world", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_mesh_auto_without_a_memory_flag_on_a_cpu(capsys, monkeypatch):
    """``train --mesh auto`` on a CPU with no ``--memory-gib``: this machine's memory over the
    local ranks; the planner's accumulation passes reach the trainer's ``--accum``."""
    from fxshard.cli.train import resolve_auto_mesh

    parser = add_train_arguments(argparse.ArgumentParser())
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        args = parser.parse_args(["--model", "llama", "--model-config", "num_hidden_layers=2", "--data", "x.txt",
                                  "--mesh", "auto", "--seq", str(SEQ), "--batch", "8", "--device", "cpu"])
        resolve_auto_mesh(args)
        assert args.mesh in ("dp=2", "tp=2", "pp=2") and args.accum >= 1 and args.memory_gib is None
        out = capsys.readouterr().out
        assert out.count("mesh auto: --mesh ") == (1 if rank == "0" else 0), out


def test_mesh_auto_takes_the_planners_sharded_gradients(monkeypatch):
    """When the planner's best accumulates FSDP2's gradients sharded, ``--mesh auto`` runs it so
    (``--accum-grads sharded``); a user's ``--accum-grads`` is planned with, not overridden."""
    import fxshard.planner
    from fxshard.cli.train import resolve_auto_mesh
    from fxshard.planner.api import PlanEntry
    from fxshard.planner.candidates import Candidate

    asked = {}

    def plan(*args, **kwargs):
        asked.update(kwargs)
        c = Candidate.make({"dp": 2}, accum=2, accum_grads=kwargs.get("accum_grads") or "sharded")
        return [PlanEntry(dict(c.mesh), 1, None, "none", memory={"total": 1.0}, step_time_s=1.0, candidate=c, accum=2)]

    monkeypatch.setattr(fxshard.planner, "plan_parallelism", plan)
    monkeypatch.setenv("WORLD_SIZE", "2")
    parser = add_train_arguments(argparse.ArgumentParser())
    base = ["--model", "llama", "--model-config", "num_hidden_layers=2", "--data", "x.txt", "--mesh", "auto", "--seq",
            str(SEQ), "--batch", "8", "--device", "cpu", "--memory-gib", "1"]
    args = parser.parse_args(base)
    resolve_auto_mesh(args)
    assert (args.mesh, args.accum, args.accum_grads) == ("dp=2", 2, "sharded") and asked["accum_grads"] is None
    args = parser.parse_args(base + ["--accum-grads", "unsharded"])
    resolve_auto_mesh(args)
    assert (args.accum, args.accum_grads) == (2, "unsharded") and asked["accum_grads"] == "unsharded"


def test_compile_times_the_fused_blocks_and_reaches_the_train_command(capsys, tmp_path):
    """``--compile inductor``: the blocks' elementwise ops are timed as inductor's fused kernels
    (a faster step, the same memory), said in the header and passed on in the ``best:`` line;
    another backend fuses nothing and changes no figure."""
    import json

    runs = {}
    for flags in ([], ["--compile", "inductor"], ["--compile", "aot_eager"]):
        out_json = tmp_path / f"plan{len(runs)}.json"
        assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "8",
                     "--device", "h100", "--candidates", "dp=2", "--json", str(out_json), *flags]) == 0
        out = capsys.readouterr().out
        (entry,) = json.loads(out_json.read_text())
        runs[" ".join(flags)] = (entry, out, _train_args(_best_line(out)))
    eager, inductor, aot = runs[""], runs["--compile inductor"], runs["--compile aot_eager"]
    assert inductor[0]["step_time_s"] < eager[0]["step_time_s"] and inductor[0]["memory"] == eager[0]["memory"]
    assert aot[0]["step_time_s"] == eager[0]["step_time_s"]
    assert "compiled with inductor: elementwise ops timed as inductor's fused kernels" in inductor[1]
    assert "compiled with aot_eager: nothing fused" in aot[1] and "compiled with" not in eager[1]
    assert (eager[2].compile, inductor[2].compile, aot[2].compile) == (None, "inductor", "aot_eager")


def test_mesh_auto_plans_compiled_under_compile_inductor(monkeypatch):
    import fxshard.planner
    from fxshard.cli.train import resolve_auto_mesh
    from fxshard.planner.api import PlanEntry
    from fxshard.planner.candidates import Candidate

    asked = {}

    def plan(*args, **kwargs):
        asked.update(kwargs)
        c = Candidate.make({"dp": 2})
        return [PlanEntry(dict(c.mesh), 1, None, "none", memory={"total": 1.0}, step_time_s=1.0, candidate=c)]

    monkeypatch.setattr(fxshard.planner, "plan_parallelism", plan)
    monkeypatch.setenv("WORLD_SIZE", "2")
    parser = add_train_arguments(argparse.ArgumentParser())
    base = ["--model", "llama", "--model-config", "num_hidden_layers=2", "--data", "x.txt", "--mesh", "auto", "--seq",
            str(SEQ), "--batch", "8", "--device", "cpu", "--memory-gib", "1"]
    for flags, compiled in (([], False), (["--compile", "inductor"], True), (["--compile", "aot_eager"], False)):
        resolve_auto_mesh(parser.parse_args(base + flags))
        assert asked["compiled"] is compiled, flags
