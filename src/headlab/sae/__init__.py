"""Sparse autoencoders on attention-layer outputs (Kissane et al., arXiv 2406.17759).

One file per architecture behind one interface (base.py): relu_l1.py, topk.py, each declaring its class as
`SAE`; registry.py finds them, maps sae.architecture to its class and builds one. Around them: activations.py
(corpus, streaming z from HeadSites), fit.py (the fitting loop), metrics.py (L0, MSE, explained variance, dead
latents, CE loss recovered), head_attribution.py (features to heads and source positions, top contexts),
export.py (SAELens's file layout). `headlab sae` runs one study with them: headlab.studies.sae.
"""

from __future__ import annotations

from .registry import architectures, build_sae

__all__ = ["architectures", "build_sae"]
