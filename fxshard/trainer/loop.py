"""``python -m fxshard train``: the loop, in the order a run goes.

1. processes and mesh (``ParallelDims``), the device;
2. the tokenizer and the data (``fxshard.trainer.data``), each dp rank reading its rows;
3. the model and each rank's program (``fxshard.trainer.parallelize``);
4. AdamW, warmup + cosine; a resume from the latest checkpoint (data position included);
5. per step: ``--accum`` micro-batches (all but the last under ``no_sync``; FSDP2's
   gradients held unsharded between them, or with ``--accum-grads sharded`` reduce-scattered each), the
   loss summed over tokens and divided by the global count of scored tokens (exact with
   any padding, on every mesh), clipping over the whole model, the step, a record;
6. eval, checkpoints, the HF export, ``final checksum``.

The loss: labels come pre-shifted from the data (``labels[t]`` is the token after
``input_ids[t]``), so a rank holding a piece of the sequence (cp) scores its own
positions, and one holding rows (dp) its own rows; their sums add up to one device's.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from fxshard.pipelining.train_step import eval_step, train_step
from fxshard.runtime.collectives import all_gather
from fxshard.runtime.context_parallel_ops import gather_sequence, split_sequence
from fxshard.state.checkpoint import latest_checkpoint, load, save
from fxshard.state.full_state import full_state_dict
from fxshard.training.accumulate import no_sync
from fxshard.training.grad_norm import clip_grad_norm_, grad_norm
from fxshard.training.token_loss import token_loss_sum
from fxshard.trainer import data as text_data
from fxshard.trainer.errors import TrainerError
from fxshard.trainer.export import (check_output_dir, export_checkpoint, make_scratch_dir, max_logit_difference,
                                    remove_scratch_dir, save_model_dir)
from fxshard.trainer.metrics import MetricsLogger, Throughput, device_peak_tflops, flops_per_token, peak_memory_gib
from fxshard.trainer.models import ModelSource, parse_overrides
from fxshard.recipe.parallel_dims import MeshError, ParallelDims
from fxshard.trainer.parallelize import ParallelOptions, Program, enable_hf_checkpointing, parallelize

VOCAB_MULTIPLE = 64  # a model built from its type gets the tokenizer's vocabulary padded to this


def lr_lambda(warmup: int, steps: int):
    def at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return at


def init_process_group(backend: str) -> None:
    """torchrun's process group, keyed by the restart count: after ``--max-restarts``
    restarts the workers, they meet in the store the killed ones used, whose gloo addresses
    are still there; a prefix per attempt keeps each attempt's keys apart."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    global _FAILURE_STORE
    _FAILURE_STORE = dist.PrefixStore(f"attempt{attempt}.failures", store)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank, world_size=world)


_FAILURE_STORE = None  # this attempt's store, once the processes have met: who failed first
_FIRST_FAILURE: bool | None = None


def claim_failure() -> bool:
    """Whether this process is the one that reports the run's error: the first of its ranks to
    fail (a counter in the run's store), so an error torchrun's ranks all hit (a data file
    missing) or one rank hits (and the others then lose their peers) is printed once. Before
    the processes have met, every rank checks the same flags and files: rank 0 reports. Asked
    again, the same answer.

    Example::

        except TrainerError as e:
            if claim_failure():
                print(e, file=sys.stderr)
            return 2
    """
    global _FIRST_FAILURE
    if _FIRST_FAILURE is None:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            _FIRST_FAILURE = True
        elif _FAILURE_STORE is None:
            _FIRST_FAILURE = int(os.environ.get("RANK", "0")) == 0
        else:
            try:
                import datetime

                _FAILURE_STORE.set_timeout(datetime.timedelta(seconds=10))
                _FIRST_FAILURE = _FAILURE_STORE.add("count", 1) == 1
            except Exception:  # noqa: BLE001 - the store went with its host: a peer failed first and said so
                _FIRST_FAILURE = False
    return _FIRST_FAILURE


def let_rank_0_report(seconds: float = 10.0) -> None:
    """On a rank that leaves an error found before the processes met to rank 0 (every rank
    checks the same flags and files), wait a little before exiting: torchrun stops every
    worker as soon as one exits, and a silent rank exiting first would stop rank 0 before it
    says what is wrong.  Rank 0's own exit ends the wait (torchrun stops this worker then)."""
    if _FAILURE_STORE is None and int(os.environ.get("RANK", "0")) != 0:
        time.sleep(seconds)


def interrupted_message(ckpt_dir: str | None, step: int | None = None) -> str:
    """The one line a run stopped by Ctrl-C ends with: where it stopped and the last committed
    checkpoint (what a run started again with the same ``--ckpt-dir`` resumes from).

    Example::

        interrupted_message("ckpt", 7)
        # 'fxshard train: interrupted after step 7; last committed checkpoint: ckpt/step000006 (...)'
    """
    where = f"interrupted after step {step}" if step else "interrupted before the first step"
    if not ckpt_dir:
        return f"fxshard train: {where}; no checkpoint was written (no --ckpt-dir)"
    try:
        latest = latest_checkpoint(ckpt_dir) if os.path.isdir(ckpt_dir) else None
    except Exception as e:  # noqa: BLE001 - the line must come out whatever the folder holds
        return f"fxshard train: {where}; the checkpoints in {ckpt_dir} do not read ({type(e).__name__}: {e})"
    if latest is None:
        return f"fxshard train: {where}; no checkpoint committed in {ckpt_dir} yet"
    return f"fxshard train: {where}; last committed checkpoint: {latest} (the same command resumes from it)"


class Run:
    """One training run: the state the loop and its helpers share."""

    def __init__(self, args):
        self.args = args
        self.check_flags()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if args.mesh == "auto":
            raise TrainerError("--mesh auto is resolved by the command line (fxshard.cli.train), before the run\n  fix: "
                               "python -m fxshard train --mesh auto, or name the mesh")
        if args.memory_gib is not None:
            raise TrainerError("--memory-gib without --mesh auto: it is the planner's budget\n  fix: --mesh auto, or drop it")
        self.dims = ParallelDims.parse(args.mesh, world)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"fxshard train: {args.model} on {self.dims.describe()} ({world} process{'es' * (world > 1)})", flush=True)
        self.check_pipeline_flags()
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        if args.device == "cuda" and not torch.cuda.is_available():
            raise TrainerError("--device cuda: no CUDA device is visible\n  fix: --device cpu (gloo)")
        if use_cuda and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if world > 1:
            init_process_group("nccl" if use_cuda else "gloo")
        self.rank = dist.get_rank() if world > 1 else 0
        self.mesh = self.dims.build_mesh(self.device.type)
        self.log = MetricsLogger(None, self.rank)  # until the resume step is known
        self.interrupted = False  # Ctrl-C seen while training (_interruptible)

    # ------------------------------------------------------------------ checks before any work

    def check_flags(self) -> None:
        a = self.args
        for flag, value, least in (("--steps", a.steps, 1), ("--batch", a.batch, 1), ("--seq", a.seq, 2),
                                   ("--accum", a.accum, 1), ("--log-every", a.log_every, 1), ("--keep-last", a.keep_last, 1),
                                   ("--eval-batches", a.eval_batches, 1)):
            if value < least:
                raise TrainerError(f"{flag} {value}: at least {least}")
        if a.ckpt_every and not a.ckpt_dir:
            raise TrainerError("--ckpt-every without --ckpt-dir: where would the checkpoints go?\n  fix: add --ckpt-dir DIR")
        if a.eval_every and not a.eval_split:
            raise TrainerError("--eval-every without --eval-split: which text is held out?\n  fix: add --eval-split FILE")
        if a.autocast and not a.bf16:
            raise TrainerError("--autocast without --bf16: autocast to what?\n  fix: --bf16 --autocast")
        if a.export_hf:  # before any work: an export onto its own source would overwrite it at the end
            check_output_dir(a.export_hf, {"--model": a.model if os.path.isdir(a.model) else None})

    def check_pipeline_flags(self) -> None:
        a, dims = self.args, self.dims
        if dims.pp == 1:
            for flag, value in (("--microbatches", a.microbatches), ("--schedule", a.schedule),
                                ("--virtual-stages", a.virtual_stages)):
                if value is not None:
                    raise TrainerError(f"{flag} {value} without a pp axis: it sets the pipeline's schedule\n  fix: "
                                       f"--mesh pp=N,... or drop {flag}")
        if a.accum_grads is not None and (a.accum == 1 or dims.fsdp_shard_ranks == 1 or dims.pp > 1):
            why = ("--accum 1 has no passes to accumulate over" if a.accum == 1 else
                   f"{dims.mesh_spec or 'one process'} has no FSDP2 (dp or cp)" if dims.fsdp_shard_ranks == 1 else
                   "under pp torch's schedule reduce-scatters FSDP2's gradients after every pass")
            raise TrainerError(f"--accum-grads {a.accum_grads}: {why}, so it would change nothing\n  fix: drop it, or "
                               f"--accum N with a dp or cp axis and no pp")
        # what must divide: the recipe's one check (the planner's too), its rule said in the flags' words
        m = a.microbatches or dims.pp
        try:
            dims.check(batch=a.batch, accum=a.accum, microbatches=m if dims.pp > 1 else 1, seq=a.seq)
        except MeshError as e:
            given = f"--batch {a.batch}, --accum {a.accum}" + (f", --microbatches {m}" if dims.pp > 1 else "")
            flags = given if "batch" in e.reason or "rows" in e.reason else f"--seq {a.seq}"
            fix = str(e).split("\n  fix: ", 1)[-1] if "\n  fix: " in str(e) else "see python -m fxshard train --help"
            fix = fix.replace("a batch that is", "--batch").replace("a sequence that is", "--seq")
            where = f"--mesh {dims.mesh_spec}" if dims.mesh_spec else "one process"
            raise TrainerError(f"{flags} on {where}: {e.reason}\n  fix: {fix}") from None

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        a, dims = self.args, self.dims
        t0 = time.perf_counter()
        source = ModelSource.resolve(a.model, parse_overrides(a.model_config), seed=a.seed)
        source.positions = a.seq
        if a.export_hf and source.kind == "torchtitan":
            raise TrainerError(f"--export-hf with --model {a.model}: an HF checkpoint needs an HF model\n  fix: drop "
                               f"--export-hf (--ckpt-dir keeps DCP checkpoints, which torchtitan reads)")
        self.source = source
        # a model built from its type takes the byte-level tokenizer's 257 ids, padded
        self.vocab = source.vocab_size(-(-257 // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
        self.tokenizer = text_data.load_tokenizer(source.tokenizer_dir, vocab_size=self.vocab)
        cache = a.data_cache or os.path.join(os.path.expanduser("~"), ".cache", "fxshard", "tokens")
        train_tokens = text_data.PackedTokens.from_files(a.data, self.tokenizer, a.seq, cache_dir=cache, text_field=a.text_field)
        dp_rank = dims.dp_rank(self.mesh)
        self.batches = text_data.TextBatches(train_tokens, a.batch, seed=a.seed, dp_rank=dp_rank, dp_size=dims.batch_ranks)
        self.eval_tokens = (text_data.PackedTokens.from_files(a.eval_split, self.tokenizer, a.seq, cache_dir=cache,
                                                         text_field=a.text_field) if a.eval_split else None)
        self.log.print(f"data: {train_tokens.num_tokens:,} tokens, {len(train_tokens):,} rows of {a.seq}"
                       + (f"; eval {self.eval_tokens.num_tokens:,} tokens" if self.eval_tokens else "")
                       + f" ({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
        model = source.build(meta=self.mesh is not None, vocab_size=self.vocab, device=self.device)
        self.flops_per_token = flops_per_token(model, a.seq)
        self.config = getattr(model, "config", None)
        self.log.print(f"model: {type(model).__name__} from {source.name}, "
                       f"{sum(p.numel() for p in model.parameters()):,} parameters; mesh {dims.describe()} "
                       f"({time.perf_counter() - t0:.1f} s)")
        rows = a.batch // (a.accum * (a.microbatches or dims.pp))
        example = torch.randint(0, self.vocab, (rows, a.seq), generator=torch.Generator().manual_seed(a.seed + 1))
        if self.mesh is None:
            self.program = self.single_process(model)
        else:
            opts = ParallelOptions(microbatches=a.microbatches or dims.pp, schedule=a.schedule or "1F1B",
                                   virtual_stages=a.virtual_stages, bf16=a.bf16 and not a.autocast and dims.dp > 1,
                                   compile=a.compile, activation_checkpointing=a.activation_checkpointing,
                                   device=str(self.device))
            self.program = parallelize(model, source, dims, self.mesh, opts, example.to(self.device), self.log.print)
        self.module = self.program.module
        if self.mesh is not None:
            self.log.print(self.holdings(model))
        if a.accum > 1 and dims.fsdp_shard_ranks > 1 and dims.pp == 1:
            self.log.print(f"accumulation: {a.accum} passes a step; FSDP2's gradients " + (
                "reduce-scattered every pass, accumulated sharded (--accum-grads sharded)" if a.accum_grads == "sharded"
                else "held unsharded between the passes, reduce-scattered after the last"))
        # bf16 without FSDP2 to cast the parameters (no dp, or --autocast): autocast
        autocast = a.bf16 and (a.autocast or dims.dp == 1)
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        self.sched = self.schedule(0)
        self.start = self.resume()
        self.done = self.start
        self.log = MetricsLogger(a.log_dir, self.rank, resume_step=self.start)
        if a.ckpt_dir and self.rank == 0 and self.config is not None:
            save_model_dir(a.ckpt_dir, self.config, self.tokenizer, vars(a))
        peak = a.peak_tflops or device_peak_tflops(self.device, a.bf16)
        self.peak_tflops = peak

    def holdings(self, model) -> str:
        """What each rank holds: its blocks (``model.layers.3`` -> 3) and parameters (local
        elements, FSDP2's shard included), gathered to every rank for one log line."""
        import re

        blocks, params = set(), 0
        for name, p in self.module.named_parameters():
            m = re.search(r"\.(\d+)\.", f".{name}")
            if m:
                blocks.add(int(m.group(1)))
            params += (p.to_local() if hasattr(p, "to_local") else p).numel()
        mine = {"rank": self.rank, "blocks": sorted(blocks), "params": params}
        every: list = [None] * self.dims.world_size
        dist.all_gather_object(every, mine)
        total = sum(p.numel() for p in model.parameters())
        return "holds: " + "; ".join(f"rank {h['rank']} blocks {_spans(h['blocks'])} params {h['params']:,}"
                                     for h in every) + f" (of {total:,})"

    def single_process(self, model) -> Program:
        a = self.args
        enable_hf_checkpointing(model, a.activation_checkpointing, type(model).__name__)
        if a.compile:
            t0 = time.perf_counter()
            model = torch.compile(model, backend=a.compile)
            self.log.print(f"startup: torch.compile set up ({a.compile}; compiled at the first step) "
                           f"{time.perf_counter() - t0:.1f} s")
        return Program(model, pipelined=False)

    def schedule(self, step: int) -> torch.optim.lr_scheduler.LambdaLR:
        """This run's schedule (``--lr``, ``--warmup``, ``--steps``), at ``step``: a resumed run
        follows its own flags from the checkpoint's step on (the lr of the first step after it is
        already this schedule's), and says so when the checkpoint's run had another."""
        a = self.args
        for group in self.opt.param_groups:
            group["initial_lr"] = a.lr  # the peak: this run's, also over a resumed optimizer's
        return torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(a.warmup, a.steps), last_epoch=step - 1)

    def schedule_flags(self) -> dict:
        return {"lr": float(self.args.lr), "warmup": int(self.args.warmup), "steps": int(self.args.steps)}

    def resume(self) -> int:
        a = self.args
        latest = latest_checkpoint(a.ckpt_dir) if a.ckpt_dir else None
        if latest is None:
            return 0
        state = load(self.module, latest, optimizer=self.opt, show_progress=False,
                     check_digests=not a.no_checkpoint_digests)
        step = int(state["step"])
        self.sched = self.schedule(step)
        torch.set_rng_state(state["rng"])
        self.batches.load_state_dict(state["data"])
        self.log.print(f"resumed from {latest} at step {step}")
        saved, now = state.get("schedule"), self.schedule_flags()
        if isinstance(saved, dict) and saved != now and step < a.steps:
            def flags(s):
                return f"--lr {s['lr']:g} --warmup {s['warmup']} --steps {s['steps']}"
            was = saved["lr"] * lr_lambda(saved["warmup"], saved["steps"])(step)
            self.log.print(f"lr schedule: the checkpoint's run had {flags(saved)}, this run follows {flags(now)} from "
                           f"step {step + 1} on (its lr {self.sched.get_last_lr()[0]:.3g}, where the checkpoint's "
                           f"schedule had {was:.3g})")
        return step

    # ------------------------------------------------------------------ a step

    def reduce(self, x: torch.Tensor, axes, op=dist.ReduceOp.SUM) -> torch.Tensor:
        for axis in axes:
            if self.mesh is not None and getattr(self.dims, axis) > 1:
                dist.all_reduce(x, op=op, group=self.mesh[axis].get_group())
        return x

    def local_piece(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a dp rank's rows along the sequence (cp), as the program takes it."""
        if self.dims.cp == 1:
            return x
        if self.program.pipelined:  # contiguous pieces; the mesh's cp coordinate
            return x.chunk(self.dims.cp, 1)[self.mesh["cp"].get_local_rank()]
        return split_sequence(x, "cp", sharded=self.module)

    def micro_loss(self, ids: torch.Tensor, labels: torch.Tensor, count: torch.Tensor, backward: bool = True):
        """One micro-batch: this rank's share of the loss (its summed token losses over the
        global ``count``), and the backward."""
        name = self.source.input_name
        if self.program.pipelined:
            pm = self.module
            # train_step averages a loss_fn's means over micro-batches and the batch's ranks: undone,
            # so every token weighs 1 / count as on one device
            share = pm.spec.microbatches * pm.batch_ranks
            vocab = self.program.vocab_parallel or ()  # the last stage's logits are vocab shards: loss parallel
            target = labels if self.program.gathers_sequence else self.local_piece(labels)

            def loss_fn(output, tgt):
                return token_loss_sum(output, tgt, *vocab) * (share / count)
            step = train_step if backward else eval_step
            return step(pm, {name: self.local_piece(ids)}, loss_fn=loss_fn, target=target)
        with self.autocast():
            out = self.module(**{name: self.local_piece(ids)})
        loss = token_loss_sum(out, self.local_piece(labels), *self.program.vocab_parallel or ()) / count
        if backward:
            # FSDP2 averages gradients over dp where the sum over ranks is wanted
            (loss * self.dims.batch_ranks).backward()
        return loss.detach()

    def global_count(self, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != -100).sum().to(torch.float32).to(self.device)
        return self.reduce(count, self.dims.batch_axes).clamp(min=1)

    def train_step(self) -> dict:
        a = self.args
        ids, labels = (t.to(self.device) for t in self.batches.next_batch())
        count = self.global_count(labels)
        total = torch.zeros((), device=self.device)
        micro = list(zip(ids.chunk(a.accum), labels.chunk(a.accum)))
        for k, (i, l) in enumerate(micro):
            held = k < len(micro) - 1 and self.mesh is not None
            with no_sync(self.module, sharded_grads=a.accum_grads == "sharded") if held else contextlib.nullcontext():
                total += self.micro_loss(i, l, count).float()
        if not self.program.pipelined:
            total = self.reduce(total, [*self.dims.batch_axes, "cp"])  # each rank held its rows' and positions' share
        if self.mesh is None:
            norm = (torch.nn.utils.clip_grad_norm_(self.module.parameters(), a.clip) if a.clip else
                    torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters() if p.grad is not None]))
        else:
            norm = clip_grad_norm_(self.module, a.clip) if a.clip else grad_norm(self.module)
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": float(total), "grad_norm": float(norm), "lr": lr}

    def eval_loss(self) -> float:
        a = self.args
        dp_rank = self.dims.dp_rank(self.mesh)
        total, count = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        was_training = self.module.training
        self.module.eval()
        with torch.no_grad():
            for ids, labels in text_data.eval_batches(self.eval_tokens, a.batch, dp_rank, self.dims.batch_ranks, a.eval_batches):
                ids, labels = ids.to(self.device), labels.to(self.device)
                n = self.global_count(labels)
                loss = self.micro_loss(ids, labels, n, backward=False).float()
                if not self.program.pipelined:
                    loss = self.reduce(loss, [*self.dims.batch_axes, "cp"])
                total += loss * n
                count += n
        self.module.train(was_training)
        return float(total / count)

    # ------------------------------------------------------------------ the run

    def train(self) -> None:
        with _interruptible(self):
            self.train_steps()

    def train_steps(self) -> None:
        a = self.args
        throughput = Throughput(self.device)
        tokens_per_step = a.batch * a.seq
        world = self.dims.world_size
        for step in range(self.start, a.steps):
            if self.interrupted:  # a Ctrl-C whose KeyboardInterrupt a callback swallowed (Python ignores it there)
                raise KeyboardInterrupt
            throughput.start()
            rec = self.train_step()
            throughput.stop(tokens_per_step)
            done = self.done = step + 1
            last = done == a.steps
            if done % a.log_every == 0 or last:
                rate = throughput.take()
                tflops = self.flops_per_token * rate / world / 1e12
                mem = torch.tensor(peak_memory_gib(self.device), device=self.device)
                mem = float(self.reduce(mem, list(self.dims.sizes), dist.ReduceOp.MAX))
                self.log.record({"step": done, **rec, "tokens_per_s": rate, "tflops": tflops,
                                 "mfu": tflops / self.peak_tflops if self.peak_tflops else None, "peak_mem_gib": mem,
                                 "epoch": self.batches.epoch})
            if self.eval_tokens is not None and ((a.eval_every and done % a.eval_every == 0) or last):
                self.log.record({"step": done, "eval_loss": self.eval_loss()})
            if a.ckpt_dir and ((a.ckpt_every and done % a.ckpt_every == 0) or (last and a.export_hf)):
                self.save(done)

    def save(self, step: int) -> str:
        a = self.args
        path = os.path.join(a.ckpt_dir, f"step{step:06d}")
        state = {"step": step, "sched": self.sched.state_dict(), "schedule": self.schedule_flags(),
                 "rng": torch.get_rng_state(), "data": self.batches.state_dict()}
        t0 = time.perf_counter()
        save(self.module, path, optimizer=self.opt, state=state, keep_last=a.keep_last, show_progress=False,
             digest=not a.no_checkpoint_digests)
        self.log.print(f"checkpoint {path} at step {step} ({time.perf_counter() - t0:.1f} s)")
        return path

    def checksum(self) -> float:
        """The sum of the full state dict in float64 (under pp over every stage, a tied tensor once)."""
        if self.mesh is None:
            return sum(float(t.double().sum()) for t in self.module.state_dict().values() if t.is_floating_point())
        full = full_state_dict(self.module)
        sums = {k: float(t.double().sum()) for k, t in full.items() if t.is_floating_point()}
        if self.program.pipelined:
            gathered: list = [None] * self.dims.pp
            dist.all_gather_object(gathered, sums, group=self.mesh["pp"].get_group())
            sums = {k: v for part in gathered for k, v in part.items()}
        return sum(sums.values())

    # ------------------------------------------------------------------ the end: the weights out

    def scratch_dir(self) -> str:
        """``--export-hf OUT`` without ``--ckpt-dir``: a new directory beside ``OUT`` for the
        checkpoint the export reads (rank 0 makes it, every rank gets its name); removed after."""
        path = [make_scratch_dir(self.args.export_hf) if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(path, src=0)
        return path[0]

    def export(self, ckpt: str, probe) -> None:
        """Rank 0, after the run: ``ckpt`` as an HF checkpoint in ``--export-hf``, checked."""
        a = self.args
        t0 = time.perf_counter()
        out = export_checkpoint(ckpt, a.export_hf, sources={"--model": self.source.tokenizer_dir})
        (ids, _), (kind, value) = probe
        if kind == "logits":
            check = f"logits of the trained program, max difference {max_logit_difference(out, ids, value):.3g}"
        else:
            check = f"loss of the trained program, difference {abs(exported_loss(out, probe[0]) - value):.3g}"
        print(f"exported {ckpt} to {out} ({time.perf_counter() - t0:.1f} s); from_pretrained({out!r}) vs the "
              f"{check}", flush=True)

    def probe(self):
        """What the export is checked against, on the first held-out (else training) batch in
        order: the program's logits gathered to every rank, or under pp its loss."""
        a = self.args
        tokens = self.eval_tokens or self.batches.tokens
        mine = next(text_data.eval_batches(tokens, a.batch, self.dims.dp_rank(self.mesh), self.dims.batch_ranks, 1))
        whole = next(text_data.eval_batches(tokens, a.batch, 0, 1, 1))
        ids, labels = (t.to(self.device) for t in mine)
        self.module.eval()
        with torch.no_grad():
            if self.program.pipelined:
                count = self.global_count(labels)
                return whole, ("loss", float(self.micro_loss(ids, labels, count, backward=False)))
            with self.autocast():
                logits = getattr(self.module(**{self.source.input_name: self.local_piece(ids)}), "logits", None)
            if logits is None:  # a torchtitan program returns the tensor
                logits = self.module(**{self.source.input_name: self.local_piece(ids)})
        if self.program.vocab_parallel:  # loss parallel: the export check alone sees whole rows
            axis, vocab = self.program.vocab_parallel
            logits = all_gather(logits, axis, -1, size=vocab)
        if self.dims.cp > 1:
            logits = gather_sequence(logits, "cp", sharded=self.module)
        for axis in self.dims.batch_axes:  # every dp rank's rows (under HSDP dp spans the replicas)
            parts = [torch.empty_like(logits) for _ in range(self.mesh[axis].size())]
            dist.all_gather(parts, logits.contiguous(), group=self.mesh[axis].get_group())
            logits = torch.cat(parts)
        return whole, ("logits", logits.float().cpu())


@contextlib.contextmanager
def _interruptible(run: "Run"):
    """Ctrl-C (SIGINT) while training: Python's KeyboardInterrupt, and a note of it the loop
    reads at each step, since a KeyboardInterrupt raised inside a callback (a weak reference's,
    a ``__del__``) is printed and ignored.  Only where Python's own handler is in place, in the
    main thread."""
    import signal
    import threading

    def on_sigint(signum, frame):
        run.interrupted = True
        raise KeyboardInterrupt

    mine = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if mine:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if mine:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _spans(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else str(x))
            start = None
    return ",".join(out) or "none"


def run(args) -> int:
    """The whole run; returns the exit status: 0, or 130 when stopped by Ctrl-C (SIGINT), after
    one line naming the last committed checkpoint (rank 0 says it; every rank stops)."""
    r = scratch = None
    try:
        r = Run(args)
        export_from, probe = None, None
        try:
            r.setup()
            r.train()
            if args.export_hf:
                probe = r.probe()
                if args.ckpt_dir is None:  # a checkpoint to export from, in a directory of fxshard's own
                    scratch = r.scratch_dir()
                    if r.rank == 0:
                        save_model_dir(scratch, r.config, r.tokenizer, vars(args))
                    export_from = fxshard_save_final(r, scratch)
                else:
                    export_from = latest_checkpoint(args.ckpt_dir)
            checksum = r.checksum()
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):
                claim_failure()  # now, while the peers are up: their errors from losing this rank come later
            raise
        finally:
            r.log.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        if r.rank != 0:
            return 0
        if export_from is not None:
            r.export(export_from, probe)
        print(f"final checksum {checksum!r}", flush=True)
        return 0
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:
            print(interrupted_message(args.ckpt_dir, getattr(r, "done", None)), file=sys.stderr, flush=True)
        return 130
    finally:
        if scratch is not None and r.rank == 0:
            remove_scratch_dir(scratch)


def fxshard_save_final(r: Run, root: str) -> str:
    path = os.path.join(root, f"step{r.args.steps:06d}")
    save(r.module, path, optimizer=None, show_progress=False)
    return path


def exported_loss(out: str, batch) -> float:
    """The exported model's mean token loss on ``batch`` (``(input_ids, labels)``, pre-shifted)."""
    from transformers import AutoModelForCausalLM

    ids, labels = batch
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=False).eval()
    with torch.no_grad():
        total = token_loss_sum(model(input_ids=ids), labels)
    return float(total / (labels != -100).sum().clamp(min=1))
