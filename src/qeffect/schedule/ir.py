"""The project's own pipeline action IR.

torch's `_Action` format is private and changed in 2.6, 2.9 and 2.11; everything above the adapter speaks
this IR instead, so a torch upgrade can only break `adapter.py` (and the golden tests), never an executor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

SCHEDULE_NAMES = ("interleaved", "zbv", "native-interleaved")
_JSON_FORMAT = "qeffect.schedule/1"


class ScheduleError(ValueError):
    """A schedule breaks the action contract (missing, duplicate, misplaced or mis-ordered action).

    Defined here, below both `validate` and `order`, so that each can raise it without importing the other;
    `qeffect.schedule.validate.ScheduleError` is the same class.
    """


class ActionKind(StrEnum):
    """F = forward, dI = input-gradient backward, dW = weight-gradient backward, B = full backward.

    B appears only in the native eager reference program (`native-interleaved`).
    """

    F = "F"
    DI = "dI"
    DW = "dW"
    B = "B"


_ACTION_RE = re.compile(r"^(F|dI|dW|B)\(s=(\d+),m=(\d+)\)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action for one (stage, microbatch). Hashable: used as a key by order and validation."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}(s={self.stage},m={self.microbatch})"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of `str(action)`, e.g. ``Action.parse("dI(s=2,m=1)")``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. 'F(s=0,m=1)')")
        kind, stage, microbatch = match.groups()
        return Action(ActionKind(kind), int(stage), int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered compute program, plus the stage placement.

    Communication is not part of the IR: executors send/receive between actions, as `order.dependencies`
    says which upstream output each action consumes.
    """

    name: str
    pp: int
    stages_per_rank: int
    microbatches: int
    stage_to_rank: tuple[int, ...]  # index = stage
    programs: tuple[tuple[Action, ...], ...]  # index = rank

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def full_backward(self) -> bool:
        """True for the native reference (F and B); False for split-backward programs (F, dI, dW)."""
        return self.name.startswith("native")

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages owned by `rank`, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def actions(self) -> Iterator[tuple[int, Action]]:
        """All (rank, action) pairs, rank by rank, in program order."""
        for rank, program in enumerate(self.programs):
            for action in program:
                yield rank, action

    def to_json(self) -> str:
        """Stable, diff-friendly text (one rank program per line) for golden files."""
        programs = ",\n    ".join(json.dumps([str(a) for a in program]) for program in self.programs)
        head = {
            "format": _JSON_FORMAT,
            "name": self.name,
            "pp": self.pp,
            "stages_per_rank": self.stages_per_rank,
            "microbatches": self.microbatches,
            "stage_to_rank": list(self.stage_to_rank),
        }
        fields = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items())
        return f'{{\n  {fields},\n  "programs": [\n    {programs}\n  ]\n}}\n'

    @staticmethod
    def from_json(text: str) -> Schedule:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise ValueError(f"not a qeffect schedule (expected format {_JSON_FORMAT!r})")
        try:
            return Schedule(
                name=str(data["name"]),
                pp=int(data["pp"]),
                stages_per_rank=int(data["stages_per_rank"]),
                microbatches=int(data["microbatches"]),
                stage_to_rank=tuple(int(r) for r in data["stage_to_rank"]),
                programs=tuple(tuple(Action.parse(a) for a in program) for program in data["programs"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed schedule JSON: {exc!r}") from exc
