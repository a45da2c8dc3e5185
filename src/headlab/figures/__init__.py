"""Figures drawn from result tables (never from live tensors); `FIGURES` names the figure sets."""

from __future__ import annotations

from .registry import FIGURES, Draw

__all__ = ["FIGURES", "Draw"]
