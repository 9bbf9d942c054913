"""Training data: C4-format JSON-lines loader, prepared (memory-mapped) token folders, the bundled Jargon
File asset and its BPE tokenizer.

Names are imported on first use (PEP 562): ``qeffect.data.plan`` and ``qeffect.data.prepared`` stay free
of torch, so ``qeffect train`` checks its data before importing the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qeffect.data.loader import DataStream, PackedDataset, load_datasets, load_plan
    from qeffect.data.plan import DataPlan, plan_data, plan_from_config
    from qeffect.data.prepared import PreparedDataset, PreparedFolder
    from qeffect.data.records import iter_records, resolve_files
    from qeffect.data.tokenizer import EOT_TOKEN, bundled_asset, eot_id, load_tokenizer, resolve_eot

_WHERE = {
    "DataStream": "loader", "PackedDataset": "loader", "load_datasets": "loader", "load_plan": "loader",
    "DataPlan": "plan", "plan_data": "plan", "plan_from_config": "plan",
    "PreparedDataset": "prepared", "PreparedFolder": "prepared",
    "iter_records": "records", "resolve_files": "records",
    "EOT_TOKEN": "tokenizer", "bundled_asset": "tokenizer", "eot_id": "tokenizer", "load_tokenizer": "tokenizer",
    "resolve_eot": "tokenizer",
}

__all__ = [
    "EOT_TOKEN",
    "DataPlan",
    "DataStream",
    "PackedDataset",
    "PreparedDataset",
    "PreparedFolder",
    "bundled_asset",
    "eot_id",
    "iter_records",
    "load_datasets",
    "load_plan",
    "load_tokenizer",
    "plan_data",
    "plan_from_config",
    "resolve_eot",
    "resolve_files",
]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'qeffect.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qeffect.data.{_WHERE[name]}"), name)
