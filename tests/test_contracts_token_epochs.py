"""Effect token ledger and weight-cache epochs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qeffect.contracts import (
    CacheEpochViolation,
    EffectLedger,
    EffectToken,
    EffectTokenViolation,
    EpochClock,
    InvocationKey,
    WeightCacheVersion,
)


def test_ledger_chain_is_device_side():
    led = EffectLedger("stage0", "cpu")
    t0 = led.current
    assert t0.seq == 0 and t0.ledger == "stage0" and led.seq == 0
    assert t0.value.dim() == 0 and t0.value.dtype == torch.int64 and t0.value.device.type == "cpu"
    t1 = led.consume(t0, "F m=0")
    t2 = led.consume(t1, "dI m=0")
    assert led.current is t2 and (t1.seq, t2.seq) == (1, 2)
    assert int(t2.value) == 2 and int(t0.value) == 0  # the old value is not mutated in place
    assert t2.value is not t1.value
    assert led.history == [(0, "F m=0"), (1, "dI m=0")]
    assert "value" not in repr(t2)


def test_stale_foreign_and_forged_tokens_preserve_state():
    led, other = EffectLedger("a"), EffectLedger("b")
    t0 = led.current
    t1 = led.consume(t0, "F")
    before = led.snapshot()
    with pytest.raises(EffectTokenViolation, match="stale token") as ei:
        led.consume(t0, "F again")
    assert (ei.value.expected, ei.value.found) == (1, 0)
    assert "expected seq 1, found 0" in str(ei.value)
    with pytest.raises(EffectTokenViolation, match="foreign token"):
        led.consume(other.current, "F")
    forged = EffectToken(t1.value.clone(), t1.seq, "a")
    with pytest.raises(EffectTokenViolation, match="forged token"):
        led.consume(forged, "F")
    with pytest.raises(EffectTokenViolation, match="not an effect token"):
        led.consume(1, "F")  # type: ignore[arg-type]
    assert led.snapshot() == before and led.current is t1


def test_history_is_bounded():
    led = EffectLedger("h", history=3)
    for i in range(5):
        led.consume(led.current, f"a{i}")
    assert led.history == [(2, "a2"), (3, "a3"), (4, "a4")] and led.seq == 5


def test_contracts_never_initialize_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CUDA initialization attempted")

    monkeypatch.setattr(torch.cuda, "_lazy_init", boom)
    led = EffectLedger("cpu-only")
    led.consume(led.current, "F")
    from qeffect.verify.faults import run_faults

    assert run_faults().passed


def test_import_in_fresh_process_does_not_touch_cuda():
    code = ("import torch, qeffect.contracts as c; l = c.EffectLedger('x'); l.consume(l.current, 'F');"
            "c.GradientArena({'w': ((2,), torch.float32)}, 2);"
            "import sys; sys.exit(1 if torch.cuda.is_initialized() else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_cache_epoch_refresh_and_verify():
    clock, cache = EpochClock(), WeightCacheVersion("q")
    assert cache.e_C is None and clock.e_W == 0
    with pytest.raises(CacheEpochViolation, match="stale weight cache") as ei:
        cache.check_forward(clock, first_microbatch=False)  # fresh cache is invalid
    assert (ei.value.expected, ei.value.found) == (0, None) and cache.e_C is None
    assert cache.check_forward(clock, True) is True and cache.e_C == 0
    assert cache.check_forward(clock, False) is False
    clock.advance()
    k = InvocationKey(1, 0, 3)
    with pytest.raises(CacheEpochViolation,
                       match=r"stale weight cache for cache 'q' at K\(e=1,s=0,m=3,u=0,i=0\): expected e_C "
                             r"== e_W = 1, found e_C = 0") as ei:
        cache.check_forward(clock, False, key=k)
    msg = str(ei.value)
    assert "expected e_C == e_W = 1, found e_C = 0" in msg and str(k) in msg and ei.value.key == k
    assert cache.e_C == 0  # check first, mutate only when valid
    assert cache.check_forward(clock, True) is True and cache.e_C == 1
    assert cache.check_forward(clock, False) is False
    cache.invalidate()
    assert cache.e_C is None and cache.snapshot() == ("cache", "q", None)
    with pytest.raises(CacheEpochViolation,
                       match=r"stale weight cache for cache 'q': expected e_C == e_W = 1, found e_C = None"):
        cache.check_forward(clock, False)


def test_clock():
    c = EpochClock()
    assert c.advance() == 1 and c.e_W == 1 and c.snapshot() == ("clock", 1)
    c.restore(7)
    assert c.e_W == 7
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=r"epoch must be an int >= 0"):
            c.restore(bad)  # type: ignore[arg-type]
