"""SAE files: SAELens's layout, so a fitted SAE loads in SAELens with `SAE.load_from_disk(dir)`.

cfg.json                   architecture ("standard" for relu_l1, "topk"), d_in, d_sae, dtype, device,
                           apply_b_dec_to_input, normalize_activations "none", reshape_activations
                           "hook_z" (SAELens then takes z as [..., n_heads, d_head]; flattened input
                           needs its turn_off_forward_pass_hook_z_reshaping()), and metadata:
                           model_name, hook_name blocks.{L}.attn.hook_z, context_size, headlab's fields
sae_weights.safetensors    W_enc, b_enc, W_dec, b_dec
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .. import vocabulary
from ..errors import HeadlabError
from ..io import atomic_write_bytes
from ..vocabulary import Site
from .base import SparseAutoencoder
from .registry import architectures

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
SAELENS_FORMAT = "6.0.0"
# what headlab's SAEs compute; an SAELens SAE with other settings is refused, not misread
SUPPORTED = {"apply_b_dec_to_input": True, "normalize_activations": "none", "rescale_acts_by_decoder_norm": False}


def hook_name(layer: int) -> str:
    return str(vocabulary.hook_name(Site.z, layer))


def saelens_config(sae: SparseAutoencoder, metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "architecture": sae.saelens_architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "hook_z",
        **sae.saelens_fields(),
        # sae_lens_version: SAELens reads metadata only from configs of its version 6 layout
        "metadata": {
            "sae_lens_version": SAELENS_FORMAT,
            "hook_head_index": None,
            "prepend_bos": True,
            **metadata,
            "headlab_architecture": sae.architecture,
        },
    }


def save_sae(sae: SparseAutoencoder, directory: Path, metadata: dict[str, Any]) -> None:
    """Weights first, then cfg.json: a directory with cfg.json holds a whole SAE."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (WEIGHTS + ".tmp")
    save_file({k: v.detach().float().contiguous() for k, v in sae.state_dict().items()}, str(tmp))
    tmp.replace(directory / WEIGHTS)
    atomic_write_bytes(directory / CFG, json.dumps(saelens_config(sae, metadata), indent=2).encode())


def load_sae(directory: Path) -> tuple[SparseAutoencoder, dict[str, Any]]:
    """An SAE saved by save_sae (or any SAELens standard / topk SAE directory) and its cfg."""
    try:
        cfg = json.loads((directory / CFG).read_text())
        weights = load_file(str(directory / WEIGHTS))
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise HeadlabError(f"corrupt or missing SAE in {directory}: {str(e).splitlines()[0]}") from e
    by_saelens = {cls.saelens_architecture: cls for cls in architectures().values()}
    cls = by_saelens.get(cfg.get("architecture"))
    if cls is None:
        raise HeadlabError(
            f"SAE in {directory}: architecture {cfg.get('architecture')!r} is not one of {', '.join(by_saelens)}"
        )
    for key, value in SUPPORTED.items():
        if cfg.get(key, value) != value:
            raise HeadlabError(f"SAE in {directory}: {key}={cfg[key]!r} is not supported (headlab needs {value!r})")
    extra = {"k": cfg["k"]} if cls.architecture == "topk" else {}
    sae = cls(cfg["d_in"], cfg["d_sae"], **extra)
    try:
        sae.load_state_dict(weights)
    except RuntimeError as e:
        raise HeadlabError(f"SAE in {directory}: weights do not match cfg.json: {str(e).splitlines()[0]}") from e
    return sae.eval(), cfg
