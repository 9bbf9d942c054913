"""Training data: C4-format JSON-lines loader, the bundled Jargon File asset and its BPE tokenizer."""

from __future__ import annotations

from qeffect.data.loader import (
    DataStream,
    PackedDataset,
    iter_records,
    load_datasets,
    resolve_files,
)
from qeffect.data.tokenizer import EOT_TOKEN, bundled_asset, eot_id, load_tokenizer

__all__ = [
    "EOT_TOKEN",
    "DataStream",
    "PackedDataset",
    "bundled_asset",
    "eot_id",
    "iter_records",
    "load_datasets",
    "load_tokenizer",
    "resolve_files",
]
