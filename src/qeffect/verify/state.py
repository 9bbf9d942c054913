"""Bitwise state verification: a qeffect mode against the native eager reference.

Both runs are built from the same seed, parameters, data and recipe. Each step the reference runs
first and records a fingerprint after every action (cloned tensors); the qeffect run then replays the
step and compares its own fingerprint at the corresponding action with `torch.equal` over the tensors'
bit patterns (so -0.0 vs 0.0 and NaN payloads count). A tolerance is never used.

Correspondence: reference F(s,m) <-> qeffect F(s,m); reference B(s,m) <-> qeffect dI(s,m) (input
gradient, non-matrix gradients, backward FP8 state) and qeffect dW(s,m) (matrix gradients: the
reference's accumulated `.grad` against the arena's fixed-order prefix sum over microbatches 0..m,
compared as soon as those slots are all written). At each commit: the gradients the optimizer sees,
parameters, AdamW state, FP8 state, cache epochs and the step loss; with the training recipe
(`runtime.recipe`) also the global gradient norm ("parameter_gradients": global_grad_norm) and the
learning rate ("optimizer_state": lr). Both pipelines commit through `SingleProcessPipeline.commit`, so
clipping's global norm is reduced as in training. The schedule's horizon is the run's `steps` (a decay
with `optim.decay_steps = 0` ends at the last step compared, as it would in a training run of that
length).

The step graph (`runtime.step_graph`): a step launched as one recorded graph cannot be compared action by
action, so where the config's step graph applies (captured-direct) a second captured-direct pipeline
then trains the same steps through `SingleProcessPipeline.step`, recording its graph and replaying it as
training does; each step's loss is compared with the reference's and, after the last step, every
parameter, AdamW moment and FP8 state tensor with the reference's (`StepGraphCheck`).

`resume`: both pipelines start from a checkpoint (`qeffect.checkpoint`), loaded into the current config's
layout (which may differ from the one that wrote it), and the steps compared are the checkpoint's step
S to S + steps - 1 (synthetic batches and epochs numbered on from S): any state, at any step, in any
layout, checked against native eager started from the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.graphs.handshake import run_settings
from qeffect.runtime.build import build_single_process, schedule_of
from qeffect.runtime.memory_cap import release_device_memory
from qeffect.runtime.rank import BaseRank, NativeRank, QEffectRank
from qeffect.runtime.single import SingleProcessPipeline
from qeffect.schedule import Action, ActionKind, Schedule, validate

CATEGORIES = (
    "loss",
    "activations",
    "input_gradients",
    "parameter_gradients",
    "parameters",
    "optimizer_state",
    "fp8_state",
    "cache_contents",
    "cache_epochs",
    "resource_counts",
)

# perturb-scale: double one FP8 input scale of the qeffect run at step 1 (must fail: fp8_state).
# swap-dw: swap dW of two microbatches and sum microbatch gradients in execution order (must fail).
# swap-dw-fixed: the same legal swap with the arena's fixed-order sum (must pass).
Injection = Literal["perturb-scale", "swap-dw", "swap-dw-fixed"]


class CategoryResult(BaseModel):
    category: str
    compared: int
    mismatches: int


class Divergence(BaseModel):
    step: int
    action: str
    stage: int | None
    microbatch: int | None
    category: str
    tensor: str


class Rollover(BaseModel):
    amax_history_len: int
    forward_updates_per_module: int
    backward_updates_per_module: int
    weight_updates_per_module: int
    rolled_over: bool


class StepGraphCheck(BaseModel):
    """The step graph held to native eager: losses every step, the whole state after the last one."""

    recorded_at_step: int | None  # the step recorded as one graph (None: the run was too short to record)
    replays: int  # steps launched as that graph (the recorded one included)
    compared: int
    mismatches: int
    first_divergence: str | None = None  # "<category> at step <n>: <tensor>"
    passed: bool


class VerifyReport(BaseModel):
    schema_version: int = 1
    kind: Literal["verify-state"] = "verify-state"
    resumed_from: str | None = None  # the checkpoint both sides started from (`resume`)
    start_step: int = 0  # its step: the first step compared
    resumed_layout: str | None = None  # how this run lays out the checkpoint's model otherwise, if it does
    schedule: str
    path: str
    backend: str
    device: str
    steps: int
    pp: int
    chunks_per_rank: int
    microbatches: int
    # every bit-changing setting and the [runtime] section it ran under (`graphs.handshake.run_settings`)
    settings: dict[str, Any] = {}
    injection: str | None
    # the oracle check's perturbation (`verify.oracle`): "<category> at step <n> <action>: <tensor>"
    oracle_fault: str | None = None
    categories: list[CategoryResult]
    first_divergence: Divergence | None
    amax_rollover: Rollover
    losses: list[float | None]
    # a NaN or infinite loss fails the run even where both sides agree bit for bit: two runs that both
    # diverged are equal and still wrong (NaN losses are written as JSON null)
    non_finite_losses: int = 0
    graphs: dict | None = None  # captured paths: graph count, replays, handoffs, memory growth
    step_graph: StepGraphCheck | None = None  # where the config's step graph applies (module docstring)
    seconds: float
    torch_version: str
    passed: bool


Key = tuple  # (step, action-name, stage, microbatch)
Records = dict[Key, dict[str, dict[str, torch.Tensor]]]


def non_finite_count(losses: list[float | None]) -> int:
    """NaN or infinite losses (None: a NaN read back from JSON). Two runs that both diverged agree bit for
    bit and are still wrong, so every report counts these and fails on them."""
    return sum(1 for x in losses if x is None or not math.isfinite(x))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as integers, so equality is bitwise (sign of zero and NaNs included)."""
    if t.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.detach().contiguous().view(ints)
    return t.detach()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:  # compare where the tensors live; move only when they live apart
        b = b.to(a.device)
    return torch.equal(bits(a), bits(b))


def flip_lowest_bit(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` whose first element differs in its lowest bit alone (the oracle check's perturbation:
    no tolerance would see it, a bitwise comparison must)."""
    b = bits(t).clone().reshape(-1)
    b[0] = b[0] ^ 1
    return (b.view(t.dtype) if t.dtype.is_floating_point else b).reshape(t.shape)


@dataclasses.dataclass(frozen=True)
class OracleFault:
    """Perturb one tensor of `category` in the qeffect side's fingerprint at the first comparison of that
    category in `action` ("F", "dI", "dW" or "commit") of `step` (`verify.oracle`): the report's first
    divergence must then name exactly this category, step and action."""

    category: str
    step: int
    action: str

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"oracle fault: unknown category {self.category!r}, expected one of {CATEGORIES}")


def _clone(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in d.items() if v is not None}


def _cache_contents(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: lin.weight_cache.w_q for name, lin in chunk.matrix_linears().items() if lin.weight_cache is not None}


def _nonmatrix_grads(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in chunk.nonmatrix_params().items() if p.grad is not None}


def _all_params(rank: BaseRank) -> dict[str, torch.Tensor]:
    rank.settle()  # a row-lazy token table: every row and moment up to date first
    return {f"s{s}.{n}": p for s, c in rank.chunks.items() for n, p in c.named_parameters()}


def _optimizer_state(rank: BaseRank) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in _all_params(rank).items():
        for k, v in rank.optimizer.state.get(p, {}).items():
            out[f"{name}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def _fp8_part(state: dict[str, torch.Tensor], action: str) -> dict[str, torch.Tensor]:
    """The FP8 state an action transitions: F the forward (input, weight) state, dI the backward state.

    Comparing only that part keeps legal reorderings legal: ZB-V runs dI(s, m) before F(s, m+2) where
    Interleaved 1F1B runs it after, which changes when the backward state moves but not its sequence.
    """
    backward = action == "dI"
    return {k: v for k, v in state.items() if (".grad_" in k or k.startswith("grad_")) == backward}


def _fp8(rank: BaseRank) -> dict[str, torch.Tensor]:
    return {f"s{s}.{k}": v for s in rank.chunks for k, v in rank.fp8_state(s).items()}


@dataclasses.dataclass
class _Tally:
    compared: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    mismatches: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    first: Divergence | None = None
    fault: OracleFault | None = None  # the oracle check's perturbation, applied once (`OracleFault`)
    fault_tensor: str | None = None  # the tensor it perturbed

    def _inject(self, key: Key, category: str, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        f = self.fault
        if f is None or self.fault_tensor is not None or (key[0], key[1], category) != (f.step, f.action, f.category):
            return found
        name = next((n for n in sorted(found) if found[n] is not None and found[n].numel() > 0), None)
        if name is None:
            return found
        self.fault_tensor = name
        return {**found, name: flip_lowest_bit(found[name])}

    def compare(self, key: Key, category: str, expected: dict[str, torch.Tensor],
                found: dict[str, torch.Tensor]) -> None:
        found = self._inject(key, category, found)
        names = sorted(set(expected) | set(found))
        for name in names:
            self.compared[category] += 1
            a, b = expected.get(name), found.get(name)
            if a is None or b is None or not bitwise_equal(a, b):
                self.mismatches[category] += 1
                if self.first is None:
                    step, act, s, m = key
                    self.first = Divergence(step=step, action=act, stage=s, microbatch=m, category=category,
                                            tensor=name)


def _forward_fingerprint(rank: BaseRank, s: int, e_W: int, e_C: int | None) -> dict[str, dict[str, torch.Tensor]]:
    """What F(s, m) must reproduce: its output, the forward FP8 state, the cached weights, the epochs."""
    cat = "loss" if s == rank.num_stages - 1 else "activations"
    return {cat: {"output": rank.last_output},
            "fp8_state": _fp8_part(rank.fp8_state(s), "F"),
            "cache_contents": _cache_contents(rank.chunks[s]),
            "cache_epochs": {"e_W": torch.tensor(e_W), "e_C": torch.tensor(-1 if e_C is None else e_C)}}


def _input_grad_fingerprint(rank: BaseRank, s: int) -> dict[str, dict[str, torch.Tensor]]:
    """What dI(s, m) must reproduce: the input gradient, non-matrix `.grad`, the backward FP8 state."""
    out = {"parameter_gradients": _nonmatrix_grads(rank.chunks[s]),
           "fp8_state": _fp8_part(rank.fp8_state(s), "dI")}
    if rank.grad_input is not None:
        out["input_gradients"] = {"grad_input": rank.grad_input}
    return out


class _ReferenceRecorder:
    """Fingerprints of the native reference, one step at a time."""

    def __init__(self) -> None:
        self.records: Records = {}
        self.step = 0

    def _put(self, key: Key, category: str, tensors: dict[str, torch.Tensor]) -> None:
        self.records.setdefault(key, {}).setdefault(category, {}).update(_clone(tensors))

    def __call__(self, action: Action, rank: BaseRank) -> None:
        assert isinstance(rank, NativeRank)
        s, m, st = action.stage, action.microbatch, self.step
        chunk = rank.chunks[s]
        if action.kind is ActionKind.F:
            # the reference refreshes its cache on every step's first microbatch: e_C = e_W = step
            for cat, tensors in _forward_fingerprint(rank, s, st, st).items():
                self._put((st, "F", s, m), cat, tensors)
        elif action.kind is ActionKind.B:
            for cat, tensors in _input_grad_fingerprint(rank, s).items():
                self._put((st, "dI", s, m), cat, tensors)
            self._put((st, "dW", s, m), "parameter_gradients",
                      {n: p.grad for n, p in chunk.matrix_params().items()})

    def before_step(self, rank: BaseRank) -> None:
        self._put((self.step, "commit", None, None), "parameter_gradients",
                  {f"s{s}.{n}": p.grad for s, c in rank.chunks.items() for n, p in c.named_parameters()})

    def after_commit(self, rank: BaseRank) -> None:
        key = (self.step, "commit", None, None)
        self._put(key, "parameters", _all_params(rank))
        self._put(key, "optimizer_state", _optimizer_state(rank))
        self._put(key, "fp8_state", _fp8(rank))

    def after_commit_all(self, pipe: SingleProcessPipeline) -> None:
        """The recipe's values of the commit (`recipe_record`)."""
        for cat, tensors in recipe_record(pipe).items():
            self._put((self.step, "commit", None, None), cat, tensors)


class _QEffectChecker:
    """Compares the qeffect run against the reference records as its actions happen."""

    def __init__(self, reference: _ReferenceRecorder, tally: _Tally, schedule: Schedule) -> None:
        self.ref = reference
        self.tally = tally
        self.schedule = schedule
        self.step = 0
        self.next_prefix: dict[int, int] = {}
        self.live: dict[int, int] = {}
        self.dw_done: dict[int, int] = {}

    def begin_step(self, step: int) -> None:
        self.step = step
        self.next_prefix = dict.fromkeys(range(self.schedule.num_stages), 0)
        self.dw_done = dict.fromkeys(range(self.schedule.pp), 0)

    def _check(self, key: Key, category: str, found: dict[str, torch.Tensor]) -> None:
        expected = self.ref.records.get(key, {}).get(category)
        if expected is None:
            expected = {}
        self.tally.compare(key, category, expected, found)

    def __call__(self, action: Action, rank: BaseRank) -> None:
        assert isinstance(rank, QEffectRank)
        s, m, st = action.stage, action.microbatch, self.step
        chunk = rank.chunks[s]
        r = rank.rank
        if action.kind is ActionKind.F:
            found = _forward_fingerprint(rank, s, rank.clock.e_W, rank.actions[s].cache.e_C)
            for cat, tensors in found.items():
                self._check((st, "F", s, m), cat, tensors)
            self.live[r] = self.live.get(r, 0) + 1
        elif action.kind is ActionKind.DI:
            for cat, tensors in _input_grad_fingerprint(rank, s).items():
                self._check((st, "dI", s, m), cat, tensors)
        elif action.kind is ActionKind.DW:
            self.live[r] -= 1
            self.dw_done[r] += len(chunk.matrix_params())  # one arena write per matrix parameter
            written = {k for (name, k) in rank.arena.written if name.startswith(f"s{s}.")}
            while self.next_prefix[s] in written:
                k = self.next_prefix[s]
                self._check((st, "dW", s, k), "parameter_gradients", rank.matrix_grad_prefix(s, k))
                self.next_prefix[s] += 1
        # resource counts: live tapes and arena writes against an independent count from the program
        self.tally.compare((st, str(action.kind.value), s, m), "resource_counts",
                           {"live_tapes": torch.tensor(self.live.get(r, 0)),
                            "arena_writes": torch.tensor(self.dw_done.get(r, 0))},
                           {"live_tapes": torch.tensor(rank.pool.live_count),
                            "arena_writes": torch.tensor(len(rank.arena.written))})

    def after_commit_all(self, ranks: list[BaseRank], loss: torch.Tensor, ref_loss: torch.Tensor,
                         grads: dict[str, torch.Tensor],
                         recipe: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        key = (self.step, "commit", None, None)
        expected = self.ref.records.get(key, {})
        found = {
            "parameter_gradients": grads,
            "parameters": {k: v for r in ranks for k, v in _all_params(r).items()},
            "optimizer_state": {k: v for r in ranks for k, v in _optimizer_state(r).items()},
            "fp8_state": {k: v for r in ranks for k, v in _fp8(r).items()},
        }
        for cat, tensors in (recipe or {}).items():  # `recipe_record`
            found[cat] = {**found[cat], **tensors}
        for cat, tensors in found.items():
            self.tally.compare(key, cat, expected.get(cat, {}), tensors)
        self.tally.compare(key, "loss", {"step_loss": ref_loss}, {"step_loss": loss})
        self.tally.compare(key, "cache_epochs",
                           {f"rank{r.rank}.e_W": torch.tensor(self.step + 1) for r in ranks},
                           {f"rank{r.rank}.e_W": torch.tensor(r.clock.e_W) for r in ranks})


def _fault_text(tally: _Tally) -> str | None:
    f = tally.fault
    if f is None:
        return None
    return f"{f.category} at step {f.step} {f.action}: {tally.fault_tensor or 'nothing compared there'}"


def synthetic_batches(cfg: RunConfig, step: int, device: str | torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic random tokens for (seed, step): bit-exact verification needs no real text."""
    g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
    mc = cfg.model
    shape = (cfg.pipeline.microbatches, mc.microbatch_size, mc.seq_len + 1)
    tokens = torch.randint(0, mc.vocab_size, shape, generator=g).to(device)
    return [(tokens[m, :, :-1], tokens[m, :, 1:]) for m in range(shape[0])]


def _swap_dw(schedule: Schedule) -> Schedule:
    """Defer dW of microbatch 1 of rank 0's first stage until after its dW of microbatch 2 (legal)."""
    stage = schedule.stages_of(0)[0]
    prog = list(schedule.programs[0])
    late = Action(ActionKind.DW, stage, 1)
    prog.remove(late)
    prog.insert(prog.index(Action(ActionKind.DW, stage, 2)) + 1, late)
    swapped = dataclasses.replace(schedule, programs=(tuple(prog),) + tuple(schedule.programs[1:]))
    validate(swapped)
    return swapped


def resume_start(cfg: RunConfig, resume: str | Path | None) -> tuple[int, Path | None, str | None]:
    """(first step, checkpoint folder, layout change line) of a verification that starts from `resume`
    ((0, None, None) without one). The checkpoint is validated here and refused (`UserError`) for another
    model or recipe before any pipeline is built."""
    if resume is None:
        return 0, None, None
    from qeffect.checkpoint import layout_change, open_checkpoint, resolve_checkpoint
    from qeffect.checkpoint.state import resume_differences
    from qeffect.errors import UserError

    ck = open_checkpoint(resolve_checkpoint(resume))
    refused, _ = resume_differences(ck.payload.config, cfg.model_dump())
    if refused:
        raise UserError(f"--resume {ck.path}: checkpoint differs from this run: " + "; ".join(refused))
    return ck.payload.step, ck.path, layout_change(ck.payload, cfg)


def recipe_record(pipe) -> dict[str, dict[str, torch.Tensor]]:
    """What the training recipe decided at a pipeline's last commit, by category: the global gradient
    norm (with clipping) and the learning rate (as a float64 scalar)."""
    lr = torch.tensor(pipe.last_lr, dtype=torch.float64)
    out: dict[str, dict[str, torch.Tensor]] = {"optimizer_state": {"lr": lr}}
    if pipe.last_grad_norm is not None:
        out["parameter_gradients"] = {"global_grad_norm": pipe.last_grad_norm}
    return out


def grad_capture(rank: BaseRank, into: dict[str, torch.Tensor]) -> Callable[[], None]:
    """A pre-optimizer hook that clones the gradients the optimizer is about to use (`BaseRank.gradient`:
    with a staged fold the Triton AdamW finishes in its pass, `.grad` alone lacks the last group)."""

    def hook() -> None:
        into.update({f"s{s}.{n}": rank.gradient(p).detach().clone() for s, c in rank.chunks.items()
                     for n, p in c.named_parameters() if p.grad is not None})

    return hook


def _build(cfg: RunConfig, folder: Path | None, **kw: Any) -> SingleProcessPipeline:
    """`build_single_process(cfg, **kw)`, started from the checkpoint `folder` if given: numbers first, then
    graphs (they hold the loaded tensors by address)."""
    pipe = build_single_process(cfg, capture=folder is None, **kw)
    if folder is not None:
        from qeffect.checkpoint import load_checkpoint
        from qeffect.runtime.build import capture_graphs

        load_checkpoint(pipe, folder, cfg)
        capture_graphs(cfg, pipe)
    return pipe


def run_verify_state(cfg: RunConfig, *, steps: int = 20, path: str = "eager",
                     injection: Injection | None = None,
                     progress: Callable[[int, float], None] | None = None,
                     oracle_fault: OracleFault | None = None,
                     resume: str | Path | None = None) -> VerifyReport:
    """Run the native reference and the qeffect mode side by side and compare every fingerprint.

    `oracle_fault`: perturb one compared tensor (`OracleFault`, `verify.oracle`): the run must fail there.
    `resume`: both start from this checkpoint (module docstring)."""
    t0 = time.perf_counter()
    start, folder, layout = resume_start(cfg, resume)
    cfg = cfg.with_overrides(**{"train.steps": start + steps})  # the schedule's horizon (module docstring)
    device = cfg.train.device
    native = _build(cfg, folder, native=True, device=device)
    qeff = _build(cfg, folder, native=False, direct=(path != "captured-copy"), device=device,
                  fixed_order_sum=(injection != "swap-dw"), path=path,
                  # the swapped dW order needs one arena view per microbatch
                  accumulate=False if injection in ("swap-dw", "swap-dw-fixed") else None,
                  # chains bounded by the built schedule's liveness would not fit the swapped one
                  bounded_slots=injection not in ("swap-dw", "swap-dw-fixed"))
    if injection in ("swap-dw", "swap-dw-fixed"):
        if cfg.pipeline.microbatches < 3:
            raise ValueError("the swap-dw injection needs at least 3 microbatches")
        qeff.schedule = _swap_dw(qeff.schedule)
        from qeffect.schedule import global_order

        qeff.order = global_order(qeff.schedule)

    ref = _ReferenceRecorder()
    tally = _Tally(fault=oracle_fault)
    checker = _QEffectChecker(ref, tally, qeff.schedule)
    losses: list[float] = []
    ref_losses: list[torch.Tensor] = []
    f_per_stage = 0
    for step in range(start, start + steps):
        batches = synthetic_batches(cfg, step, device)
        ref.records = {}
        ref.step = step
        ref_loss = native.run_actions(batches, ref).clone()
        ref_losses.append(ref_loss)
        native.commit(before_step=ref.before_step)
        for r in native.ranks:
            ref.after_commit(r)
        ref.after_commit_all(native)

        if injection == "perturb-scale" and step == 1:
            lin = next(iter(qeff.ranks[0].chunks.values())).matrix_linears()
            first = next(iter(lin.values()))
            with torch.no_grad():
                first.input_scale.mul_(2.0)
        checker.begin_step(step)
        loss = qeff.run_actions(batches, checker)
        grads: dict[str, torch.Tensor] = {}
        qeff.commit(before_step=lambda r, into=grads: grad_capture(r, into)())
        checker.after_commit_all(qeff.ranks, loss, ref_loss, grads, recipe_record(qeff))
        losses.append(float(loss))
        if qeff.manager is not None:
            qeff.manager.mark_step()
        f_per_stage += cfg.pipeline.microbatches
        if progress is not None:
            progress(step - start, float(loss))

    L = cfg.fp8.amax_history_len
    rollover = Rollover(amax_history_len=L, forward_updates_per_module=f_per_stage,
                        backward_updates_per_module=f_per_stage, weight_updates_per_module=steps,
                        rolled_over=f_per_stage > L)
    cats = [CategoryResult(category=c, compared=tally.compared[c], mismatches=tally.mismatches[c])
            for c in CATEGORIES]
    passed = all(c.mismatches == 0 for c in cats) and all(c.compared > 0 for c in cats if c.category != "input_gradients" or cfg.pipeline.num_stages > 1)
    sched = schedule_of(cfg)
    graphs = None
    if qeff.manager is not None:
        st = qeff.manager.stats
        graphs = {"graph_count": st.graph_count, "graphs_per_rank": st.graph_count // sched.pp,
                  "expected_per_rank": sum(r.planned_graphs() for r in qeff.ranks) // sched.pp,
                  "replays": st.replay_count, "handoffs": st.handoffs,
                  "input_copies_skipped": st.input_copies_skipped,
                  "capture_host_seconds": st.capture_host_seconds,
                  "persistent_growth_bytes_per_step": qeff.manager.persistent_growth_per_step()}
        if qeff.offload is not None:
            o = qeff.offload
            graphs["offload"] = {"mode": o.mode, "groups": len(o.groups),
                                 "group_bytes": sum(g.nbytes for g in o.groups), "banks": len(o.banks),
                                 "d2h_copies": o.stats.d2h_copies, "d2h_skipped": o.stats.d2h_skipped,
                                 "h2d_copies": o.stats.h2d_copies, "kept_at_backward": o.stats.kept_at_backward,
                                 "release_at_backward": o.release_at_backward,
                                 "lookahead": o.lookahead, "prefetches": o.stats.prefetches,
                                 "launch_first": o.launch_first,
                                 "unmaps": o.stats.unmaps, "maps": o.stats.maps, "evictions": o.stats.evictions,
                                 "slots": len(o.slots()), "shared_slots": [[g.name for g in run] for run in o.shared],
                                 "not_offloaded": [g.name for g in o.not_offloaded],
                                 "bank_plan_kind": o.config.bank_plan, "kept": [g.name for g in o.kept],
                                 "search_prefer": o.config.search_prefer if o.config.bank_plan == "search" else None}
        passed = passed and graphs["graphs_per_rank"] == graphs["expected_per_rank"]
    step_graph = None
    if qeff.step_graph_after is not None and injection is None and oracle_fault is None:
        ref.records = {}  # the last step's fingerprints and the observed pipeline: memory back first
        del qeff, checker
        release_device_memory(torch.device(device))
        step_graph = check_step_graph(cfg, native, ref_losses, start=start, folder=folder)
        passed = passed and step_graph.passed
    non_finite = non_finite_count(losses)
    passed = passed and non_finite == 0
    return VerifyReport(
        resumed_from=None if folder is None else str(folder), start_step=start, resumed_layout=layout,
        schedule=cfg.pipeline.schedule, path=path, backend=cfg.fp8.backend, device=str(device), steps=steps,
        pp=sched.pp, chunks_per_rank=cfg.pipeline.chunks_per_rank, microbatches=cfg.pipeline.microbatches,
        settings=run_settings(cfg), injection=injection, oracle_fault=_fault_text(tally), categories=cats, first_divergence=tally.first, amax_rollover=rollover,
        losses=losses, non_finite_losses=non_finite, graphs=graphs, step_graph=step_graph, seconds=time.perf_counter() - t0, torch_version=torch.__version__, passed=passed,
    )


def check_step_graph(cfg: RunConfig, native: SingleProcessPipeline, ref_losses: list[torch.Tensor], *,
                     start: int, folder: Path | None) -> StepGraphCheck:
    """A captured-direct pipeline with the config's step graph trains the steps `native` trained, through
    `step` as training does; each step loss against `ref_losses`, then every parameter, AdamW moment and
    FP8 state tensor against `native`'s, which has trained them all."""
    device = cfg.train.device
    graphed = _build(cfg, folder, native=False, device=device, path="captured-direct")
    tally = _Tally()
    recorded_at = None
    for i, ref_loss in enumerate(ref_losses):
        step = start + i
        loss = graphed.step(synthetic_batches(cfg, step, device))
        if recorded_at is None and graphed.recorded is not None:
            recorded_at = step
        tally.compare((step, "step", None, None), "loss", {"step_loss": ref_loss}, {"step_loss": loss})
    last = (start + len(ref_losses) - 1, "state", None, None)
    for category, of in (("parameters", _all_params), ("optimizer_state", _optimizer_state), ("fp8_state", _fp8)):
        tally.compare(last, category, {k: v for r in native.ranks for k, v in of(r).items()},
                      {k: v for r in graphed.ranks for k, v in of(r).items()})
    d = tally.first
    mismatches = sum(tally.mismatches.values())
    return StepGraphCheck(
        recorded_at_step=recorded_at, replays=0 if graphed.recorded is None else graphed.recorded.replays,
        compared=sum(tally.compared.values()), mismatches=mismatches,
        first_divergence=None if d is None else f"{d.category} at step {d.step}: {d.tensor}", passed=mismatches == 0)
