"""Hugging Face ``config.json``: its field classes, schema, and per-family readers and writers.

Call path: ``torch_bridge._config`` sorts a config's fields (``_fields``: used, harmless,
refused, unknown), checks their types (``_schema``) and reads it with the family's
reader (``_readers``, through ``torch_bridge._archs``); writing goes the other way
(``_writers``), both sharing the rope and layer-type helpers of ``_common``. ``_kept``
keeps the fields a conversion carries over unchanged (generation settings, names, ids).
"""

from torch_bridge.hf._fields import classify, report_unknown
from torch_bridge.hf._kept import check_kept, kept_fields
from torch_bridge.hf._schema import check_types, hf_name, hf_names, read_config_json

__all__ = [
    "check_kept",
    "check_types",
    "classify",
    "hf_name",
    "hf_names",
    "kept_fields",
    "read_config_json",
    "report_unknown",
]
