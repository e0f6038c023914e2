"""Train a small LLaMA with pardsl under torchrun: AdamW, warm-up and cosine learning rate, gradient
clipping, a checkpoint mid-way and a resume, loss and tokens per second with a progress bar.

    torchrun --nproc-per-node 2 examples/train.py --plan examples/llama_train_tp2.par --steps 60 --save-at 30
    torchrun --nproc-per-node 4 examples/train.py --plan examples/llama_train_dp2_tp2.par --resume ckpt/step-30
    python examples/train.py --serial --steps 60        # the same training, plain PyTorch, one process

A pipelined plan (`examples/llama_train_pp2_tp2.par`, whose sizes are fixed: `--batch 4 --seq 32`) trains
the same way, each step's micro-batches run by `model.step`, and saves and resumes as any other.

Surviving a dead rank: with `--save-every N --resume auto`, a run restarted by torchrun
(`--max-restarts 1`) continues from the newest complete checkpoint in --checkpoint-dir (a save that died
part-way is passed over), and trains on the batches a straight run would:

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --max-restarts 1 \
        examples/train.py --save-every 5 --resume auto

(torch's agents count restarts each on their own, so with the store they share with their workers, a
restarted gloo or NCCL group can read the previous attempt's addresses and hang at start-up;
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a store of its own.)

The corpus is generated (seeded, no downloads): sentences from a small grammar, tokenized as bytes, so
the model's vocabulary of 256 covers it. Step k always trains on the same batch, so a resumed run and a
run under another plan see the data a straight run would.

A checkpoint keeps the learning-rate schedule it was trained on (--steps, --lr, --min-lr, --warmup: the
cosine reaches --min-lr at --steps) and the next batch to read. A resume under another schedule would
train on other learning rates than the run it continues, so it is refused unless --allow-schedule-change
(then the new schedule holds from the resumed step on).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUBJECTS = ["the compiler", "a rank", "the mesh", "every layer", "the optimizer", "a shard", "the model",
            "each gradient", "the scheduler", "a checkpoint"]
VERBS = ["splits", "gathers", "reduces", "stores", "sends", "reads", "writes", "trains", "checks", "sums"]
OBJECTS = ["the weights", "its activations", "a partial sum", "the batch", "every token", "the logits",
           "one tensor", "the vocabulary", "a sequence", "the loss"]
ENDINGS = [".", " at once.", " over the mesh.", " in backward.", " without a copy.", " twice."]


def corpus(sentences: int = 20000, seed: int = 1234) -> torch.Tensor:
    """A byte-tokenized text of `sentences` generated sentences."""
    rng = random.Random(seed)
    text = " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}"
                    for _ in range(sentences))
    return torch.tensor(list(text.encode("ascii")), dtype=torch.int64)


def batch_at(tokens: torch.Tensor, index: int, batch: int, seq: int) -> torch.Tensor:
    """The `index`-th batch: `batch` windows of `seq` tokens at positions seeded by `index`."""
    generator = torch.Generator().manual_seed(index)
    starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=generator)
    return torch.stack([tokens[s:s + seq] for s in starts.tolist()])


def learning_rate(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="examples/llama_train_tp2.par")
    parser.add_argument("--steps", type=int, default=60, help="the step the run ends at")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--save-at", type=int, default=None,
                        help="save a checkpoint once this many steps are done (with --resume from that step: "
                             "save what was loaded, resharded to --plan, before training on)")
    parser.add_argument("--save-every", type=int, default=None, help="save a checkpoint every this many steps")
    parser.add_argument("--checkpoint-dir", default="ckpt")
    parser.add_argument("--resume", default=None,
                        help="a checkpoint folder to continue from; `auto`: the newest complete one in "
                             "--checkpoint-dir, if any (from the start otherwise)")
    parser.add_argument("--allow-schedule-change", action="store_true",
                        help="resume under other --steps, --lr, --min-lr or --warmup than the checkpoint's run")
    parser.add_argument("--kill-rank", type=int, default=None,
                        help="to try the restart path: in a run that did not resume, this rank kills itself "
                             "(SIGKILL) midway through step --kill-at, between forward and backward")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--loss-log", default=None, help="append one JSON line per step (rank 0) to this file")
    parser.add_argument("--serial", action="store_true", help="train the serial model in one process instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.serial and args.resume:
        parser.error("--resume is for pardsl runs")
    return args


def schedule(args) -> dict:
    """What sets each step's learning rate besides the step."""
    return {"steps": args.steps, "lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup}


def resume_point(args) -> tuple[int, int]:
    """The step a resume starts at and the batch it reads first, from its checkpoint. Every rank checks
    before the process group starts, so a refused resume ends at once, rank 0 saying why."""
    import pardsl

    metadata = pardsl.checkpoint_metadata(args.resume)
    if metadata is None:
        sys.exit(f"train.py: error: {args.resume} is not a checkpoint pardsl.save wrote")
    saved = metadata.get("schedule") or {}  # empty: saved by a version of this script that did not keep it
    now = schedule(args)
    changed = [f"--{name.replace('_', '-')} {was} (this run: {now[name]})" for name, was in saved.items()
               if now[name] != was]
    if changed and not args.allow_schedule_change:
        message = (f"train.py: error: {args.resume} was saved by a run with {', '.join(changed)}; resumed under "
                   f"this schedule, its remaining steps would train at other learning rates than that run's. "
                   f"Give that run's values, or --allow-schedule-change to train on the new schedule from step "
                   f"{metadata['step']}.")
        sys.exit(message if int(os.environ.get("RANK", "0")) == 0 else 2)  # torchrun sets RANK: one copy
    return metadata["step"], metadata.get("data", {}).get("next_batch", metadata["step"])


def save(model, optimizer, plan, steps_done: int, next_batch: int, args, progress) -> None:
    """A checkpoint of the model's and the optimizer's shards, the step to resume at, the schedule it was
    trained on and the batch to read next."""
    if plan is None:
        return
    import pardsl

    folder = os.path.join(args.checkpoint_dir, f"step-{steps_done}")
    metadata = {"step": steps_done, "schedule": schedule(args), "data": {"next_batch": next_batch}}
    pardsl.save(model, folder, optimizer=optimizer, metadata=metadata)  # all or nothing
    if dist.get_rank() == 0:
        progress.console.print(f"saved {folder}")


def last_stage_loss(loss: torch.Tensor | None) -> float:
    """A pipelined step's loss, which only the last stage's ranks have, on every rank (rank 0 logs it)."""
    held = torch.tensor([0.0 if loss is None else loss.item(), 0.0 if loss is None else 1.0], dtype=torch.float64)
    dist.all_reduce(held)
    return (held[0] / held[1]).item()


def main(argv=None) -> None:
    args = arguments(argv)
    tokens = corpus()
    torch.manual_seed(args.seed)
    if args.serial:
        from examples.hf_models import llama_causal_lm

        model, plan, rank = llama_causal_lm(layers=2), None, 0
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # noqa: E731
        start = position = 0
    else:
        import pardsl

        if args.resume == "auto":  # a restarted run: the newest checkpoint every rank finished, if any
            args.resume = pardsl.latest_checkpoint(args.checkpoint_dir)
        start, position = resume_point(args) if args.resume else (0, 0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        rank = dist.get_rank()
        plan = pardsl.load(args.plan)
        model = plan.module(checkpoint=args.resume)  # this rank's shards; from the checkpoint if given
        clip = lambda: pardsl.clip_grad_norm_(model, args.clip)  # noqa: E731
        if args.resume and rank == 0:
            print(f"resuming from {args.resume} at step {start}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if args.resume:
        pardsl.load_optimizer_state(optimizer, model, args.resume)

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                        TimeRemainingColumn(), disable=rank != 0)
    log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None
    if args.resume and args.save_at == start:  # what was loaded, resharded to this plan
        save(model, optimizer, plan, start, position, args, progress)
    with progress:
        task = progress.add_task("train", total=args.steps, completed=start, loss=float("nan"), tps=0.0)
        for step in range(start, args.steps):
            began = time.perf_counter()
            batch = batch_at(tokens, position, args.batch, args.seq)
            position += 1
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
            inputs = dict(input_ids=batch, labels=batch)
            killed = rank == args.kill_rank and step == args.kill_at and not args.resume
            if plan and plan.pipelined:  # forwards and backwards of the micro-batches, in the schedule's order
                if killed:  # a pipelined step is forward and backward at once: before it
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = last_stage_loss(model.step(**plan.shard_inputs(**inputs)))
            else:
                out = model(**(plan.shard_inputs(**inputs) if plan else inputs))
                if killed:
                    os.kill(os.getpid(), signal.SIGKILL)
                out.loss.backward()
                loss = out.loss.item()
            norm = clip()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_per_s = batch.numel() / (time.perf_counter() - began)
            progress.update(task, advance=1, loss=loss, tps=tokens_per_s)
            if rank == 0 and ((step + 1) % 10 == 0 or step + 1 == args.steps):
                progress.console.print(f"step {step + 1:4d}  loss {loss:.4f}  lr {learning_rate(step, args):.2e}  "
                                       f"grad norm {float(norm):.3f}  {tokens_per_s:,.0f} tok/s")
            if log:
                log.write(json.dumps({"step": step, "loss": loss, "grad_norm": float(norm)}) + "\n")
                log.flush()
            if args.save_at == step + 1 or (args.save_every and (step + 1) % args.save_every == 0):
                save(model, optimizer, plan, step + 1, position, args, progress)
    if not args.serial:
        dist.barrier()  # no rank tears gloo down while another's last collective is in flight
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
