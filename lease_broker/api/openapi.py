"""The OpenAPI document of the broker API: the contract between the two halves."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("openapi.json")


@functools.lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    return json.loads(PATH.read_text())
