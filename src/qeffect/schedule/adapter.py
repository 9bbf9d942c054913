"""The one place that touches torch's private pipelining schedule API.

`torch.distributed.pipelining` computes every rank's action order offline, without a process group, when
its schedule classes are built over duck-typed stages. Its `_Action` format is private and changed in
2.6, 2.9 and 2.11, so it is translated into the project's IR here, at once, defensively (by enum *name*,
never by position or integer value), and the result is validated before anyone sees it. Golden tests pin
the translated orders: if torch changes its schedules, they fail.

Only the order generators are used. torch's pipelining runtime and its autograd I/W split are not (they
do not work under CUDA graphs).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from .ir import Action, ActionKind, Schedule, ScheduleError
from .validate import validate

__all__ = ["build_native_schedule", "build_schedule", "expected_placement"]

_TORCH_CLASS = {"interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}
_LONG_NAME = {"interleaved": "interleaved 1F1B", "zbv": "ZB-V zero bubble"}

# torch _ComputationType names -> IR kinds. Communication and FSDP actions are dropped: the IR carries compute
# only and executors derive transfers from `order.dependencies`.
_KIND_BY_NAME = {
    "FORWARD": ActionKind.F,
    "FULL_BACKWARD": ActionKind.B,
    "BACKWARD_INPUT": ActionKind.DI,
    "BACKWARD_WEIGHT": ActionKind.DW,
}
_KIND_BY_SHORT = {"F": ActionKind.F, "B": ActionKind.B, "I": ActionKind.DI, "W": ActionKind.DW}
_DROPPED = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}


def build_schedule(
    name: Literal["interleaved", "zbv"],
    pp: int,
    stages_per_rank: int,
    microbatches: int,
    *,
    split_backward: bool = True,
) -> Schedule:
    """Every rank's program for `name`, translated from torch and validated.

    interleaved: torch's Interleaved 1F1B (round-robin placement, stage s on rank s % pp); it only emits
    full backward B, which is expanded to dI immediately followed by dW when `split_backward` (the default).
    With `split_backward=False` the B actions are kept and the result is the native reference program,
    named "native-interleaved" (see `build_native_schedule`).
    zbv: torch's ZB-V zero bubble (V placement, rank r owns stages r and 2*pp-1-r); needs stages_per_rank=2.
    Raises ValueError with a readable message for configurations torch (or the V shape) does not accept.
    """
    for label, value in (("pp", pp), ("stages_per_rank", stages_per_rank), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if name not in _TORCH_CLASS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(sorted(_TORCH_CLASS))}")
    if name == "zbv":
        if stages_per_rank != 2:
            raise ValueError(
                f"zbv (ZB-V zero bubble) needs exactly 2 stages per rank (the V shape: rank r owns stages r "
                f"and 2*pp-1-r), got stages_per_rank={stages_per_rank}"
            )
        if not split_backward:
            raise ValueError(
                "zbv is a split-backward schedule (dI and dW run apart); split_backward=False "
                "is only available for interleaved (the native reference)"
            )
    return _build(name, pp, stages_per_rank, microbatches, split_backward)


def build_native_schedule(pp: int, stages_per_rank: int, microbatches: int) -> Schedule:
    """The native eager reference program: Interleaved 1F1B with full backward B, named native-interleaved."""
    return build_schedule("interleaved", pp, stages_per_rank, microbatches, split_backward=False)


def native_with_placement(schedule: Schedule) -> Schedule:
    """The native reference (full backward B) on `schedule`'s stage placement and action order: each dI
    becomes B and each dW is dropped (nothing consumes a dW, so the order stays valid). What a distributed
    comparison needs: with one stage set per process, native and qeffect must own the same stages.
    Interleaved's own native program is `build_native_schedule` (torch's order with B)."""
    programs = tuple(
        tuple(Action(ActionKind.B, a.stage, a.microbatch) if a.kind is ActionKind.DI else a
              for a in prog if a.kind is not ActionKind.DW)
        for prog in schedule.programs)
    native = Schedule(name=f"native-{schedule.name}", pp=schedule.pp, stages_per_rank=schedule.stages_per_rank,
                      microbatches=schedule.microbatches, stage_to_rank=schedule.stage_to_rank, programs=programs)
    validate(native)
    return native


def expected_placement(name: str, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """stage -> rank: round robin for interleaved, V shape (two stages per rank) for zbv."""
    num_stages = pp * stages_per_rank
    if name == "zbv":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(num_stages))
    return tuple(s % pp for s in range(num_stages))


@lru_cache(maxsize=256)
def _build(name: str, pp: int, stages_per_rank: int, microbatches: int, split_backward: bool) -> Schedule:
    raw, torch_map = _torch_pipeline_order(name, pp, stages_per_rank, microbatches)
    programs = tuple(tuple(_translate_program(raw[rank], split_backward)) for rank in range(pp))
    stage_to_rank = expected_placement(name, pp, stages_per_rank)
    _check_placement(name, programs, stage_to_rank, torch_map)
    schedule = Schedule(
        name=name if split_backward else "native-interleaved",
        pp=pp,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        stage_to_rank=stage_to_rank,
        programs=programs,
    )
    try:
        validate(schedule)
    except ScheduleError as exc:
        raise ScheduleError(
            f"{_LONG_NAME[name]} with pp={pp}, stages_per_rank={stages_per_rank}, microbatches={microbatches}: "
            f"torch {_torch_version()} produced an order that is not a valid schedule ({exc}); "
            "use a microbatch count that is a multiple of pp"
        ) from exc
    return schedule


class _OfflineStage:
    """Duck-typed stand-in for `PipelineStage`: the attributes the schedule constructors read, no process group."""

    def __init__(self, group_size: int, group_rank: int, num_stages: int, stage_index: int) -> None:
        self.group_size = group_size
        self.group_rank = group_rank
        self.num_stages = num_stages
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _torch_pipeline_order(
    name: str, pp: int, stages_per_rank: int, microbatches: int
) -> tuple[dict[int, list[Any]], dict[int, int]]:
    """torch's compute-only `pipeline_order` (rank -> list of `_Action | None`) and its stage -> rank map."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, _TORCH_CLASS[name])
    num_stages = pp * stages_per_rank
    placement = expected_placement(name, pp, stages_per_rank)
    stages = [_OfflineStage(pp, 0, num_stages, s) for s in range(num_stages) if placement[s] == 0]
    try:
        instance = cls(stages, microbatches)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise ValueError(
            f"{_LONG_NAME[name]} with pp={pp} and {stages_per_rank} stage(s) per rank needs a microbatch count "
            f"that torch {_torch_version()} accepts (a multiple of pp always works); microbatches={microbatches} "
            f"was rejected: {exc}"
        ) from exc
    except (AttributeError, TypeError):
        # A torch that reads more of the stage than the duck type offers: use its own visualizer helper,
        # which mocks a full PipelineStage (it supports only >= 2 stages per rank for these schedules).
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        ops = get_schedule_ops(cls, pp, microbatches, stages_per_rank)
        return {rank: list(ops[rank]) for rank in range(pp)}, {}
    order = instance.pipeline_order
    if order is None or any(rank not in order for rank in range(pp)):
        raise RuntimeError(f"torch {_torch_version()} {cls.__name__} returned no program for some rank")
    torch_map = getattr(instance, "stage_index_to_group_rank", None) or {}
    return {rank: list(order[rank]) for rank in range(pp)}, {
        int(s): int(r) for s, r in dict(torch_map).items()
    }


def _translate_program(raw_program: list[Any], split_backward: bool) -> list[Action]:
    out: list[Action] = []
    for raw in raw_program:
        for action in _translate(raw):
            if action.kind is ActionKind.B and split_backward:
                out.append(Action(ActionKind.DI, action.stage, action.microbatch))
                out.append(Action(ActionKind.DW, action.stage, action.microbatch))
            else:
                out.append(action)
    return out


def _translate(raw: Any) -> list[Action]:
    """One torch `_Action` (or None, an idle slot) -> zero or more IR actions."""
    if raw is None:
        return []
    ctype = raw.computation_type
    cname = str(getattr(ctype, "name", ctype))
    if cname in _DROPPED:
        return []
    sub_actions = getattr(raw, "sub_actions", None)
    if sub_actions:  # OVERLAP_F_B and similar composites: their parts, in order
        return [a for sub in sub_actions for a in _translate(sub)]
    kind = _KIND_BY_NAME.get(cname)
    if kind is None:
        value = getattr(ctype, "value", ctype)
        kind = _KIND_BY_SHORT.get(value if isinstance(value, str) else str(ctype))
    if kind is None:
        raise RuntimeError(f"torch {_torch_version()} emitted an unknown action {raw!r} ({cname})")
    if raw.microbatch_index is None:
        raise RuntimeError(f"torch {_torch_version()} emitted a compute action without microbatch: {raw!r}")
    return [Action(kind, int(raw.stage_index), int(raw.microbatch_index))]


def _check_placement(
    name: str, programs: tuple[tuple[Action, ...], ...], expected: tuple[int, ...], torch_map: dict[int, int]
) -> None:
    """The placement derived from torch's programs must be the one the IR states (and torch's own map)."""
    derived: dict[int, set[int]] = {}
    for rank, program in enumerate(programs):
        for action in program:
            derived.setdefault(action.stage, set()).add(rank)
    for stage, rank in enumerate(expected):
        ranks = derived.get(stage, set())
        if ranks != {rank}:
            raise RuntimeError(
                f"torch {_torch_version()} {name}: stage {stage} runs on rank(s) {sorted(ranks)}, expected rank {rank}"
            )
        if torch_map and torch_map.get(stage) != rank:
            raise RuntimeError(
                f"torch {_torch_version()} {name}: its stage map puts stage {stage} on rank {torch_map.get(stage)}, "
                f"expected rank {rank}"
            )
