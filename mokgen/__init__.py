"""mokgen: a code-generation compiler for expert-parallel Mixture-of-Experts layers.

Pipeline (one module per stage): spec -> plan -> render -> build -> load -> ops; reference is
the pure-PyTorch oracle; cli is the command line. Importing ``mokgen`` does not import torch:
the PyTorch-facing names below load on first use.
"""

from mokgen._version import __version__
from mokgen.errors import MokgenError
from mokgen.spec import MoESpec, bundled_specs, load_spec

_LAZY = {
    "experts_forward": "mokgen.ops",
    "MoEExperts": "mokgen.ep",
    "MoELayer": "mokgen.ep",
    "virtual_ep_forward": "mokgen.ep",
    "Router": "mokgen.router",
    "MoEBlock": "mokgen.block",
    "route": "mokgen.router",
    "reference": "mokgen.reference",
}

__all__ = ["__version__", "MokgenError", "MoESpec", "bundled_specs", "load_spec", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        return module if name == "reference" else getattr(module, name)
    raise AttributeError(f"module 'mokgen' has no attribute {name!r}")
