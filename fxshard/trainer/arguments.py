"""The flags of ``python -m fxshard train`` and ``python -m fxshard export``.

Every flag is used: ``tests/trainer/test_train_cli.py`` checks each against what it says.
"""
from __future__ import annotations

import argparse

from fxshard.recipe.parallel_dims import AXIS_HELP

EPILOG = ("mesh axes: " + "; ".join(f"{a}: {h}" for a, h in AXIS_HELP.items()) +
          ".  --model: a local HF checkpoint directory (save_pretrained's config.json, *.safetensors, tokenizer), "
          "an HF model type built small with random weights (llama, qwen3, mixtral, ...; --model-config overrides its "
          "fields), or torchtitan-llama3.")


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.epilog = EPILOG
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="qwen3", help="checkpoint directory, HF model type, or torchtitan-llama3 (default qwen3)")
    g.add_argument("--model-config", default="", metavar="KEY=VALUE,...",
                   help="config fields of a model built from its type, e.g. hidden_size=128,num_hidden_layers=4")
    g.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help=".txt, .jsonl/.json (a text field) or .parquet files: tokenized with the model's tokenizer "
                        "(byte-level if it has none), documents joined by EOS, packed into --seq tokens")
    g.add_argument("--text-field", default="text", help="the text field of .jsonl/.json/.parquet records (default text)")
    g.add_argument("--data-cache", default=None, metavar="DIR",
                   help="where the tokenized corpus is kept (default ~/.cache/fxshard/tokens)")
    g.add_argument("--eval-split", nargs="+", default=None, metavar="FILE", help="held-out files: an eval loss")
    g.add_argument("--eval-every", type=int, default=0, metavar="K", help="eval every K steps (and after the last)")
    g.add_argument("--eval-batches", type=int, default=4, metavar="N", help="global batches per eval (default 4)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--mesh", default="", metavar="AXIS=SIZE,...",
                   help="any product of dp, tp, pp, cp, ep, e.g. dp=2,pp=2,tp=2 (their product: the processes); "
                        "auto: the best mesh fxshard.plan_parallelism predicts for --memory-gib per rank")
    g.add_argument("--memory-gib", type=float, default=None,
                   help="with --mesh auto: memory per rank (default: the device's, from the planner's calibration)")
    g.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="pipeline micro-batches per step (default: the pp size; needs pp)")
    g.add_argument("--schedule", default=None,
                   help="torch's pipeline schedule: GPipe, 1F1B (default), Interleaved1F1B, ZBVZeroBubble, ... (needs pp)")
    g.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="stages per pipeline rank (default: 2 for interleaved and V schedules, else 1; needs pp)")

    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--batch", type=int, default=8, help="global batch: rows of --seq tokens per step")
    g.add_argument("--seq", type=int, default=64, help="tokens per row")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=2, help="linear warmup steps, then cosine to 0.1 x lr")
    g.add_argument("--clip", type=float, default=1.0, help="max gradient norm, over the whole model (0: no clipping)")
    g.add_argument("--accum", type=int, default=1, help="micro-batches per step, one gradient sync per step")
    g.add_argument("--accum-grads", choices=("unsharded", "sharded"), default=None,
                   help="with --accum under FSDP2 (dp or cp): where gradients accumulate between the passes: unsharded "
                        "(default: FSDP2 holds them whole in fp32, one reduce-scatter per step) or sharded (a "
                        "reduce-scatter every pass, torchtitan's: 1/dp of the memory); with --mesh auto the planner's")
    g.add_argument("--seed", type=int, default=0, help="weights of a model built from its type, and the data order")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 compute, fp32 master weights and reductions: FSDP2's MixedPrecisionPolicy under dp "
                        "(param_dtype=bf16, reduce_dtype=fp32), autocast without dp (or with --autocast)")
    g.add_argument("--autocast", action="store_true", help="with --bf16: torch.autocast also under dp")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", default=None, metavar="MODE",
                   type=checkpointing_mode,
                   help="recompute activations in the backward, per block: none; full (each block keeps its inputs); "
                        "selective (per op, torchtitan's: matmul, attention and collective outputs kept, the rest "
                        "recomputed); selective:K (every K-th block in full). The bare flag is full; unset: none, or with "
                        "--mesh auto the planner's choice")
    g.add_argument("--compile", default=None, metavar="BACKEND",
                   help="torch.compile backend (inductor, aot_eager): fxshard.compile, one graph per block on a mesh")

    g = p.add_argument_group("checkpoints, logs, export")
    g.add_argument("--ckpt-dir", default=None, help="checkpoints (resumed from the latest at start)")
    g.add_argument("--ckpt-every", type=int, default=0, metavar="K")
    g.add_argument("--keep-last", type=int, default=2)
    g.add_argument("--no-checkpoint-digests", action="store_true",
                   help="neither write a SHA-256 of every checkpoint file nor check them at resume (very large "
                        "checkpoints: the digests read every byte once more); sizes, chunks, keys and dtypes are "
                        "still checked")
    g.add_argument("--log-every", type=int, default=1, metavar="K", help="a metrics line every K steps")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl (and TensorBoard events when tensorboard is installed)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOPs for MFU (default: a table of known GPUs; none on CPU)")
    g.add_argument("--export-hf", default=None, metavar="DIR",
                   help="at the end: a consolidated HF checkpoint (config, safetensors, tokenizer)")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available (NCCL), else cpu (gloo)")
    return p


def checkpointing_mode(text: str) -> str:
    """``--activation-checkpointing``'s value, checked (``none``, ``full``, ``selective``,
    ``selective:K``): argparse reports a bad one as a usage error (exit status 2)."""
    from fxshard.errors import PlanError
    from fxshard.training.checkpointing import parse_checkpointing

    try:
        parse_checkpointing(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_export_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint the trainer saved (CKPT_DIR/stepNNNNNN)")
    p.add_argument("output", metavar="DIR", help="the HF checkpoint directory to write")
    p.add_argument("--model-dir", default=None,
                   help="config and tokenizer (default: the hf_model folder the trainer wrote beside the checkpoints)")
    return p
