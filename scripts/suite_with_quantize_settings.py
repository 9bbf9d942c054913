"""Run pytest with the quantize pass's tile warps and amax-atomic ordering overridden, logging every Triton
kernel whose module loads while a CUDA stream captures (such a load happens inside the capture).

Why: with 2 warps per tile and relaxed amax atomics (faster on the H200: `quantize-ab-h4096-*-h200.json`)
the whole GPU suite failed twice at different tests with an invalidated capture ("operation failed due to
a previous error during capture"), while each failing file alone passed and 4 warps with acquire-release
passed the whole suite (at 010c4d2). Since `GraphManager` pauses Python's collector during captures it
passes with both (d127741), and 2 warps with relaxed are the defaults (6d49f37). This runs the suite in one
process with either setting, so the two can be compared:

    source .gpu-kit/setup.sh
    python3 scripts/suite_with_quantize_settings.py --warps 2 --amax-sem relaxed -- -m gpu -q -x -p no:cacheprovider

The log goes to ``$OUT/capture-loads.txt`` (or ``/tmp``).
"""

from __future__ import annotations

import argparse
import os
import traceback


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warps", type=int, default=None, help="fused_quantize.WARPS (the plain pass's warps per tile)")
    ap.add_argument("--amax-sem", choices=("acq_rel", "relaxed"), default=None, help="fused_quantize.AMAX_SEM")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    a = ap.parse_args()
    import pytest
    import torch
    import triton.compiler.compiler as compiler

    import qeffect.fp8.fused_quantize as fq

    if a.warps is not None:
        fq.WARPS = a.warps
    if a.amax_sem is not None:
        fq.AMAX_SEM = a.amax_sem
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), "capture-loads.txt"), "a")  # noqa: SIM115 - open for the run
    log.write(f"== WARPS={fq.WARPS} AMAX_SEM={fq.AMAX_SEM}\n")
    original = compiler.CompiledKernel._init_handles

    def init_handles(self) -> None:  # noqa: ANN001 - Triton's CompiledKernel
        if self.module is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            log.write(f"loaded during a capture: {self.name}, {getattr(self.metadata, 'num_warps', '?')} warps, "
                      f"{os.environ.get('PYTEST_CURRENT_TEST')}\n" + "".join(traceback.format_stack(limit=14)) + "\n")
            log.flush()
        return original(self)

    compiler.CompiledKernel._init_handles = init_handles
    args = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    return pytest.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
