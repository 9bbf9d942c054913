"""qeffect: explicit, checked runtime contracts for FP8 pipeline-parallel training under CUDA graphs."""

__version__ = "0.1.0"
