"""The program-level contract (fxshard.meta.ProgramMeta): one typed object per program,
no string keys of ``gm.meta`` read anywhere else, and copies of a program keep it."""
from __future__ import annotations

import copy
import pathlib
import pickle
import re

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.meta import PROGRAM_KEY, ProgramMeta, pipeline_of, program_meta, programs_of
from fxshard.testing.models import llama, llama_plan, tokens

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a read or write of a program's state by string key: meta["fxshard_..."], meta.get("fxshard_..."), "fxshard_..." in x.meta
STRING_KEY = re.compile(r"""meta\s*(\[|\.get\(|\.setdefault\(|\.pop\()\s*['"]fxshard_|['"]fxshard_\w+['"]\s+(not\s+)?in\s+[\w.()]*meta""")


def test_no_string_keys_of_program_meta_outside_meta_py():
    found = []
    for folder in ("fxshard", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "fxshard" / "meta.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if STRING_KEY.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "program state read by string key (use fxshard.meta.program_meta):\n" + "\n".join(found)


def _transformed():
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    return fxshard.transform(llama(n_layers=2), plan, (tokens(4, 8, 128),))


def test_program_meta_survives_deepcopy_and_pickle():
    sharded = _transformed()
    program = program_meta(sharded)
    assert isinstance(program, ProgramMeta) and sharded.meta[PROGRAM_KEY] is program
    assert program.mesh == {"dp": 2, "tp": 2} and program.fsdp == ("dp",) and program.fsdp_units == ["layers.0", "layers.1"]
    assert program.state and program.captured_by in ("torch.fx", "torch.export") and program.pipeline is None
    for copied in (copy.deepcopy(sharded), pickle.loads(pickle.dumps(program))):
        again = program_meta(copied) if isinstance(copied, torch.nn.Module) else copied
        assert again is not program and again.mesh == program.mesh and again.fsdp_units == program.fsdp_units
        assert set(again.state) == set(program.state) and again.captured_by == program.captured_by
    block = copy.deepcopy(sharded).layers[1]
    assert program_meta(block).block == "layers.1" and program_meta(block).mesh == {"dp": 2, "tp": 2}


def test_a_new_transform_keeps_the_capture_not_the_state():
    captured = fxshard.trace(llama(n_layers=2), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (tokens(4, 8, 128),))
    assert program_meta(captured).model_class == "Llama" and program_meta(captured).state is None
    sharded = fxshard.transform(captured, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (tokens(4, 8, 128),))
    assert program_meta(sharded) is not program_meta(captured) and program_meta(sharded).model_class == "Llama"
    assert program_meta(captured).state is None and program_meta(sharded).state


def test_a_module_without_one_reads_empty_and_refuses_writes():
    plain = torch.nn.Linear(2, 2)
    assert program_meta(plain).state is None and program_meta(plain).blocks == {}
    assert pipeline_of(plain) is None and programs_of(plain) == [plain]
    with pytest.raises(AttributeError, match="create=True"):
        program_meta(plain).mesh = {"tp": 2}
    program_meta(plain, create=True).mesh = {"tp": 2}
    assert program_meta(plain).mesh == {"tp": 2}
