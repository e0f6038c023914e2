"""Pipeline schedules as arithmetic: torch's schedules by the names a `.par` file uses, which stages a rank
along the pipeline axis runs, and how many micro-batches' activations a stage holds at once. Read by the
compiler's pipeline pass, the cost model and the run time alike, so it imports nothing of pardsl."""

from __future__ import annotations

import functools

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


def micro_batches_held(schedule: str, microbatches: int, axis_size: int, rank: int,
                       stages_per_rank: int) -> int:
    """The most micro-batches' activations any one of the rank's stages holds at once
    (stage_micro_batches_held)."""
    return max(stage_micro_batches_held(schedule, microbatches, axis_size, rank, stages_per_rank).values())


@functools.lru_cache(maxsize=1024)
def _held_by_stage(schedule: str, microbatches: int, axis_size: int, rank: int,
                   stages_per_rank: int) -> tuple[tuple[int, int], ...]:
    if schedule == "1F1B":  # backward starts once the pipeline is full: rank r holds p - r
        return ((rank, min(microbatches, axis_size - rank)),)
    stages_per_rank = SCHEDULES[schedule][1] or stages_per_rank  # the V-shaped ones: two, whatever is asked
    stages = stages_of_rank(rank, axis_size, axis_size * stages_per_rank, schedule)
    every = tuple((stage, microbatches) for stage in stages)  # GPipe's; the bound where no order is read
    if schedule == "GPipe":
        return every
    held, most, made = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
    try:
        for action in _rank_actions(schedule, microbatches, axis_size, rank, stages_per_rank):
            for step in (action.sub_actions or (action,)) if action is not None else ():
                kind = step.computation_type.value
                if kind == "F":
                    held[step.stage_index] += 1
                    made[step.stage_index] += 1
                    most[step.stage_index] = max(most[step.stage_index], held[step.stage_index])
                elif kind in ("B", "W"):  # a split backward keeps what its weights' half reads until that half
                    held[step.stage_index] -= 1
    except Exception:  # noqa: BLE001 - torch's private planner changed (names, stages): the bound
        return every
    # an order that does not run each micro-batch forward and backward once per stage is one torch's
    # schedule refuses to be built with (DualPipeV under 2p micro-batches): its counts mean nothing
    if any(made[stage] != microbatches or held[stage] != 0 for stage in stages):
        return every
    return tuple((stage, most[stage]) for stage in stages)


def stage_micro_batches_held(schedule: str, microbatches: int, axis_size: int, rank: int,
                             stages_per_rank: int) -> dict[int, int]:
    """Per stage the rank runs, the most micro-batches whose activations it holds at once under the
    schedule: 1F1B starts backward once the pipeline is full, so rank r holds p - r; GPipe holds every
    micro-batch; for the looped, interleaved and zero-bubble schedules, what torch's own order of the
    rank's actions leaves in flight at most (a forward adds one, a backward, or a split backward's weight
    half, takes one away). Each stage's most: their sum is at least what the rank holds at any moment."""
    return dict(_held_by_stage(schedule, microbatches, axis_size, rank, stages_per_rank))


def _rank_actions(schedule: str, microbatches: int, axis_size: int, rank: int, stages_per_rank: int) -> list:
    """The rank's actions in the order torch's schedule runs them, from the schedule's own planner: the
    planner reads only the sizes, so it is run without the stages and process group a schedule is made of."""
    cls = schedule_class(schedule)
    planner = cls.__new__(cls)
    rounds = max(1, microbatches // axis_size)
    planner.pp_group_size, planner._n_microbatches, planner.n_local_stages = axis_size, microbatches, stages_per_rank
    planner.number_of_rounds, planner.microbatches_per_round = rounds, microbatches // rounds
    planner.num_stages = planner._num_stages = axis_size * stages_per_rank
    planner._stages, planner.rank = [None] * stages_per_rank, rank
    return planner._calculate_single_rank_operations(rank)
