"""Models: HF causal LMs by name or path, toy transformers, and the HeadSites they expose."""

from __future__ import annotations

from .hooked import HookedModel, Trace
from .loading import load
from .sites import HeadSites, headlab_attention

__all__ = ["HookedModel", "HeadSites", "Trace", "headlab_attention", "load"]
