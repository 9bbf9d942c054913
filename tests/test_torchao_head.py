"""`fp8.head = "torchao"`: torchao's dynamic Float8Linear as the last chunk's output head.

CPU: refused in one line (exit 2) without torchao or with dimensions torchao cannot run; the head is
classified as a non-matrix module (stand-in when torchao is missing); torchao is imported lazily; with
torchao installed, qeffect eager is bitwise equal to native eager. GPU: eager and captured-direct.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from qeffect.cli.app import main
from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.fp8 import torchao_head as ao
from qeffect.fp8.base import is_backend_linear
from qeffect.runtime.build import build_chunks_for
from qeffect.verify.state import run_verify_state

HAS_TORCHAO = ao.torchao_available()
requires_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao (the torchao extra)")


def _tiny(**overrides: object):
    return load_config().with_overrides(**{"fp8.head": "torchao", **overrides})


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return int(exc.value.code or 0), capsys.readouterr().err


@pytest.fixture
def no_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import torchao` fail here, whether or not it is installed."""
    for mod in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, mod, None)


class StandInHead(nn.Linear):
    """A stateless linear standing in for torchao's head on machines without torchao."""

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return super().forward(x)


@pytest.fixture(params=["stand-in", pytest.param("torchao", marks=requires_torchao)])
def head_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "stand-in":
        monkeypatch.setattr(ao, "require_torchao", lambda: None)
        monkeypatch.setattr(ao, "torchao_head", lambda i, o, *, device=None: StandInHead(i, o, bias=False,
                                                                                         device=device))
    return request.param


# ------------------------------------------------------------------------------------------ CPU
def test_missing_torchao_is_a_user_error(no_torchao) -> None:
    assert not ao.torchao_available()
    with pytest.raises(UserError) as err:
        build_chunks_for(_tiny(), "cpu")
    assert str(err.value) == ao.TORCHAO_MISSING_MSG
    assert 'fp8.head = "torchao"' in ao.TORCHAO_MISSING_MSG and "qeffect[torchao]" in ao.TORCHAO_MISSING_MSG
    with pytest.raises(UserError):
        ao.torchao_head(64, 128)


def test_missing_torchao_cli_one_line_exit_2(no_torchao, capsys, tmp_path: Path) -> None:
    toml = tmp_path / "ao.toml"
    toml.write_text('[fp8]\nhead = "torchao"\n')
    for argv in (["verify-state", "--config", str(toml), "--steps", "1"],
                 ["verify-state", "--head", "torchao", "--steps", "1"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2
        assert err.strip() == f"qeffect: error: {ao.TORCHAO_MISSING_MSG}"


@pytest.mark.parametrize("overrides, needle", [
    ({"model.hidden": 72}, "model.hidden = 72"),
    ({"model.vocab_size": 1000}, "model.vocab_size = 1000"),
    ({"model.seq_len": 33}, "model.microbatch_size * model.seq_len = 66"),
])
def test_dimensions_not_multiple_of_16_are_refused(capsys, tmp_path: Path, overrides: dict, needle: str) -> None:
    with pytest.raises(UserError, match='fp8.head = "torchao" needs multiples of 16') as err:
        build_chunks_for(_tiny(**overrides), "cpu")
    assert needle in str(err.value)
    assert build_chunks_for(load_config().with_overrides(**overrides), "cpu")  # the backend head takes them
    (key, value), = overrides.items()
    section, field = key.split(".")
    toml = tmp_path / "bad.toml"
    toml.write_text(f'[{section}]\n{field} = {value}\n[fp8]\nhead = "torchao"\n')
    rc, err_line = _cli(capsys, "verify-state", "--config", str(toml), "--steps", "1")
    assert rc == 2 and len(err_line.strip().splitlines()) == 1 and needle in err_line


def test_default_head_does_not_import_torchao() -> None:
    code = ("import sys; from qeffect.config import load_config; from qeffect.runtime.build import build_chunks_for;"
            " build_chunks_for(load_config(), 'cpu'); print(any(m.startswith('torchao') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_head_is_refused() -> None:
    from qeffect.fp8 import DelayedScalingRecipe, get_backend
    from qeffect.model import GPTShape, build_chunks

    with pytest.raises(ValueError, match="unknown head"):
        build_chunks(GPTShape.from_config(load_config()), get_backend("reference", DelayedScalingRecipe()),
                     seed=0, head="bogus")


def test_head_is_a_nonmatrix_parameter_with_the_same_init(head_kind: str) -> None:
    chunks = build_chunks_for(_tiny(), "cpu")
    ref = build_chunks_for(load_config(), "cpu")
    last, ref_last = chunks[max(chunks)], ref[max(ref)]
    assert not is_backend_linear(last.head) and is_backend_linear(ref_last.head)
    assert "head" not in last.matrix_linears() and "head" in ref_last.matrix_linears()
    assert "head.weight" in last.nonmatrix_params() and "head.weight" not in last.matrix_params()
    assert not any(k.startswith("head.") for k in last.fp8_state())  # stateless: nothing to checkpoint
    assert any(k.startswith("head.") for k in ref_last.fp8_state())
    assert set(last.matrix_linears()) == set(ref_last.matrix_linears()) - {"head"}
    # same parameter names, same bits: the init does not depend on the head
    for c, r in zip(chunks.values(), ref.values(), strict=True):
        pa, pb = dict(c.named_parameters()), dict(r.named_parameters())
        assert list(pa) == list(pb)
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
    if head_kind == "torchao":
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_linear import Float8Linear

        assert isinstance(last.head, Float8Linear) and last.head.bias is None
        cast = last.head.config.cast_config_weight
        assert (cast.scaling_type, cast.scaling_granularity) == (ScalingType.DYNAMIC, ScalingGranularity.TENSORWISE)
        assert list(last.head.buffers()) == []


def test_split_path_with_a_stateless_head_is_bitwise_equal(monkeypatch) -> None:
    """The split actions (head weight gradient in dI) against native eager, on machines without torchao."""
    monkeypatch.setattr(ao, "require_torchao", lambda: None)
    monkeypatch.setattr(ao, "torchao_head",
                        lambda i, o, *, device=None: StandInHead(i, o, bias=False, device=device))
    report = run_verify_state(_tiny(), steps=2)
    assert report.passed, report.first_divergence
    assert all(c.compared > 0 for c in report.categories)


@requires_torchao
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_verify_state_torchao_head_cpu(schedule: str) -> None:
    report = run_verify_state(_tiny(**{"pipeline.schedule": schedule}), steps=3)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)
    backend_head = run_verify_state(load_config().with_overrides(**{"pipeline.schedule": schedule}), steps=1)
    assert report.losses[0] != backend_head.losses[0]  # the torchao head really ran


# ------------------------------------------------------------------------------------------ GPU
requires_cuda_torchao = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TORCHAO),
                                           reason="needs CUDA and torchao")


@pytest.mark.gpu
@requires_cuda_torchao
@pytest.mark.parametrize("path", ["eager", "captured-direct"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_verify_state_torchao_head_cuda(schedule: str, path: str) -> None:
    cfg = _tiny(**{"pipeline.schedule": schedule, "train.device": "cuda"})
    report = run_verify_state(cfg, steps=3, path=path)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)


@pytest.mark.gpu
@requires_cuda_torchao
def test_verify_state_torchao_head_cuda_bf16_captured() -> None:
    cfg = _tiny(**{"train.device": "cuda", "train.dtype": "bfloat16"})
    report = run_verify_state(cfg, steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 for c in report.categories)
