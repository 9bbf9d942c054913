"""GPT stage chunks built from an FP8 backend."""

from __future__ import annotations

from qeffect.model.gpt import Block, GPTShape, StageChunk, build_chunks

__all__ = ["Block", "GPTShape", "StageChunk", "build_chunks"]
