"""The effect token on the device, A/B in one process: captured stage actions incrementing one token
buffer per chunk in place (the default) against a token input per slot copied in before every replay
(``QEFFECT_TOKEN_COPY=1``: one 8-byte copy more per replay), same model and data.

    source .gpu-kit/setup.sh
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/token_ab.py --config examples/configs/h4096.toml \
        --schedule zbv --out $OUT/token-ab-h4096-zbv-h200.json

Both pipelines are built and warmed up first, then timed in rounds of `--block` synchronized steps,
the order alternating each round (a busy host's slow spells fall on both alike). Per variant: median
step time, its ratio to the copied token (median over rounds of the in-round medians too), and the losses,
which must be identical (the token carries no numbers of the model): exit 1 if they are not. A CPU dry
run cannot capture; this needs a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import git_revision
from qeffect.profile.matrix import ConfigSpec, PipelineRunner, device_name_of, te_version

VARIANTS = {"token-copy": "1", "token-in-place": "0"}  # QEFFECT_TOKEN_COPY per variant; the first is the base


def build(cfg, device: torch.device, copy: str, path: str) -> PipelineRunner:
    """A captured pipeline whose stage actions read QEFFECT_TOKEN_COPY = `copy` when they are built."""
    old = os.environ.get("QEFFECT_TOKEN_COPY")
    os.environ["QEFFECT_TOKEN_COPY"] = copy
    try:
        return PipelineRunner(cfg, device, ConfigSpec(path, "A/B of the device effect token", path=path))
    finally:
        if old is None:
            os.environ.pop("QEFFECT_TOKEN_COPY", None)
        else:
            os.environ["QEFFECT_TOKEN_COPY"] = old


def timed_step(runner: PipelineRunner, step: int, device: torch.device) -> tuple[float, torch.Tensor]:
    data = runner.data(step)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss = runner.step(data)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--schedule", default=None, help="interleaved or zbv (default: the config's)")
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=2, help="steps per variant per round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("token_ab.py: needs a CUDA device (captured graphs)", file=sys.stderr)
        return 2
    if args.steps < 1 or args.block < 1 or args.warmup < 0:
        print("token_ab.py: --steps and --block must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    cfg = load_config(args.config).with_overrides(**{"train.device": "cuda", "pipeline.schedule": args.schedule})
    device = torch.device("cuda", torch.cuda.current_device())
    runners = {name: build(cfg, device, copy, args.path) for name, copy in VARIANTS.items()}
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for name, r in runners.items():  # warm-up: the same data every variant sees later at the same step
        for step in range(args.warmup):
            losses[name].append(timed_step(r, step, device)[1])
    names = list(runners)
    step = args.warmup
    for rnd in range(-(-args.steps // args.block)):
        n = min(args.block, args.steps - rnd * args.block)
        for name in names if rnd % 2 == 0 else reversed(names):
            for i in range(n):
                t, loss = timed_step(runners[name], step + i, device)
                times[name].append(t)
                losses[name].append(loss)
        step += n
    base = names[0]
    same = all(torch.equal(torch.stack(losses[n]), torch.stack(losses[base])) for n in names)
    rows = {}
    for name in names:
        med = statistics.median(times[name])
        rounds = [statistics.median(times[name][i:i + args.block]) / statistics.median(times[base][i:i + args.block])
                  for i in range(0, len(times[name]), args.block)]
        rows[name] = {"QEFFECT_TOKEN_COPY": VARIANTS[name], "median_step_seconds": med, "step_seconds": times[name],
                      "ratio_vs_token_copy": med / statistics.median(times[base]),
                      "paired_ratio_vs_token_copy": statistics.median(rounds)}
        print(f"{name}: median {med * 1e3:.3f} ms, x{rows[name]['ratio_vs_token_copy']:.4f} of token-copy "
              f"(x{rows[name]['paired_ratio_vs_token_copy']:.4f} round by round)", flush=True)
    print(f"losses identical: {same}")
    report = {"command": " ".join(["python3", *sys.argv]), "git_revision": git_revision(),
              "device": device_name_of(device), "torch_version": torch.__version__, "te_version": te_version(),
              "config_path": args.config, "backend": cfg.fp8.backend, "schedule": cfg.pipeline.schedule,
              "path": args.path, "steps": args.steps, "warmup": args.warmup, "block": args.block,
              "losses_identical": same, "losses": [float(x) for x in losses[base]], "variants": rows}
    if args.out:
        write_json(Path(args.out), report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
