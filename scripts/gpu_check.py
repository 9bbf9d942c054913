"""The whole GPU verification in one process (one device call): every backend x schedule x path.

    source .gpu-kit/setup.sh && python3 scripts/gpu_check.py --config examples/configs/h2048.toml \
        --steps 20 --out $OUT

`--head torchao` overrides `fp8.head` (torchao's dynamic Float8Linear as the output head); runs with a
head other than the backend's are named with it as a suffix (verify-reference-zbv-eager-torchao).

Writes one JSON per run under OUT/reports/ and a merged OUT/gpu-check.json with the command, git
revision, device and versions; prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from qeffect.config import load_config
from qeffect.graphs.handshake import git_revision
from qeffect.verify.state import run_verify_state


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backends", default="reference,te")
    ap.add_argument("--schedules", default="interleaved,zbv")
    ap.add_argument("--paths", default="eager,captured-copy,captured-direct")
    ap.add_argument("--capture-steps", type=int, default=0, help="also run `capture` for this many steps")
    ap.add_argument("--head", choices=("backend", "torchao"), default=None,
                    help="override fp8.head (default: the config's)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    (out / "reports").mkdir(parents=True, exist_ok=True)
    # The device copy of the tree has no .git: pass QEFFECT_GIT_REVISION=<rev> in the command there.
    rev = git_revision()
    merged = {"command": " ".join(sys.argv), "git_revision": rev or "unknown",
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "reports": {}, "errors": {}}
    ok = True
    try:  # say why, up front, if Transformer Engine does not import here
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        print("transformer_engine.pytorch does not import:\n" + traceback.format_exc()[-2500:], flush=True)
    head = a.head or load_config(a.config).fp8.head
    suffix = "" if head == "backend" else f"-{head}"
    merged["head"] = head
    if head == "torchao":
        try:  # the same for torchao
            import torchao.float8  # noqa: F401
        except Exception:
            print("torchao.float8 does not import:\n" + traceback.format_exc()[-2500:], flush=True)
    for backend in a.backends.split(","):
        for sched in a.schedules.split(","):
            for path in a.paths.split(","):
                name = f"verify-{backend}-{sched}-{path}{suffix}"
                cfg = load_config(a.config).with_overrides(**{"fp8.backend": backend, "pipeline.schedule": sched,
                                                               "train.device": "cuda", "fp8.head": head})
                t0 = time.perf_counter()
                try:
                    r = run_verify_state(cfg, steps=a.steps, path=path)
                except Exception as err:  # report and go on: one failing mode must not hide the others
                    merged["errors"][name] = traceback.format_exc()[-4000:]
                    print(f"{name}: ERROR {type(err).__name__}: {err}", flush=True)
                    ok = False
                    torch.cuda.empty_cache()
                    continue
                report = {**json.loads(r.model_dump_json()), "head": head}  # VerifyReport has no head field
                (out / "reports" / f"{name}.json").write_text(json.dumps(report, indent=1))
                merged["reports"][name] = report
                mism = {c.category: c.mismatches for c in r.categories if c.mismatches}
                g = r.graphs or {}
                print(f"{name}: passed={r.passed} mismatches={mism or 0} first={r.first_divergence} "
                      f"graphs/rank={g.get('graphs_per_rank')} growth/step={g.get('persistent_growth_bytes_per_step')} "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
                ok &= r.passed
                del r
                torch.cuda.empty_cache()
    if a.capture_steps:
        from qeffect.profile.capture import run_capture

        for backend in a.backends.split(","):
            cfg = load_config(a.config).with_overrides(**{"fp8.backend": backend, "train.device": "cuda",
                                                           "fp8.head": head})
            name = f"capture-{backend}-{cfg.pipeline.schedule}-captured-direct{suffix}"
            try:
                r = run_capture(cfg, path="captured-direct", steps=a.capture_steps)
            except Exception as err:
                merged["errors"][name] = traceback.format_exc()[-4000:]
                print(f"{name}: ERROR {type(err).__name__}: {err}", flush=True)
                ok = False
                continue
            merged["reports"][name] = {**json.loads(r.model_dump_json()), "head": head}
            print(f"{name}: passed={r.passed} graphs/rank={r.graphs_per_rank} (expected {r.expected_graphs_per_rank}) "
                  f"growth/step={r.persistent_growth_bytes_per_step} capture_host={r.capture_host_seconds:.2f}s "
                  f"step={r.median_step_seconds * 1e3:.2f}ms", flush=True)
            ok &= r.passed
            torch.cuda.empty_cache()
    (out / "gpu-check.json").write_text(json.dumps(merged, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
