"""scripts/step_gaps.py on the CPU: its phase labels wrap a rank's own calls without changing how they are
called (the rank passes arguments the wrappers must forward), so a labelled step runs and each phase shows."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches
from script_modules import script_module


def test_labelled_step_runs_and_names_each_phase() -> None:
    cfg = load_config().with_overrides(**{"model.vocab_size": 256})
    pipe = build_single_process(cfg, native=False)
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    with script_module("scripts/step_gaps.py") as gaps:
        gaps.label_phases(pipe)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pipe.step(synthetic_batches(cfg, 1, "cpu"))
        names = {e.name for e in prof.events() if e.name.startswith(gaps.PHASE)}
    for phase in ("F.r0", "DI.r1", "DW.r0", "fold.r0", "adamw.r1", "commit.r0"):
        assert gaps.PHASE + phase in names, sorted(names)
