"""Contract violations: one exception hierarchy, one family per relation.

A violation is raised *before* the physical action it guards (a check precedes its action), so the
message must be enough to locate the bug without a debugger: it names the family, the specific rule
(``relation``), the invocation key, and the expected and found values. Keeping one subclass per family
lets callers (and the fault-injection report) tell exactly which relation failed instead of collapsing
everything into one generic error.
"""

from __future__ import annotations

from typing import Any


class ContractViolation(Exception):
    """Base of every contract violation.

    ``family`` names the contract family (class attribute of each subclass); ``relation`` names the
    specific rule that failed (for example ``"stale generation"``); ``key``, ``expected`` and ``found``
    are kept as attributes so tests and reports need not parse the message.
    """

    family: str = "contract"

    def __init__(
        self,
        message: str,
        *,
        relation: str,
        key: Any = None,
        expected: Any = None,
        found: Any = None,
    ) -> None:
        prefix = f"[{self.family}]"
        text = message if message.startswith(prefix) else f"{prefix} {message}"
        super().__init__(text)
        self.message = text
        self.relation = relation
        self.key = key
        self.expected = expected
        self.found = found

    @classmethod
    def build(
        cls,
        relation: str,
        *,
        key: Any = None,
        expected: Any = None,
        found: Any = None,
        what: str = "",
        note: str = "",
    ):
        """Build a violation with the standard message.

        ``[family] <relation> for <key>: expected <what> <expected>, found <found>[; <note>]``.
        ``what`` is a word that qualifies both values (e.g. ``"generation"``).
        """
        where = f" for {key}" if key is not None else ""
        qual = f"{what} " if what else ""
        text = f"{relation}{where}: expected {qual}{expected}, found {found}"
        if note:
            text = f"{text}; {note}"
        return cls(text, relation=relation, key=key, expected=expected, found=found)

    def __str__(self) -> str:
        return self.message


class TapeViolation(ContractViolation):
    """Retained-work ownership: stale or foreign tape reference, ABA, duplicate live key, capacity."""

    family = "tape-reference"


class PoolCapacityError(TapeViolation):
    """The bounded tape pool is full. A live slot is never preempted; the message names the live keys."""


class ConsumerOrderViolation(ContractViolation):
    """A tape consumer ran twice, or ``dW`` ran before ``dI``."""

    family = "consumer-order"


class EffectTokenViolation(ContractViolation):
    """State order: a stale, foreign or forged effect token was presented."""

    family = "effect-token"


class CacheEpochViolation(ContractViolation):
    """Cache version: a forward would use a quantized-weight cache older than the optimizer epoch."""

    family = "cache-epoch"


class ArenaViolation(ContractViolation):
    """Gradient arena: wrong binding, aliased/duplicate/missing write, or use of an aborted arena."""

    family = "arena"


class CommitViolation(ContractViolation):
    """Premature commit or checkpoint: the step is not quiescent."""

    family = "commit"


class DeviceCompletionViolation(ContractViolation):
    """Device completion: a consumer would run without its producer's event (``contracts.completion``):
    a wait before any record, a read on a stream that did not wait, or a wait older than the latest record."""

    family = "device-completion"


FAMILIES: tuple[str, ...] = (
    TapeViolation.family,
    ConsumerOrderViolation.family,
    EffectTokenViolation.family,
    CacheEpochViolation.family,
    ArenaViolation.family,
    CommitViolation.family,
    DeviceCompletionViolation.family,
)
