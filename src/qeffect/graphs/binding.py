"""Which captured graphs each microbatch of a chunk replays: graphs bounded by liveness, not by M.

A chunk's tapes live in a bounded set of *chains*. A chain is one tape slot together with its three
graphs, F, dI and dW: the saved activations, the retained dW work and every output sit at the chain's
fixed addresses, and every microbatch of the chain replays the same three graphs. With ``K`` slots per
stage from the schedule's liveness (`schedule.liveness.slots_for`), microbatch ``m`` belongs to the
*class*

- ``0`` for ``m = 0`` (its F refreshes the FP8 weight cache and its dI copies the non-matrix gradients
  where later ones add: graphs of their own),
- ``m % K`` for ``m % K != 0``,
- ``K`` for the later multiples of ``K``,

and a class is split further where the bodies still differ per microbatch (a *variant*): dW's arena
writes (`GradientArena.write_signature`: the destination, write or add, the slots of the staging fold it
holds) and, where a caller says so, dI's. A staged direct chunk stages at a depth that divides K
(`staging_depth`), so its slot and fold follow the class, and whether the fold overwrites, adds or is
skipped is a device word set before each replay: staging splits no class. Each (class, dI variant, dW variant) is one chain. Every chain's
microbatches are a subset of one ``m % K`` class, which the liveness analysis proved never to overlap in
time, so a chain is free again before its next F. The runtime does not trust that proof alone: the tape
pool slot of a chain refuses a new tape while its previous generation is not fully consumed
(`TapePool.check_slot_free`), and every consumer presents the generation it was given.

Why a variant gets a chain of its own rather than a second dI or dW graph over one F: Transformer
Engine's backward releases the forward's saved-tensor objects (``ctx.tensor_objects = None``), so one
forward supports one backward, and its wgrad store is a FIFO whose queued GEMM one dW drains once.
With ``K = M`` (no bound) every microbatch has its own chain: one graph set per microbatch.

Pure planning: no torch, no CUDA. `graph_plan` is what a capture builds, so the resource analysis can
count graphs per rank for any M on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property

__all__ = ["GraphPlan", "MicrobatchGraphs", "chain_count", "chain_of", "graph_plan", "staging_depth"]

Variant = Callable[[int], Hashable]


def chain_of(m: int, slots: int) -> int:
    """The class of microbatch `m` with `slots` = K (its chain when nothing else varies)."""
    if m == 0:
        return 0
    r = m % slots
    return r if r else slots


def staging_depth(staging: int, slots: int | None, microbatches: int) -> int:
    """The staging group size G of a direct chunk with K = `slots` chains (None: one per microbatch), at
    most `staging` (the configured depth; 0: not staged). A staged dW writes slot ``m % G`` and folds where
    ``m % G = G - 1``; both follow the class ``m % K`` only when G divides K, so G is the largest divisor
    of K up to `staging` (a depth that does not divide K would split every class into dW variants). With a
    chain per microbatch nothing is shared and the configured depth stands (at most M)."""
    if not staging or slots is None or slots >= microbatches:
        return min(staging, microbatches)
    return max(d for d in range(1, min(staging, slots) + 1) if slots % d == 0)


def chain_count(microbatches: int, slots: int) -> int:
    """How many classes M microbatches use with K = `slots`: K + 1 when a later multiple of K exists (the
    chains when no variant splits them)."""
    return len({chain_of(m, slots) for m in range(microbatches)})


@dataclass(frozen=True, slots=True)
class MicrobatchGraphs:
    """The chain microbatch `m` runs in (its F, dI and dW graphs and its tape slot) and why: its class
    (`chain_of`) and variants."""

    chain: int
    key: tuple[int, Hashable, Hashable]


@dataclass(frozen=True)
class GraphPlan:
    """Every microbatch's chain, and for each chain the first microbatch in it (the one its bodies are
    captured for: every other microbatch of the chain does the same device work)."""

    slots: int
    per_microbatch: tuple[MicrobatchGraphs, ...]

    @cached_property
    def chains(self) -> dict[int, int]:
        """chain -> the first microbatch in it (chains are numbered in that order; chain 0 holds m = 0)."""
        out: dict[int, int] = {}
        for m, g in enumerate(self.per_microbatch):
            out.setdefault(g.chain, m)
        return out

    @cached_property
    def _shared_chains(self) -> frozenset[int]:
        seen: dict[int, int] = {}
        for g in self.per_microbatch:
            seen[g.chain] = seen.get(g.chain, 0) + 1
        return frozenset(c for c, n in seen.items() if n > 1)

    def shared(self, m: int) -> bool:
        """Whether microbatch m's chain serves another microbatch of the step too: its static outputs are
        then rewritten within the step, so a result kept past the next use of the chain must be copied."""
        return self.per_microbatch[m].chain in self._shared_chains

    @property
    def graph_count(self) -> int:
        """F + dI + dW graphs the chunk captures."""
        return 3 * len(self.chains)


def graph_plan(microbatches: int, slots: int, *, di_variant: Variant | None = None,
               dw_variant: Variant | None = None) -> GraphPlan:
    """The chains of one chunk for M = `microbatches` and K = `slots` (K >= M: one chain per microbatch).

    `di_variant(m)` / `dw_variant(m)`: what else than the class makes microbatch m's dI / dW body differ
    (see the module docstring); None: nothing."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    k = min(slots, microbatches)
    ids: dict[tuple, int] = {}
    out = []
    for m in range(microbatches):
        key = (chain_of(m, k), di_variant(m) if di_variant is not None else None,
               dw_variant(m) if dw_variant is not None else None)
        out.append(MicrobatchGraphs(chain=ids.setdefault(key, len(ids)), key=key))
    return GraphPlan(slots=k, per_microbatch=tuple(out))


def chunk_plan(microbatches: int, slots: int, *, signed_zeros: bool,
               write_signature: Variant | None) -> GraphPlan:
    """A captured chunk's chains: its dI bodies differ by microbatch where the token rows' +0.0 pass runs
    (`signed_zeros`, the first stage only), its dW bodies by the arena write (`write_signature`, the
    direct path; None: the copy path's dW is the same for every microbatch)."""
    return graph_plan(microbatches, slots, di_variant=(lambda m: m) if signed_zeros else None,
                      dw_variant=write_signature)
