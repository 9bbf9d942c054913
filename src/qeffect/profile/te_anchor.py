"""The Transformer Engine anchor: TE's own `make_graphed_callables`, one graphed `TransformerLayer` per layer.

What TE users do today without qeffect (DESIGN.md §8 measured it at 22.1 ms / 43.7 ms per step for
h2048 / h4096): the model's layers as TE `TransformerLayer`s (same hidden, FFN, heads, sequence and
microbatch size, as many layers as the pipeline has), each graphed separately with FP8 delayed
scaling from the run's recipe, params in the activation dtype (TE's usual setup), dropout off. One
step: for each microbatch, forward through all layers inside `te.pytorch.autocast` and backward with
a fixed random output gradient (TE's own CUDA-graph test drives its graphed layers the same way);
then AdamW. No embedding, head or loss, and no pipeline: its floor is the layers-only floor.

Per-layer graphs keep one static input/output set, so microbatch m's backward must run before
microbatch m+1's forward (no 1F1B overlap, which one process cannot use anyway). Transformer Engine
is imported only here and only when the anchor runs.
"""

from __future__ import annotations

import torch

from qeffect.config import RunConfig
from qeffect.fp8.te import make_te_recipe
from qeffect.runtime.build import dtype_of, recipe_of
from qeffect.runtime.phases import SetupClock
from qeffect.runtime.rank import make_optimizer


class TEGraphedLayers:
    """Runner with the interface `matrix.py` times: `data(step)`, `step(data)` and graph counters."""

    def __init__(self, cfg: RunConfig, device: torch.device, *, num_warmup_iters: int = 3) -> None:
        import transformer_engine.pytorch as te

        self.te = te
        mc = cfg.model
        self.cfg, self.device = cfg, device
        self.dtype = dtype_of(cfg)
        self.microbatches = cfg.pipeline.microbatches
        self.layers_count = mc.layers_per_chunk * cfg.pipeline.num_stages
        self.shape = (mc.seq_len, mc.microbatch_size, mc.hidden)  # TE's default sbhd layout
        self.recipe = make_te_recipe(recipe_of(cfg))
        index = device.index if device.index is not None else torch.cuda.current_device()
        clock = SetupClock(device)
        with clock.phase("modules"), torch.random.fork_rng(devices=[index]):
            torch.manual_seed(cfg.train.seed)
            layers = [te.TransformerLayer(mc.hidden, mc.ffn, mc.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                          self_attn_mask_type="causal", fuse_qkv_params=True,
                                          params_dtype=self.dtype, seq_length=mc.seq_len,
                                          micro_batch_size=mc.microbatch_size, device=device)
                      for _ in range(self.layers_count)]
        self.params = [p for layer in layers for p in layer.parameters()]
        with clock.phase("capture"):  # synchronized at both ends: the capture host time is this phase's
            self.graphed = [te.make_graphed_callables(
                layer, (torch.ones(self.shape, device=device, dtype=self.dtype, requires_grad=True),),
                num_warmup_iters=num_warmup_iters, enabled=True, recipe=self.recipe) for layer in layers]
        self.capture_host_seconds = clock.seconds["capture"]
        with clock.phase("optimizer"):
            self.optimizer = make_optimizer(self.params, cfg.optim)
        self.setup_phases = clock.seconds
        self.graph_count = 2 * self.layers_count  # one forward and one backward graph per layer
        self.graphs_per_rank = None
        self.arena_bytes = None
        self.manager = None
        self._replays = 0

    def data(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step)
        return [(torch.randn(self.shape, generator=g).to(self.device, self.dtype),
                 torch.randn(self.shape, generator=g).to(self.device, self.dtype))
                for _ in range(self.microbatches)]

    def step(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        te = self.te
        for x, grad_out in data:
            y = x.requires_grad_()
            with te.autocast(enabled=True, recipe=self.recipe):
                for layer in self.graphed:
                    y = layer(y)
            y.backward(grad_out)
            self._replays += 2 * self.layers_count
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None

    def counters(self) -> tuple[int, int]:
        """(replays, caller/graph handoffs): TE replays on the caller's stream, so no handoffs."""
        return self._replays, 0
