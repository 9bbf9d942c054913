"""`verify-state --oracle-check`: every category of the bitwise oracle can fail, and says where.

For each of the ten categories (`verify.state.CATEGORIES`) a short verify-state run perturbs one tensor of
that category in the qeffect side's fingerprint (its lowest bit: no tolerance would see it) at the first
comparison of the category in a chosen action of a chosen step (`verify.state.OracleFault`). The check
passes when every such run fails and its first divergence names exactly that category, step and action:
a category whose comparison were wired to nothing, compared a side with itself or lost its tensors would
pass its run or name another place. The contract fault injections (`verify.faults`) are the other half:
they show that the runtime rejects invalid operations; this shows that the oracle sees wrong bits.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.verify.state import Divergence, OracleFault, run_verify_state

# (category, action) pairs: each category at an action whose fingerprint holds it
ORACLE_ACTIONS: tuple[tuple[str, str], ...] = (
    ("loss", "F"),  # the last stage's forward
    ("activations", "F"),
    ("input_gradients", "dI"),
    ("parameter_gradients", "dW"),
    ("parameters", "commit"),
    ("optimizer_state", "commit"),
    ("fp8_state", "dI"),
    ("cache_contents", "F"),
    ("cache_epochs", "F"),
    ("resource_counts", "dW"),
)


def oracle_faults(step: int = 1) -> list[OracleFault]:
    """One perturbation per category, all at `step`."""
    return [OracleFault(category=c, step=step, action=a) for c, a in ORACLE_ACTIONS]


class OracleCheckResult(BaseModel):
    category: str
    step: int
    action: str
    perturbed: str | None  # the report's `oracle_fault` text
    first_divergence: Divergence | None
    run_passed: bool  # must be False: the perturbed run fails
    passed: bool


class OracleCheckReport(BaseModel):
    schema_version: int = 1
    kind: Literal["oracle-check"] = "oracle-check"
    path: str
    steps: int
    results: list[OracleCheckResult]
    seconds: float
    passed: bool


def detected(fault: OracleFault, first: Divergence | None, run_passed: bool) -> bool:
    """The perturbed run failed, and first at the perturbation's category, step and action."""
    return (not run_passed and first is not None
            and (first.category, first.step, first.action) == (fault.category, fault.step, fault.action))


def run_oracle_check(cfg: RunConfig, *, steps: int = 2, path: str = "eager",
                     faults: list[OracleFault] | None = None) -> OracleCheckReport:
    """One short verify-state run of `path` per fault (default: every category at the last step)."""
    if cfg.pipeline.num_stages < 2:
        raise ValueError("the oracle check needs at least 2 stages (activations and input gradients cross them)")
    faults = faults if faults is not None else oracle_faults(step=steps - 1)
    t0 = time.perf_counter()
    results = []
    for fault in faults:
        if fault.step >= steps:
            raise ValueError(f"oracle fault at step {fault.step} needs more than {steps} steps")
        report = run_verify_state(cfg, steps=steps, path=path, oracle_fault=fault)
        first = report.first_divergence
        results.append(OracleCheckResult(category=fault.category, step=fault.step, action=fault.action,
                                         perturbed=report.oracle_fault, first_divergence=first,
                                         run_passed=report.passed,
                                         passed=detected(fault, first, report.passed)))
    return OracleCheckReport(path=path, steps=steps, results=results, seconds=time.perf_counter() - t0,
                             passed=bool(results) and all(r.passed for r in results))
