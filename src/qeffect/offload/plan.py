"""Static plans for offload groups driven by a fixed pipeline schedule: backward order and banks.

Captured graphs bake each group's slot address in, so in resident (ping-pong) mode a group's bank is
fixed at allocation and can never be swapped at run time. A pipeline interleaves forwards, input
gradients and deferred weight gradients of many (chunk, microbatch) groups, so "backward position
mod 2" is not enough: a forward may need a bank while the group holding it is still between its
`dI` and its `dW` (the backward window), and the group would be overwritten. One step's order is
the same every step, so the conflicts are known in advance: two groups conflict when one claims
memory (its forward, or its restore before `dI`) inside the other's backward window, or when their
backwards are consecutive (look-ahead restores one while the other runs). A greedy colouring in
backward order gives each group a bank no conflicting group shares. With more banks than the
colouring needs (`min_banks`), each group takes the free bank used longest ago, so a bank's previous
owner is more often consumed already: fewer evictions and reloads, for more device memory.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

Event = tuple[Literal["F", "B", "E"], Hashable]  # forward, backward start (dI), backward end (last reader)


def backward_order(events: Sequence[Event]) -> list[Hashable]:
    """Groups in the order their backwards start."""
    return [g for kind, g in events if kind == "B"]


def check_events(events: Sequence[Event]) -> None:
    """Every group: exactly one F, then one B, then one E (one step of a schedule)."""
    seen: dict[Hashable, str] = {}
    for kind, g in events:
        want = {"F": "", "B": "F", "E": "FB"}[kind]
        if seen.get(g, "") != want:
            raise ValueError(f"offload plan: group {g!r}: {kind} after {seen.get(g, '') or 'nothing'!r}, "
                             f"expected after {want or 'nothing'!r}")
        seen[g] = seen.get(g, "") + kind
    bad = [g for g, s in seen.items() if s != "FBE"]
    if bad:
        raise ValueError(f"offload plan: groups without a complete F/B/E sequence: {bad}")


def conflicts(events: Sequence[Event]) -> dict[Hashable, set[Hashable]]:
    """Undirected conflict sets (see the module docstring)."""
    check_events(events)
    edges: dict[Hashable, set[Hashable]] = {g: set() for kind, g in events if kind == "F"}
    in_window: set[Hashable] = set()
    for kind, g in events:
        if kind in ("F", "B"):  # g claims memory now: it must not share a bank with a running backward
            for h in in_window:
                if h != g:
                    edges[g].add(h)
                    edges[h].add(g)
        if kind == "B":
            in_window.add(g)
        elif kind == "E":
            in_window.discard(g)
    order = backward_order(events)
    for a, b in zip(order, order[1:], strict=False):
        edges[a].add(b)
        edges[b].add(a)
    return edges


def assign_banks(events: Sequence[Event], min_banks: int = 2) -> dict[Hashable, int]:
    """Bank index per group: greedy colouring of `conflicts` in backward order over at least `min_banks`
    banks, each group taking the free bank used longest ago (a new bank only when none is free).
    Consecutive backwards conflict, so two or more groups always get at least two banks."""
    if min_banks < 1:
        raise ValueError(f"min_banks must be >= 1, got {min_banks}")
    edges = conflicts(events)
    banks: dict[Hashable, int] = {}
    count = min_banks
    last_used: dict[int, int] = {}
    for pos, g in enumerate(backward_order(events)):
        used = {banks[h] for h in edges[g] if h in banks}
        free = [i for i in range(count) if i not in used]
        if not free:
            free = [count]
            count += 1
        banks[g] = min(free, key=lambda i: (last_used.get(i, -1), i))
        last_used[banks[g]] = pos
    return banks
