"""The oracle's comparison, tested for itself: bit patterns, not values, in every dtype the runs compare;
and every category of verify-state can fail, first at the place a wrong bit was put (the oracle check)."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.verify.oracle import ORACLE_ACTIONS, detected, oracle_faults, run_oracle_check
from qeffect.verify.state import (
    CATEGORIES,
    Divergence,
    OracleFault,
    _Tally,
    bits,
    bitwise_equal,
    flip_lowest_bit,
    run_verify_state,
)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16, *FP8)
INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _from_bits(pattern: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` holding exactly these (unsigned) bit patterns."""
    ints, width = INTS[dtype.itemsize], 8 * dtype.itemsize
    if ints is not torch.uint8:  # the signed widths: two's complement
        pattern = [x - (1 << width) if x >= 1 << (width - 1) else x for x in pattern]
    return torch.tensor(pattern, dtype=ints).view(dtype)


# sign bit, a quiet NaN with payload 0 and 1 (e4m3fn has one NaN per sign: S.1111.111), +inf
SIGN = {torch.float64: 1 << 63, torch.float32: 1 << 31, torch.bfloat16: 1 << 15, torch.float16: 1 << 15,
        torch.float8_e4m3fn: 0x80, torch.float8_e5m2: 0x80}
NANS = {torch.float64: (0x7FF8000000000000, 0x7FF8000000000001), torch.float32: (0x7FC00000, 0x7FC00001),
        torch.bfloat16: (0x7FC0, 0x7FC1), torch.float16: (0x7E00, 0x7E01), torch.float8_e4m3fn: (0x7F, 0xFF),
        torch.float8_e5m2: (0x7E, 0x7F)}
INF = {torch.float64: 0x7FF0000000000000, torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00,
       torch.float8_e5m2: 0x7C}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_bits_are_the_tensors_own_bit_patterns(dtype: torch.dtype) -> None:
    t = torch.tensor([0.0, 1.0, -2.5, 0.125], dtype=torch.float32).to(dtype)
    b = bits(t)
    assert b.dtype == INTS[dtype.itemsize] and b.shape == t.shape and not b.dtype.is_floating_point
    assert torch.equal(b.view(dtype).to(torch.float32), t.to(torch.float32))
    assert b[0].item() == 0 and b[1].item() != 0


def test_bits_of_a_non_contiguous_tensor_are_its_elements_bits() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    assert not t.is_contiguous()
    assert torch.equal(bits(t), bits(t.contiguous())) and bits(t).shape == (4, 3)
    assert bitwise_equal(t, t.contiguous())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_signed_zeros_differ(dtype: torch.dtype) -> None:
    pos, neg = _from_bits([0], dtype), _from_bits([SIGN[dtype]], dtype)
    assert torch.equal(pos.to(torch.float32), neg.to(torch.float32))  # equal as values ...
    assert not bitwise_equal(pos, neg) and not bitwise_equal(neg, pos)  # ... not as bits
    assert bitwise_equal(neg, neg.clone()) and bitwise_equal(pos, pos.clone())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nans_compare_by_payload(dtype: torch.dtype) -> None:
    a, b = NANS[dtype]
    nan_a, nan_b = _from_bits([a], dtype), _from_bits([b], dtype)
    assert nan_a.to(torch.float32).isnan().all() and nan_b.to(torch.float32).isnan().all()
    assert bitwise_equal(nan_a, nan_a.clone())  # the same NaN is equal to itself (value equality says no)
    assert not torch.equal(nan_a, nan_a.clone()) or dtype in FP8  # (torch.equal of fp8 compares bytes)
    assert not bitwise_equal(nan_a, nan_b)  # another payload (or sign) is another tensor


@pytest.mark.parametrize("dtype", [d for d in FLOATS if d in INF], ids=str)
def test_infinities(dtype: torch.dtype) -> None:
    pinf, ninf = _from_bits([INF[dtype]], dtype), _from_bits([INF[dtype] | SIGN[dtype]], dtype)
    assert pinf.to(torch.float32).item() == float("inf") and ninf.to(torch.float32).item() == float("-inf")
    assert bitwise_equal(pinf, pinf.clone()) and bitwise_equal(ninf, ninf.clone())
    assert not bitwise_equal(pinf, ninf)
    nan = _from_bits([NANS[dtype][0]], dtype)
    assert not bitwise_equal(pinf, nan)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_one_flipped_bit_anywhere_differs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(5, 7, generator=gen) * 3).to(dtype)
    assert bitwise_equal(t, t.clone())
    width = 8 * dtype.itemsize
    for bit in (0, width // 2, width - 1):  # lowest mantissa bit, a middle one, the sign
        u = bits(t).clone()
        u.view(-1)[17] ^= 1 << bit if bit < width - 1 else -(1 << bit)  # the top bit of a signed width
        assert not bitwise_equal(t, u.view(dtype)), bit


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_flip_lowest_bit_changes_exactly_one_bit(dtype: torch.dtype) -> None:
    t = torch.tensor([[0.0, 1.5], [-3.0, 7.0]]).to(dtype)
    f = flip_lowest_bit(t)
    assert f.dtype == t.dtype and f.shape == t.shape and f.data_ptr() != t.data_ptr()
    assert not bitwise_equal(t, f)
    diff = (bits(t).to(torch.int64) ^ bits(f).to(torch.int64)).view(-1)
    assert diff.tolist() == [1, 0, 0, 0]
    assert bits(t).view(-1)[0].item() == 0  # the input is left alone
    assert bitwise_equal(flip_lowest_bit(f), t)


def test_flip_lowest_bit_of_integers_and_scalars() -> None:
    assert flip_lowest_bit(torch.tensor(4)).item() == 5 and flip_lowest_bit(torch.tensor(4)).shape == ()
    assert flip_lowest_bit(torch.tensor([7, 2], dtype=torch.int32)).tolist() == [6, 2]


def test_dtype_shape_and_value_mismatches() -> None:
    a = torch.tensor([1.0, 2.0])
    assert not bitwise_equal(a, a.to(torch.float64))
    assert not bitwise_equal(a.to(torch.float16), a.to(torch.bfloat16).view(torch.int16).view(torch.float16)
                             .to(torch.bfloat16))
    half, brain = _from_bits([0x3C00], torch.float16), _from_bits([0x3C00], torch.bfloat16)
    assert torch.equal(bits(half), bits(brain)) and not bitwise_equal(half, brain)  # same bits, other dtype
    assert not bitwise_equal(a, a.view(2, 1)) and not bitwise_equal(a, torch.tensor([1.0, 2.0, 3.0]))
    assert not bitwise_equal(a, torch.tensor([1.0, 2.5]))
    assert bitwise_equal(torch.tensor([3, 4]), torch.tensor([3, 4]))
    assert not bitwise_equal(torch.tensor([3, 4]), torch.tensor([3, 5]))
    assert bitwise_equal(torch.tensor([True, False]), torch.tensor([True, False]))
    assert bitwise_equal(torch.empty(0), torch.empty(0)) and not bitwise_equal(torch.empty(0), torch.empty(1))


def test_a_tensor_that_requires_grad_compares_by_its_bits() -> None:
    p = torch.nn.Parameter(torch.tensor([0.0, 1.0]))
    assert bitwise_equal(p, torch.tensor([0.0, 1.0])) and not bitwise_equal(p, torch.tensor([-0.0, 1.0]))


# ------------------------------------------------------------------------------------------- the tally
def test_tally_counts_every_name_and_keeps_the_first_divergence() -> None:
    t = _Tally()
    one, two = torch.tensor([1.0]), torch.tensor([2.0])
    t.compare((0, "F", 1, 0), "activations", {"a": one, "b": one}, {"a": one.clone(), "b": one.clone()})
    assert t.compared["activations"] == 2 and t.mismatches["activations"] == 0 and t.first is None
    t.compare((0, "dI", 1, 0), "fp8_state", {"x": one, "y": two}, {"x": one, "y": one})
    t.compare((1, "dW", 0, 1), "parameter_gradients", {"w": one}, {"w": two})
    assert t.mismatches == {**dict.fromkeys(CATEGORIES, 0), "fp8_state": 1, "parameter_gradients": 1}
    assert t.first == Divergence(step=0, action="dI", stage=1, microbatch=0, category="fp8_state", tensor="y")


@pytest.mark.parametrize("side", ["expected", "found"])
def test_tally_a_tensor_on_one_side_only_is_a_mismatch(side: str) -> None:
    t = _Tally()
    both, extra = {"a": torch.tensor(1)}, {"a": torch.tensor(1), "z": torch.tensor(0)}
    expected, found = (extra, both) if side == "expected" else (both, extra)
    t.compare((2, "commit", None, None), "parameters", expected, found)
    assert t.compared["parameters"] == 2 and t.mismatches["parameters"] == 1
    assert t.first == Divergence(step=2, action="commit", stage=None, microbatch=None, category="parameters",
                                 tensor="z")


def test_tally_signed_zero_is_a_mismatch() -> None:
    t = _Tally()
    t.compare((0, "commit", None, None), "loss", {"step_loss": torch.tensor(0.0)}, {"step_loss": torch.tensor(-0.0)})
    assert t.mismatches["loss"] == 1 and t.first is not None and t.first.tensor == "step_loss"


def test_tally_injects_the_oracle_fault_once_at_its_place() -> None:
    t = _Tally(fault=OracleFault(category="fp8_state", step=1, action="dI"))
    x = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])}
    t.compare((0, "dI", 0, 0), "fp8_state", x, x)  # another step
    t.compare((1, "F", 0, 0), "fp8_state", x, x)  # another action
    t.compare((1, "dI", 0, 0), "activations", x, x)  # another category
    assert t.first is None and t.fault_tensor is None
    t.compare((1, "dI", 0, 0), "fp8_state", x, x)
    assert t.fault_tensor == "a" and t.first is not None and t.first.tensor == "a" and t.mismatches["fp8_state"] == 1
    assert torch.equal(x["a"], torch.tensor([1.0]))  # the caller's tensor is not touched
    t.compare((1, "dI", 0, 1), "fp8_state", x, x)  # once only
    assert t.mismatches["fp8_state"] == 1


def test_tally_fault_skips_empty_tensors_and_names() -> None:
    t = _Tally(fault=OracleFault(category="loss", step=0, action="F"))
    t.compare((0, "F", 0, 0), "loss", {}, {})
    assert t.fault_tensor is None  # nothing to perturb: the next comparison there takes it
    t.compare((0, "F", 0, 1), "loss", {"a": torch.empty(0), "b": torch.tensor(1.0)},
              {"a": torch.empty(0), "b": torch.tensor(1.0)})
    assert t.fault_tensor == "b" and t.first is not None and t.first.microbatch == 1


def test_oracle_fault_names_a_category() -> None:
    with pytest.raises(ValueError, match=r"unknown category 'gradients'"):
        OracleFault(category="gradients", step=0, action="F")


def test_the_oracle_actions_cover_every_category() -> None:
    assert sorted(c for c, _ in ORACLE_ACTIONS) == sorted(CATEGORIES)
    assert {a for _, a in ORACLE_ACTIONS} == {"F", "dI", "dW", "commit"}
    assert [f.step for f in oracle_faults(3)] == [3] * len(CATEGORIES)


def test_detected_requires_a_failed_run_at_the_place() -> None:
    f = OracleFault(category="loss", step=1, action="F")
    here = Divergence(step=1, action="F", stage=1, microbatch=0, category="loss", tensor="output")
    assert detected(f, here, run_passed=False)
    assert not detected(f, here, run_passed=True)
    assert not detected(f, None, run_passed=False)
    for change in ({"step": 0}, {"action": "commit"}, {"category": "activations"}):
        assert not detected(f, here.model_copy(update=change), run_passed=False)


# ---------------------------------------------------------------------------- every category can fail
SMALL = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 2,
                                        "pipeline.microbatches": 2})


@pytest.mark.parametrize(("category", "action"), ORACLE_ACTIONS, ids=[c for c, _ in ORACLE_ACTIONS])
def test_a_flipped_bit_in_each_category_is_the_first_divergence(category: str, action: str) -> None:
    fault = OracleFault(category=category, step=1, action=action)
    report = run_verify_state(SMALL, steps=2, oracle_fault=fault)
    assert not report.passed
    d = report.first_divergence
    assert d is not None and (d.category, d.step, d.action) == (category, 1, action), d
    assert report.oracle_fault == f"{category} at step 1 {action}: {d.tensor}"
    by = {c.category: c.mismatches for c in report.categories}
    assert by[category] == 1 and sum(by.values()) == 1  # the one flipped bit, and nothing else moved


def test_oracle_check_report() -> None:
    faults = [OracleFault(category="parameters", step=1, action="commit"),
              OracleFault(category="parameters", step=1, action="F")]  # F compares no parameters: missed
    report = run_oracle_check(SMALL, steps=2, faults=faults)
    assert [r.passed for r in report.results] == [True, False] and not report.passed
    assert report.results[1].run_passed and report.results[1].first_divergence is None
    assert type(report).model_validate_json(report.model_dump_json()) == report
    with pytest.raises(ValueError, match=r"needs more than 2 steps"):
        run_oracle_check(SMALL, steps=2, faults=[OracleFault(category="loss", step=2, action="F")])
    one = SMALL.with_overrides(**{"pipeline.chunks_per_rank": 1})
    with pytest.raises(ValueError, match=r"at least 2 stages"):
        run_oracle_check(one, steps=2)


def test_cli_oracle_check(capsys, tmp_path) -> None:
    import json

    from qeffect.cli.app import main

    out = tmp_path / "oracle.json"
    with pytest.raises(SystemExit, match=r"^0$"):
        main(["verify-state", "--oracle-check", "--set", "model.vocab_size=256", "--set", "pipeline.microbatches=2",
              "--set", "pipeline.chunks_per_rank=1", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert "10/10 categories caught where perturbed" in stdout and "PASS" in stdout
    report = json.loads(out.read_text())
    assert report["kind"] == "oracle-check" and report["passed"] is True and report["steps"] == 2
    assert sorted(r["category"] for r in report["results"]) == sorted(CATEGORIES)
