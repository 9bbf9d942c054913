"""Effect token: orders hidden FP8 state transitions on the device (state-order relation).

The token is a 0-dim int64 device tensor that carries no numbers of the model. Each stateful action
consumes the current token and produces the next one as ``value + 1`` *computed on the device*, so the
next action's kernels depend on this one's without any host synchronization. The host-side sequence
number ``seq`` mirrors the device chain and is what is checked: presenting anything but the ledger's
current token means an action is running against an outdated view of the FP8 state.

One ledger per stateful owner (e.g. one per stage chunk), never one global token: a single token
would serialize the whole pipeline and hide which relation failed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .errors import EffectTokenViolation


@dataclass(frozen=True, slots=True, eq=False)
class EffectToken:
    """One link of a ledger's chain. Compared by identity: a token is either current or it is not."""

    value: torch.Tensor
    seq: int
    ledger: str

    def __repr__(self) -> str:  # never print ``value``: that would synchronize with the device
        return f"EffectToken(ledger={self.ledger!r}, seq={self.seq})"


class EffectLedger:
    """Owner of one effect-token chain.

    ``history`` keeps the last ``history`` ``(seq, action)`` pairs for diagnostics only.
    """

    def __init__(self, name: str, device: str | torch.device = "cpu", history: int = 64) -> None:
        self.name = name
        self.device = torch.device(device)
        # torch.zeros on a CPU device never touches CUDA; on a CUDA device it is the one allocation.
        self._current = EffectToken(torch.zeros((), dtype=torch.int64, device=self.device), 0, name)
        self._history: deque[tuple[int, str]] = deque(maxlen=history)

    @property
    def current(self) -> EffectToken:
        return self._current

    @property
    def seq(self) -> int:
        return self._current.seq

    @property
    def history(self) -> list[tuple[int, str]]:
        return list(self._history)

    def check(self, token: EffectToken, action: str) -> None:
        """Raise :class:`EffectTokenViolation` unless ``token`` is current; changes nothing. An action
        calls this before any other effect (a cache refresh, a write) so a refused action leaves none."""
        cur = self._current
        if not isinstance(token, EffectToken):
            raise EffectTokenViolation.build("not an effect token", key=self.name, expected="EffectToken",
                                             found=type(token).__name__, note=f"action {action}")
        if token.ledger != self.name:
            raise EffectTokenViolation.build(
                "foreign token", key=self.name, what="ledger", expected=self.name, found=token.ledger,
                note=f"action {action}")
        if token.seq != cur.seq:
            raise EffectTokenViolation.build(
                "stale token", key=self.name, what="seq", expected=cur.seq, found=token.seq,
                note=f"action {action}")
        if token is not cur:
            raise EffectTokenViolation.build(
                "forged token", key=self.name, expected=f"the ledger's current token (seq {cur.seq})",
                found=f"another token object with seq {token.seq}", note=f"action {action}")

    def consume(self, token: EffectToken, action: str, value: torch.Tensor | None = None, *,
                checked: bool = False) -> EffectToken:
        """Check that ``token`` is current, then produce and return the next token.

        ``value``: the next token's device value when a captured graph already computed it from this
        token's value (the graph's token output); otherwise a kernel computes ``token.value + 1`` here.
        ``checked``: the caller ran :meth:`check` on this token just before (nothing since could move the
        ledger), so it is not checked again.
        """
        if not checked:
            self.check(token, action)
        cur = self._current
        # Device-side dependency: the next value is computed from this one by a kernel, not on the host.
        nxt = EffectToken(token.value + 1 if value is None else value, cur.seq + 1, self.name)
        self._history.append((cur.seq, action))
        self._current = nxt
        return nxt

    def snapshot(self) -> tuple:
        """Hashable host-side picture (no device read): name, seq, current token identity, history."""
        return (self.name, str(self.device), self._current.seq, id(self._current), tuple(self._history))
