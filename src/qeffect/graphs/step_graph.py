"""A step's actions as one CUDA graph: recorded once as the host issues them, then one launch a step.

Why: a captured step is one graph launch per action, and the host's launches, hand-off events and input
copies are most of what it queues (h2048 on the H200's host: 3.0 of 6.2 ms, against a GPU step of 7.9).
Recording: the step runs under one capture (`GraphManager.mode = "record"`); each action graph becomes a
child-graph node after what its rank's stream captured so far (`cuda_driver.CaptureInserter`), its input
copies, the hand-off events between rank streams and the step's other kernels (a clone, the loss sum) are
captured as they come, so the outer graph holds the same work in the same stream order. Every later step
runs its host bookkeeping dry (`mode = "dry"`: every contract checked, nothing issued), must issue exactly
what the recorded step issued (the same graphs, the same input copies from the same addresses), and then
launches the outer graph once.

The recorded step's batch tensors are the outer graph's inputs: a later step's batches are copied into
them first. What the step returns (its loss) is a tensor the outer graph writes, cloned for the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qeffect.graphs.manager import GraphManager


@dataclass
class RecordedStep:
    """One step's actions as one graph: what it reads, what it writes, and what its host issued."""

    graph: torch.cuda.CUDAGraph
    batches: list[tuple[Tensor, Tensor]]  # the recorded step's inputs: a later step copies its own into them
    loss: Tensor  # written by every replay
    issued: list[tuple[str, tuple[tuple[str, int], ...]]]  # `GraphManager.issued` while recording
    replays: int = 0
    # with rank streams: per rank, an external event the graph records after that rank's last work (its
    # commit waits for it instead of the whole graph); None without
    rank_done: list[torch.cuda.Event] | None = None


def record_step(manager: GraphManager, device: torch.device, batches: list[tuple[Tensor, Tensor]],
                run: Callable[[list[tuple[Tensor, Tensor]]], Tensor]) -> RecordedStep:
    """`run(batches)` (a step's actions, returning its loss) recorded as one graph on a side stream; nothing
    runs until the returned step's graph is replayed. The pipeline's rank streams join the capture through
    the step's fork and join."""
    outer = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    with torch.cuda.graph(outer, stream=side), recording(manager):
        loss = run(batches)
    caller.wait_stream(side)
    return RecordedStep(outer, list(batches), loss, list(manager.issued))


@contextmanager
def recording(manager: GraphManager) -> Iterator[None]:
    """A step's bookkeeping while its graph records (`GraphManager.mode = "record"`)."""
    manager.set_step_mode("record")
    try:
        yield
    finally:
        manager.set_step_mode("launch")


@contextmanager
def dry_step(manager: GraphManager) -> Iterator[None]:
    """The host's bookkeeping of a step with nothing issued (`GraphManager.mode = "dry"`)."""
    manager.set_step_mode("dry")
    try:
        yield
    finally:
        manager.set_step_mode("launch")


def load_batches(step: RecordedStep, batches: Any) -> None:
    """A step's batches into the recorded step's inputs, on the current stream (same shapes and dtypes)."""
    if len(batches) != len(step.batches):
        raise ValueError(f"a step graph reads {len(step.batches)} microbatches, got {len(batches)}")
    for m, (new, old) in enumerate(zip(batches, step.batches, strict=True)):
        for name, src, dst in (("input ids", new[0], old[0]), ("targets", new[1], old[1])):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(f"microbatch {m}'s {name} are {src.dtype}{tuple(src.shape)}; the step graph "
                                 f"reads {dst.dtype}{tuple(dst.shape)}")
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src, non_blocking=True)


def check_issued(step: RecordedStep, issued: list) -> None:
    """A dry step must issue what the recorded step issued; else its outer graph is not this step's work."""
    if issued == step.issued:
        return
    pairs = zip(issued, step.issued, strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(issued), len(step.issued)))
    got = issued[first] if first < len(issued) else "nothing"
    want = step.issued[first] if first < len(step.issued) else "nothing"
    raise RuntimeError(f"step graph: this step issues other work than the recorded step, from replay {first} "
                       f"on: {got} instead of {want}; the step was not committed (`runtime.step_graph = false` "
                       "launches every action instead)")
