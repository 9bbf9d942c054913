"""Fresh-process resume through `qeffect train`, bitwise against an uninterrupted run.

For each schedule (Interleaved, ZB-V) and launch (one process; torchrun PP=2 over gloo):
  a) `train --steps 8 --checkpoint-every 3`: the uninterrupted run, saving at steps 3, 6 and 8;
  c) a NEW process `train --steps 8 --resume a/checkpoints/step-00000003 --checkpoint-every 8
     --checkpoint-dir c-checkpoints`.
The step-8 checkpoints of a) and c) must be identical tensor by tensor, bit for bit (parameters, AdamW
state, FP8 amax histories and scales, rolled over: history length 4 < 8 steps), with equal step, epochs,
data position and RNG, and the losses of steps 4..8 in metrics.jsonl must be equal floats. A checkpoint
taken on the way is what a run that stopped there would have saved (the constant learning rate of the
default does not depend on `--steps`); resuming the folder of a run that exited (its `latest`) is
`test_llama_pipeline.py`'s and `test_multinode.py`'s case.

The tiny default configuration: in one process exactly as `qeffect train` runs it (held-out evaluation
included: it must leave training untouched); under torchrun without evaluation and with launch.SMALL_VOCAB
rows (a byte-level tokenizer), to keep CI fast.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import pytest

import launch
from qeffect.checkpoint import CheckpointReport, diff_checkpoints, inspect_checkpoint
from qeffect.cli.app import main


def _command(out: Path, args: list[str], torchrun: bool) -> list[str]:
    train = ["train", "--out", str(out), *args]
    if not torchrun:
        return [sys.executable, "-m", "qeffect", *train]
    return launch.torchrun(2, "-m", "qeffect", *train)


def _run(out: Path, args: list[str], torchrun: bool) -> None:
    """One `qeffect train` to its end (`launch.run`: one thread a process, a taken port relaunched)."""
    proc = launch.run(_command(out, args, torchrun), out.parent)
    assert proc.returncode == 0, f"{out.name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}"


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.parametrize("torchrun", [
    pytest.param(False, id="single-process"),
    pytest.param(True, id="torchrun-pp2", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_fresh_process_resume_is_bitwise_equal(schedule: str, torchrun: bool, tmp_path: Path, capsys,
                                              monkeypatch) -> None:
    common = ["--schedule", schedule]
    if torchrun:
        text = resources.files("qeffect.configs").joinpath("tiny.toml").read_text()
        assert "eval_every = 20" in text
        (tmp_path / "no-eval.toml").write_text(text.replace("eval_every = 20", "eval_every = 0"))
        common += ["--config", str(tmp_path / "no-eval.toml"), *launch.small_train(tmp_path)]
    a, c = tmp_path / "a", tmp_path / "c"
    _run(a, [*common, "--steps", "8", "--checkpoint-every", "3"], torchrun)
    saved = sorted(x.name for x in (a / "checkpoints").iterdir() if x.is_dir())
    assert saved == ["step-00000003", "step-00000006", "step-00000008"]
    assert (a / "checkpoints" / "latest").read_text().strip() == "step-00000008"
    step3 = a / "checkpoints" / "step-00000003"
    c_ck = tmp_path / "c-checkpoints"
    _run(c, [*common, "--steps", "8", "--checkpoint-every", "8", "--checkpoint-dir", str(c_ck), "--resume", str(step3)],
         torchrun)

    ref, resumed = a / "checkpoints" / "step-00000008", c_ck / "step-00000008"
    assert (c_ck / "latest").read_text().strip() == "step-00000008" and not (c / "checkpoints").exists()
    diff = diff_checkpoints(ref, resumed)
    assert diff.identical, diff.model_dump_json(indent=2)[:3000]
    assert diff.tensors_compared > 300 and not diff.only_in_a and not diff.only_in_b
    report = inspect_checkpoint(resumed)
    assert report.step == 8 and set(report.epochs.values()) == {8}
    assert len(report.fp8_modules) == 17 and all(m.history_len == 4 for m in report.fp8_modules)
    assert report.launch == ("torchrun" if torchrun else "single-process")
    assert report.world_size == (2 if torchrun else 1)

    la, lc = _losses(a), _losses(c)
    assert sorted(lc) == [4, 5, 6, 7, 8]  # the resumed run continues the step count
    assert [lc[s] for s in range(4, 9)] == [la[s] for s in range(4, 9)]
    summary = json.loads((c / "summary.json").read_text())
    assert summary["start_step"] == 3 and summary["resumed_from"].endswith("step-00000003")

    # the command line on the tiny default's checkpoint: sizes, FP8 summaries, --json, --diff
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at 80 columns without a terminal
    rc, out = _cli(capsys, "inspect-checkpoint", str(resumed), "--modules", "0")
    assert rc == 0
    for text in ("step 8", "total checkpoint bytes", "qeffect runtime state", "per stage", "FP8 state per module",
                 "s3 head", schedule):
        assert text in out
    rc, out = _cli(capsys, "inspect-checkpoint", str(c_ck), "--json")
    assert rc == 0 and CheckpointReport.model_validate_json(out).qeffect_runtime_state_bytes > 0
    rc, out = _cli(capsys, "inspect-checkpoint", str(ref), "--diff", str(resumed))
    assert rc == 0 and "IDENTICAL" in out
    rc, out = _cli(capsys, "inspect-checkpoint", str(ref), "--diff", str(step3))
    assert rc == 1 and "step: 8 vs 3" in out


def _cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, _ = capsys.readouterr()
    return int(exc.value.code or 0), out
