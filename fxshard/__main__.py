"""``python -m fxshard``: the demo (main job) and the command-line tools.

    python -m fxshard demo            # 2 gloo ranks on CPU: dump one layer, train, compare
    python -m fxshard demo --moe      # a tiny Mixtral, expert parallel: all-to-alls inside the MoE blocks
    python -m fxshard demo --bench    # ... then time a step: fxshard vs DTensor vs hand-written Megatron
    torchrun --nproc-per-node 2 -m fxshard demo     # NCCL on GPUs
    torchrun --nproc-per-node 4 -m fxshard train --model DIR --data book.txt --mesh dp=2,tp=2   # the trainer
    python -m fxshard export ckpt/step000100 out/model                                         # to transformers
    python -m fxshard plan --model DIR --world 64 --memory-gib 80 --seq 8192 --batch 512    # which mesh
    python -m fxshard dump 'fxshard.testing.models:llama(n_heads=8,n_kv_heads=4)' --plan fxshard.testing.models:llama_plan --mesh tp=4
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxshard", description="tensor/expert parallelism as torch.fx passes")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small Llama on 2 ranks and compare with one device")
    demo.add_argument("--world-size", type=int, default=2, help="ranks to spawn on CPU (ignored under torchrun)")
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--layer", default="layers.0", help="module whose dump is printed")
    demo.add_argument("--moe", action="store_true", help="a tiny Mixtral instead, expert parallel (batch sharded over 'ep')")
    demo.add_argument("--bench", action="store_true",
                      help="then time a training step: fxshard vs DTensor parallelize_module vs hand-written Megatron")
    demo.add_argument("--bench-modes", default="eager,aot_eager",
                      help="comma-separated: eager (no compile), aot_eager, inductor (torch.compile backends)")
    demo.add_argument("--bench-iters", type=int, default=20, help="timed steps per contender and mode")
    from fxshard.cli.commands import add_dump_arguments

    add_dump_arguments(sub.add_parser("dump", help="transform a model offline (MeshSpec) and dump the result: text, json, dot, svg, --diff"))
    from fxshard.cli.train import add_parsers

    add_parsers(sub)
    from fxshard.cli.plan import add_parser as add_plan_parser

    add_plan_parser(sub)
    args = parser.parse_args(argv)
    from fxshard.cli.extras import MissingExtra, missing_extra

    try:
        return _run(args)
    except (MissingExtra, ModuleNotFoundError) as e:
        # an optional package the command needs (transformers: the hf extra): one line naming the extra, exit 2
        missing = e if isinstance(e, MissingExtra) else missing_extra(e)
        if missing is None:
            raise
        print(f"fxshard {args.command}: {missing}", file=sys.stderr, flush=True)
        return MissingExtra.exit_status


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from fxshard.cli.demo import run_demo

        return run_demo(args)
    if args.command == "dump":
        from fxshard.cli.commands import run_dump

        return run_dump(args)
    if args.command in ("train", "export"):
        from fxshard.cli.train import run_export, run_train

        return run_train(args) if args.command == "train" else run_export(args)
    if args.command == "plan":
        from fxshard.cli.plan import run_plan

        return run_plan(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
