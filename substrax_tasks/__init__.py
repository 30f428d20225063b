"""substrax-tasks: doit steps that run here, on an SSH host or on a cloud GPU."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
