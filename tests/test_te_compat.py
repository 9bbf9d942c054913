"""`fp8.te_compat`: the one module that reaches private names of Transformer Engine and torch.

CPU only: the supported-TE check (with faked versions), the pyproject range, the fallback counter, the
moved TE lookups on stand-ins, and a scan of src/qeffect that fails when another module reaches a
private torch or TE name.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import torch

from qeffect.errors import UserError
from qeffect.fp8 import te_compat

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "qeffect"
ROOTS = ("torch", "transformer_engine", "transformer_engine_torch")
# Reading a closure's variables is how TE's wgrad arguments are found: te_compat's business only.
CLOSURE_NAMES = frozenset({"__closure__", "cell_contents", "co_freevars"})

# Private torch names in modules this change could not edit (other owners): to move into te_compat
# (schedule/ sits below fp8 in the layers, so its import stays where it is). An entry that is gone
# fails the test too, so the list only shrinks.
KNOWN: dict[str, set[str]] = {
    # below fp8 in the layers, so it cannot import te_compat: a torch-version fallback of the adapter
    "schedule/adapter.py": {"from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None when the root is not a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_uses(source: str) -> set[str]:
    """Private torch/TE names `source` reaches: private imports, attribute chains from a torch/TE
    import (reported at their first private part), `getattr` with a private name on one, and TE's
    private names that te_compat owns (attributes, strings, method overrides) or closure reads."""
    tree = ast.parse(source)
    found: set[str] = set()
    aliases = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    if any(_private(p) for p in a.name.split(".")):
                        found.add(f"import {a.name}")
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and (node.module or "").split(".")[0] in ROOTS:
            for a in node.names:
                if any(_private(p) for p in [*node.module.split("."), a.name]):
                    found.add(f"from {node.module} import {a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def resolved(expr: ast.expr) -> list[str] | None:
        parts = _chain(expr)
        if parts is None or parts[0] not in aliases:
            return None
        return [*aliases[parts[0]].split("."), *parts[1:]]

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            full = resolved(node)
            if full and _private(full[-1]) and not any(_private(p) for p in full[:-1]):
                found.add(".".join(full))
            if node.attr in te_compat.TE_PRIVATE_NAMES or node.attr in CLOSURE_NAMES:
                found.add(f".{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 \
                and node.func.id in ("getattr", "hasattr", "setattr") \
                and isinstance(node.args[1], ast.Constant):
            full = resolved(node.args[0])
            name = node.args[1].value
            if full and isinstance(name, str) and _private(name) and not any(_private(p) for p in full):
                found.add(".".join([*full, name]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value in te_compat.TE_PRIVATE_NAMES or node.value in CLOSURE_NAMES):
            found.add(repr(node.value))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.name in te_compat.TE_PRIVATE_NAMES:
            found.add(f"def {node.name}")
    return found


# ------------------------------------------------------------------------------------ the scan
def test_scan_finds_each_kind_of_private_use() -> None:
    src = """
import torch
import torch._dynamo
import transformer_engine.pytorch as te
from torch.optim.optimizer import _get_scalar_dtype
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M
x = torch._scaled_mm
y = torch.cuda._sleep
z = torch._C._foo
w = te.module._private
v = M._state
u = getattr(torch._C, "_raw", None)
s = getattr(torch.cuda, "_lazy", None)
t = ws._scale_inv
k = f.__closure__
def _get_weight_and_bias_tensors(self): ...
name = "_LinearBackward"
ok = torch.__version__, torch.cuda.is_available(), self._mine, te.Linear
"""
    assert private_uses(src) == {
        "import torch._dynamo", "from torch.optim.optimizer import _get_scalar_dtype", "torch._scaled_mm",
        "torch.cuda._sleep", "torch._C", "transformer_engine.pytorch.module._private",
        "transformer_engine.pytorch.quantization.FP8GlobalStateManager._state", "torch.cuda._lazy",
        "._scale_inv", ".__closure__", "def _get_weight_and_bias_tensors", "'_LinearBackward'",
    }


def test_te_compat_holds_the_private_uses() -> None:
    """The scan sees te_compat's own private uses (so it would see them anywhere else)."""
    found = private_uses((SRC / "fp8" / "te_compat.py").read_text())
    assert {"torch._scaled_mm", "torch._fused_adamw_", "torch.optim.AdamW._init_group", "._fp8_workspaces",
            "'__closure__'", ".co_freevars", "'_LinearBackward'"} <= found


def test_no_private_torch_or_te_use_outside_te_compat() -> None:
    stray, seen = [], {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "fp8/te_compat.py":
            continue
        found = private_uses(path.read_text())
        seen[rel] = found
        extra = found - KNOWN.get(rel, set())
        stray += [f"{rel}: {name}" for name in sorted(extra)]
    assert not stray, "private torch/TE names outside fp8/te_compat.py (move them there): " + "; ".join(stray)
    gone = [f"{rel}: {name}" for rel, names in KNOWN.items() for name in names - seen.get(rel, set())]
    assert not gone, "no longer used, drop from KNOWN: " + "; ".join(gone)


# ------------------------------------------------------------------------------ supported range
def test_pyproject_te_extra_matches_the_constant() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["te"] == [f"transformer-engine[pytorch]{te_compat.TE_SUPPORTED}"]


@pytest.mark.parametrize(("version", "ok"), [
    ("2.20.0", True), ("2.20.2", True), ("2.20.2+cu13", True), ("2.20.0.dev0+abc", True),
    ("2.19.9", False), ("2.21.0", False), ("2.2", False), ("3.0.0", False), ("unknown", False),
])
def test_version_range(version: str, ok: bool) -> None:
    assert te_compat.te_version_supported(version) is ok


def test_bad_range_clause_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unsupported version clause '~=2\.20'"):
        te_compat.te_version_supported("2.20.2", "~=2.20")


def test_unsupported_te_is_a_one_line_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te_compat, "installed_te_version", lambda: "2.20.2")
    te_compat.check_te_version()  # the tested release passes
    monkeypatch.setattr(te_compat, "installed_te_version", lambda: "2.19.1")
    with pytest.raises(UserError, match=r"^Transformer Engine 2\.19\.1 is installed; the te backend supports "
                                        r"transformer-engine>=2\.20,<2\.21 \(the tested releases\)") as err:
        te_compat.check_te_version()
    assert "\n" not in str(err.value)


def test_te_backend_selection_checks_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """`require_te` (TEBackend, the profile's input check) refuses an importable but untested TE."""
    import qeffect.fp8.te as te_mod

    monkeypatch.setattr(te_mod, "te_import_error", lambda: None)  # as if TE imported
    monkeypatch.setattr(te_compat, "installed_te_version", lambda: "2.21.0")
    with pytest.raises(UserError, match=r"Transformer Engine 2\.21\.0 is installed"):
        te_mod.require_te()


def test_cli_prints_the_version_error_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import qeffect.fp8.te as te_mod
    from qeffect.cli.app import main

    monkeypatch.setattr(te_mod, "te_import_error", lambda: None)
    monkeypatch.setattr(te_compat, "installed_te_version", lambda: "2.19.0")
    with pytest.raises(SystemExit, match="^2$"):
        main(["profile", "--backend", "te", "--device", "cpu", "--steps", "1", "--warmup", "1"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Transformer Engine 2.19.0 is installed" in err


# ---------------------------------------------------------------------------------- fallbacks
def test_fallback_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te_compat, "_FALLBACKS", {})
    assert te_compat.fallbacks() == {}
    te_compat.count_fallback("te.wgrad_closure_lookup")
    te_compat.count_fallback("te.wgrad_closure_lookup")
    te_compat.count_fallback("te.wgrad_staging_copy")
    got = te_compat.fallbacks()
    assert got == {"te.wgrad_closure_lookup": 2, "te.wgrad_staging_copy": 1}
    got["x"] = 1  # a copy: the counter is untouched
    assert "x" not in te_compat.fallbacks()
    te_compat.reset_fallbacks()
    assert te_compat.fallbacks() == {}


def test_profile_report_carries_and_warns_about_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_report` copies the counter into `te_fallbacks`; `qeffect profile` prints one warning line."""
    from io import StringIO

    from rich.console import Console

    from qeffect.cli.profile import render
    from qeffect.config import load_config
    from qeffect.profile.flops import count_matrix_flops, floor_of
    from qeffect.profile.matrix import make_report

    cfg = load_config(None)
    flops = count_matrix_flops(cfg)

    def report_text() -> tuple[dict[str, int], str]:
        r = make_report(cfg, torch.device("cpu"), command="qeffect profile", config_path=None, steps=1,
                        warmup=1, flops=flops, gemm=[], floor=floor_of([], flops), results=[])
        out = StringIO()
        render(r, Console(file=out, width=250))
        return r.te_fallbacks, out.getvalue()

    monkeypatch.setattr(te_compat, "_FALLBACKS", {})
    counts, text = report_text()
    assert counts == {} and "warning: Transformer Engine" not in text
    for _ in range(3):
        te_compat.count_fallback("te.wgrad_closure_lookup")
    counts, text = report_text()
    assert counts == {"te.wgrad_closure_lookup": 3}
    assert "warning: Transformer Engine internals not as expected" in text
    assert "te.wgrad_closure_lookup x3" in text


# ------------------------------------------------------------------------- moved TE lookups
def test_linear_backward_node_search() -> None:
    class Node:
        def __init__(self, *nxt: object) -> None:
            self.next_functions = [(n, 0) for n in nxt]

    linear_bw = type(te_compat.LINEAR_BACKWARD_NODE, (Node,), {})
    target = linear_bw()
    assert te_compat.linear_backward_node(None) is None
    assert te_compat.linear_backward_node(target) is target
    assert te_compat.linear_backward_node(Node(None, Node(target))) is target  # under two view nodes
    with pytest.raises(RuntimeError, match="no TE _LinearBackward node behind Node"):
        te_compat.linear_backward_node(Node(Node(Node(Node(target)))))  # deeper than 4


def test_float8_accessors_and_bias_stand_in() -> None:
    from types import SimpleNamespace

    ws = type("Float8Tensor", (), {})()
    ws._data, ws._scale_inv = torch.zeros(2), torch.ones(1)
    assert te_compat.is_float8_tensor(ws) and not te_compat.is_float8_tensor(SimpleNamespace())
    assert te_compat.float8_data(ws) is ws._data and te_compat.float8_scale_inv(ws) is ws._scale_inv
    assert te_compat.float8_transpose(ws) is None and te_compat.float8_transpose_invalid(ws) is False
    assert te_compat.float8_data(None) is None
    assert te_compat.weight_workspace(SimpleNamespace(_fp8_workspaces={"weight": ws})) is ws

    class Base:  # TE Linear's accessor, as the forward calls it
        def __init__(self, bias: object) -> None:
            self.bias = bias

        def _get_weight_and_bias_tensors(self) -> tuple[object, object]:
            return "w", self.bias

    class Sub(Base):
        pass

    te_compat.bias_stand_in(Sub, "stand_in")
    m = Sub("b")
    assert m._get_weight_and_bias_tensors() == ("w", "b")  # not set yet
    m.stand_in = "b16"
    assert m._get_weight_and_bias_tensors() == ("w", "b16")
    none = Sub(None)
    none.stand_in = "b16"
    assert none._get_weight_and_bias_tensors() == ("w", None)  # no bias: none handed to TE
    assert Base("b")._get_weight_and_bias_tensors() == ("w", "b")


def test_torch_ops_are_torchs_own() -> None:
    """Plain re-exports, the very callables: no extra call layer, the same bits."""
    assert te_compat.scaled_mm is torch._scaled_mm and te_compat.fused_adamw_ is torch._fused_adamw_
    assert te_compat.foreach_pow is torch._foreach_pow and te_compat.foreach_zero_ is torch._foreach_zero_
    assert te_compat.adamw_init_group is torch.optim.AdamW._init_group
    assert te_compat.scalar_dtype(is_fused=True) == torch.float32
