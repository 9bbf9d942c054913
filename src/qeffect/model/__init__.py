"""Model stage chunks built from an FP8 backend: the GPT and the Llama family (docs/models.md)."""

from __future__ import annotations

from qeffect.model.gpt import Block, GPTShape, StageChunk, build_chunks
from qeffect.model.llama import LlamaBlock

__all__ = ["Block", "GPTShape", "LlamaBlock", "StageChunk", "build_chunks"]
