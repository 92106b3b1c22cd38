"""Errors a user can cause. Each carries one line that names the problem.

The CLI turns any :class:`MokgenError` into ``error: <message>`` on stderr and exit code 2; the
Python API raises them as they are. Input errors of the PyTorch ops are also ``ValueError`` /
``TypeError`` so ordinary ``except`` clauses catch them.
"""

from __future__ import annotations


class MokgenError(Exception):
    """Base class: something the user can fix. ``str(err)`` is a single line."""

    def __init__(self, message: str):
        # Keep every message to one line: multi-line details (nvcc output) go to logs.
        super().__init__(" ".join(str(message).split("\n")).strip())


class SpecError(MokgenError):
    """A spec file or name is malformed, inconsistent or unknown."""


class PlanError(MokgenError):
    """A valid spec cannot be planned for the requested target (EP degree, numerics, ...)."""


class ToolchainError(MokgenError):
    """nvcc, the CUDA toolkit or the CUTLASS headers are missing or unusable."""


class BuildError(MokgenError):
    """nvcc rejected a generated source; the message names the file and the log."""


class LoadError(MokgenError):
    """A compiled artifact is missing, stale or cannot be loaded."""


class InputError(MokgenError, ValueError):
    """A tensor handed to a mokgen op has the wrong dtype, shape, device, layout or values."""


class KernelError(MokgenError, RuntimeError):
    """A launched kernel reported a failure (CUDA error, timeout)."""
