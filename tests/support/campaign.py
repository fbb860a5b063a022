"""``fuzz/campaign.py`` loaded once as a module (it is a script, not a package), shared by
the campaign and crash-point tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["campaign"]

ROOT = Path(__file__).resolve().parents[2]


def _load_campaign() -> ModuleType:
    name = "kvlog_campaign"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "fuzz" / "campaign.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


campaign = _load_campaign()
