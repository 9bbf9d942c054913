"""The TE anchors of a llama run (`qeffect profile`'s te-graphed*): TE `TransformerLayer`s with the same Llama
settings. The settings are checked on the CPU; building and stepping them needs CUDA and Transformer Engine.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qeffect.config import load_config
from qeffect.fp8.te import te_available
from qeffect.profile.te_anchor import te_layer_family

ROOT = Path(__file__).resolve().parents[1]
LLAMA_TINY = ROOT / "examples/configs/llama-tiny.toml"
requires_te = pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                 reason="needs CUDA and Transformer Engine")


def test_te_layer_settings_follow_the_family() -> None:
    assert te_layer_family(load_config()) == {}  # the GPT keeps TE's defaults: LayerNorm, GELU, biases
    cfg = load_config(ROOT / "examples/configs/llama-h2048.toml")
    assert te_layer_family(cfg) == {"normalization": "RMSNorm", "layernorm_epsilon": 1e-5,
                                    "activation": "swiglu", "num_gqa_groups": 4, "bias": False}


def _cuda_llama(**overrides: object):
    return load_config(LLAMA_TINY).with_overrides(**{"fp8.backend": "te", "train.device": "cuda",
                                                     "train.dtype": "bfloat16", **overrides})


@pytest.mark.gpu
@requires_te
def test_llama_anchor_layers_are_te_transformer_layers_with_the_llama_settings() -> None:
    from qeffect.profile.te_anchor import TEGraphedLayers

    cfg = _cuda_llama()
    anchor = TEGraphedLayers(cfg, torch.device("cuda"))
    rope = anchor.layer_kwargs["rotary_pos_emb"]
    head_dim = cfg.model.hidden // cfg.model.heads
    assert tuple(rope.shape) == (cfg.model.seq_len, 1, 1, head_dim) and rope.dtype == torch.float32
    names = dict(zip(anchor.param_names, anchor.params, strict=True))
    assert not any(n.endswith(".bias") or "layer_norm_bias" in n for n in names)  # no biases anywhere
    qkv = [p for n, p in names.items() if n.startswith("layer0.") and "qkv" in n and p.dim() == 2]
    width = (cfg.model.heads + 2 * cfg.model.kv_heads) * head_dim
    assert [tuple(p.shape) for p in qkv] == [(width, cfg.model.hidden)]
    fc1 = [p for n, p in names.items() if n.startswith("layer0.") and "fc1_weight" in n]
    assert [tuple(p.shape) for p in fc1] == [(2 * cfg.model.ffn, cfg.model.hidden)]  # SwiGLU: gate and up
    anchor.step(anchor.data(0))


@pytest.mark.gpu
@requires_te
def test_llama_whole_model_anchor_is_the_runs_model_in_size() -> None:
    """te-graphed-model for a llama run holds as many fp32 parameters as the run's model (token table, no
    position table, layers, final RMSNorm, head), and its first loss is about ln(vocabulary)."""
    from qeffect.profile.te_anchor import TEGraphedModel
    from qeffect.runtime.build import build_chunks_for

    cfg = _cuda_llama(**{"train.dtype": "float32"})
    device = torch.device("cuda")
    ours = sum(p.numel() for c in build_chunks_for(cfg, device).values() for p in c.parameters())
    anchor = TEGraphedModel(cfg, device)
    assert "pos_emb" not in anchor.ends
    assert sum(p.numel() for p in anchor.params) == ours
    loss = float(anchor.step(anchor.data(0)))
    assert abs(loss - math.log(cfg.model.vocab_size)) < 0.5, loss
