"""Pipeline schedules as arithmetic: torch's schedules by the names a `.par` file uses, which stages a rank
along the pipeline axis runs, and how many micro-batches' activations a stage holds at once. Read by the
compiler's pipeline pass, the cost model and the run time alike, so it imports nothing of pardsl."""

from __future__ import annotations

# torch.distributed.pipelining's schedules by the names the `.par` file uses: (class name, stages per rank
# it takes: None for any, else exactly that many)
SCHEDULES: dict[str, tuple[str, int | None]] = {
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", None),
    "LoopedBFS": ("ScheduleLoopedBFS", None),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", None),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2),
    "DualPipeV": ("ScheduleDualPipeV", 2),
}


def schedule_class(name: str):
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[name][0])


def stages_of_rank(rank: int, axis_size: int, stages: int, schedule: str) -> list[int]:
    """The stages one rank along the pipeline axis runs, in order: round robin, or for the V-shaped
    schedules (ZBVZeroBubble, DualPipeV) rank r runs stages r and 2p - 1 - r."""
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [rank, 2 * axis_size - 1 - rank]
    return [s for s in range(stages) if s % axis_size == rank]


def rank_of_stage(stage: int, axis_size: int, schedule: str) -> int:
    """The rank along the pipeline axis that runs `stage` (the inverse of `stages_of_rank`)."""
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return stage if stage < axis_size else 2 * axis_size - 1 - stage
    return stage % axis_size


def micro_batches_held(schedule: str, microbatches: int, axis_size: int, rank: int) -> int:
    """How many micro-batches' activations one of the rank's stages holds at once: 1F1B starts backward
    once the pipeline is full, so rank r holds p - r of them; GPipe holds every micro-batch. For the
    looped and zero-bubble schedules this is every micro-batch too, an upper bound."""
    if schedule == "1F1B":
        return min(microbatches, axis_size - rank)
    return microbatches
