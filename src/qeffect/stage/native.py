"""The native eager reference: the same chunk modules, full autograd backward per microbatch.

This is the oracle every qeffect mode is compared with (docs/design.md §7). It uses no contracts: plain
autograd, gradients accumulated by autograd into `.grad` in backward order. Interleaved 1F1B runs each
stage's backward in ascending microbatch order, so `.grad` is summed m = 0, 1, ..., M-1 — the same fixed
order the gradient arena uses. With fused accumulation on Transformer Engine the wgrad GEMM accumulates
into the weight's `main_grad` instead (autograd gets no weight gradient), and `.grad` is that buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NativeStage:
    chunk: torch.nn.Module

    def __post_init__(self) -> None:
        self.chunk.set_delay_wgrad(False)
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # fused accumulation: each weight's fp32 gradient buffer, written by its wgrad GEMM (overwritten on
        # microbatch 0, added into after), kept across steps like Megatron-LM's gradient buffer
        fused = [lin for lin in self.chunk.matrix_linears().values() if getattr(lin, "needs_main_grad", False)]
        for lin in fused:
            lin.bind_main_grad(torch.zeros_like(lin.weight, dtype=torch.float32))
        self._main_grads = [lin.weight for lin in fused]

    @property
    def stage(self) -> int:
        return self.chunk.stage

    def forward(self, m: int, inp: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = inp.detach()
        if x.is_floating_point():
            x.requires_grad_(True)
        with torch.enable_grad():
            out = self.chunk(x, is_first_microbatch=(m == 0), targets=targets)
        self._saved[m] = (x, out)
        return out.detach()

    def backward(self, m: int, grad_output: torch.Tensor) -> torch.Tensor | None:
        x, out = self._saved.pop(m)
        torch.autograd.backward(out, grad_output)
        for w in self._main_grads:  # the optimizer, clipping and reductions read `.grad`
            w.grad = w.main_grad
        return x.grad if x.requires_grad else None

    @property
    def live(self) -> int:
        return len(self._saved)
