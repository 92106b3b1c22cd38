"""Where mokgen's own data lives: templates/ and model_specs/.

In a checkout (or an editable install) they sit at the top of the repository, beside mokgen/;
in a wheel they travel inside the package as mokgen/templates and mokgen/model_specs
(pyproject.toml maps them). This module is the only place that knows both layouts.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _first_existing(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"mokgen installation is incomplete: no {name}/ beside {_PKG}")


@lru_cache(maxsize=None)
def templates_dir() -> Path:
    return _first_existing("templates")


@lru_cache(maxsize=None)
def specs_dir() -> Path:
    return _first_existing("model_specs")
