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

`kept_groups` says which groups no other group evicts between their forward and their backward: their
bytes are still in the bank when the backward comes, so resident mode need not copy them to the host.

`futile_restores` says which look-ahead restores resident mode should not start: between the backward that
would start one and the backward that reads it, another group of the same bank runs its forward and evicts
the restored bytes again. Such a restore is a wasted copy, and the forward that evicts it waits for it.

`short_window_groups` says which groups neither mode should offload at all: their backward comes
within fewer than `min_window` other actions of their forward (with 2 the last virtual stage's groups,
whose input gradient follows their forward at once; with `offload.min_window`'s default of 12 at
M = 4 also the third stage's in Interleaved, two of them in ZB-V). In release mode their D2H can hardly
finish, and their memory come back, before the backward needs them again: offloading them costs copies
and driver calls for little. In resident mode the plan mostly keeps them in their bank anyway: they would
add bank memory and slot copies inside their forward graphs.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
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


def explicit_banks(events: Sequence[Event], given: Sequence[int] | str,
                   source: str = "offload.explicit_banks") -> list[int]:
    """Banks given by hand (`offload.explicit_banks`; `scripts/offload_sim.py --search` prints them), one per
    group in backward order: a list or "b0:b1:..." (or commas). Checked against `conflicts`: two groups
    that conflict never share a bank."""
    text = given if isinstance(given, str) else ":".join(map(str, given))
    try:
        banks = [int(b) for b in text.replace(":", ",").split(",")]
    except ValueError:
        raise ValueError(f"{source}={text!r}: expected bank indices separated by ':' or ',' (one per group, in "
                         "backward order)") from None
    order = backward_order(events)
    if len(banks) != len(order) or min(banks) < 0:
        raise ValueError(f"{source}={text!r}: expected {len(order)} bank indices >= 0 (one per group, in backward "
                         f"order), got {len(banks)}")
    bank = dict(zip(order, banks, strict=True))
    edges = conflicts(events)
    for g in order:
        clash = [h for h in edges[g] if bank[h] == bank[g]]
        if clash:
            raise ValueError(f"{source}: groups {g!r} and {clash[0]!r} conflict (one claims memory while the "
                             f"other's backward runs, or their backwards are consecutive) but share bank {bank[g]}")
    return banks


def kept_groups(events: Sequence[Event], banks: Mapping[Hashable, int]) -> set[Hashable]:
    """Groups whose bank no other group claims between their F and their B: resident mode can skip their D2H.

    `banks`: the bank of every group that holds memory (a group missing from it is empty: it claims
    nothing and is never kept). What the resident state machine (`offload.group`) does, for a group h
    of bank b, and why only F and B events of the other groups of b inside g's window (F(g), B(g))
    matter:

    - F(h) always claims b (`before_forward`);
    - B(h) claims b when h was evicted (its restore). Inside g's window it always was: by its own F if
      that is inside the window too (a claim already), else by g's F (h was live then: F(h) < F(g) <
      B(h)). Counted always, which is therefore exact;
    - the look-ahead at B(x) restores h = the group after x in backward order (if live and evicted):
      if B(x) is inside g's window and h != g, B(h) follows B(x) immediately in backward order, so
      B(h) is inside the window too and already counted. Whether look-ahead is on changes nothing.

    So g is kept exactly when no F or B of another group of its bank falls strictly between F(g) and
    B(g). After B(g) its bank is read by its backward (a claim then is refused as busy) and after E(g)
    its bytes are dead. `check_events` puts every F, B and E of a group inside one step, and steps run
    one after another, so no event of another step falls inside a window: one step decides for all.
    The manager refuses (raises) a claim that would evict a kept group anyway, so a run whose order
    deviates from `events` fails instead of reading lost bytes.
    """
    check_events(events)
    named = {g for _, g in events}
    unknown = [g for g in banks if g not in named]
    if unknown:
        raise ValueError(f"offload plan: banks for groups without events: {unknown}")
    first, start = _windows(events)
    claims = [(i, g) for i, (kind, g) in enumerate(events) if kind in ("F", "B") and g in banks]
    return {g for g, b in banks.items()
            if not any(h != g and banks[h] == b and first[g] < i < start[g] for i, h in claims)}


def futile_restores(events: Sequence[Event], banks: Mapping[Hashable, int]) -> set[tuple[Hashable, Hashable]]:
    """Pairs (x, g), B(x) before B(g): a look-ahead restore of g started at B(x) would be evicted before B(g).

    Another group h of g's bank claims it between them: F(h) always does (`before_forward`), B(h) does when
    h's bytes had left the bank (its restore). B(h) is counted as a claim either way, so a listed pair may
    occasionally be a restore that would have survived: skipping it costs a later copy, never bytes. For
    the look-ahead of depth 1 (g right after x in backward order) no other B lies in between, and the
    list is exact."""
    check_events(events)
    start = {g: i for i, (kind, g) in enumerate(events) if kind == "B"}
    claims = [(i, h) for i, (kind, h) in enumerate(events) if kind in ("F", "B") and h in banks]
    order = [g for g in backward_order(events) if g in banks]
    out = set()
    for a, x in enumerate(order):
        for g in order[a + 1:]:
            if any(start[x] < i < start[g] and h != g and banks[h] == banks[g] for i, h in claims):
                out.add((x, g))
    return out


def short_window_groups(events: Sequence[Event], min_window: int) -> set[Hashable]:
    """Groups with fewer than `min_window` events of other groups strictly between their F and their B.

    Each event is one action (a forward, an input gradient or a weight gradient), so this counts the
    actions that run while the group's D2H could be under way. `min_window = 0` keeps every group."""
    check_events(events)
    if min_window < 0:
        raise ValueError(f"min_window must be >= 0, got {min_window}")
    first, start = _windows(events)
    return {g for g in first
            if sum(1 for i in range(first[g] + 1, start[g]) if events[i][1] != g) < min_window}


def shared_slots(events: Sequence[Event], groups: Collection[Hashable] | None = None,
                 max_members: int = 2, *, nested: bool = False, min_gap: int = 0) -> list[list[Hashable]]:
    """Release mode: runs of groups that can share one VMM slot, each in backward order (runs of one left out).

    Why: every slot a release step unmaps and maps again costs five driver calls on the host's hot path
    (unmap, release, create, map, set access: about 0.2 ms per slot on the H200's host). Groups whose
    backwards come one after another can go out and come back together: one unmap once every member's
    forward copy is done, one map before the first member's backward, which restores them all. A run g1,
    ..., gk (k <= `max_members`) qualifies when, among `groups` (default: every group of `events`), their
    backwards start one after another in that order and every member's forward comes before g1's backward
    (so the slot can go between the last forward and the first backward). With `nested`, only runs whose
    forwards ran in the reverse order (gk's first: the virtual stages 0 and 1 of one microbatch). No other
    group's backward starts between theirs, so restoring the later members with the first holds their
    memory about as long as the look-ahead's restore would. The price: the slot goes back to the driver
    only once the last member's forward is copied out. Of the partitions of the backward order into such
    runs, the one with the fewest runs (fewest slots), then the shortest waits for the last forward (event
    positions from a run's first forward to its last). `min_gap`: a run also needs at least this many events
    between its last forward and its first backward, the time in which the last member's D2H must finish and
    the host must see it for the slot to go before that backward (0: any run whose forwards come first)."""
    check_events(events)
    if max_members < 1:
        raise ValueError(f"max_members must be >= 1, got {max_members}")
    if min_gap < 0:
        raise ValueError(f"min_gap must be >= 0, got {min_gap}")
    keep = set(groups) if groups is not None else {g for _, g in events}
    first, start = _windows(events)
    order = [g for g in backward_order(events) if g in keep]

    # best[i]: (runs, waits, runs as lists) covering order[:i]
    best: list[tuple[int, int, list[list[Hashable]]]] = [(0, 0, [])]
    for i in range(1, len(order) + 1):
        options = []
        for k in range(1, min(max_members, i) + 1):
            run = order[i - k:i]
            forwards = [first[g] for g in run]
            fits = (all(b < a for a, b in zip(forwards, forwards[1:], strict=False)) if nested
                    else max(forwards) < start[run[0]])
            if fits and (k == 1 or start[run[0]] - max(forwards) - 1 >= min_gap):
                runs, waits, plan = best[i - k]
                options.append((runs + 1, waits + max(forwards) - min(forwards), plan + [run]))
        best.append(min(options, key=lambda o: o[:2]))
    return [run for run in best[-1][2] if len(run) > 1]


def _windows(events: Sequence[Event]) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
    """Each group's window: the positions of its F and of its B in `events` (checked by the caller)."""
    first = {g: i for i, (kind, g) in enumerate(events) if kind == "F"}
    start = {g: i for i, (kind, g) in enumerate(events) if kind == "B"}
    return first, start
