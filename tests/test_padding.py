"""A prompt gives the same numbers in a padded batch as alone, for every sweep, every patching kind and
site, and attribution, on GPT-2-, NeoX- and Llama-shaped models (right padding with an attention mask;
each prompt reads and is edited at its own positions; means never include padding)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from headlab.interventions import plan
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.tasks import from_records
from test_prompts import PAIR, _load

SWEEPS = [
    ("heads", "zero"),
    ("heads", "mean"),
    ("heads", "resample"),
    ("layers", "mean"),
    ("keep_heads", "zero"),
    ("components", "mean"),
    ("pattern_swaps", "zero"),
    ("value_swaps", "zero"),
]
PATCHES = [
    PatchConfig(kinds=["activation"], sites=["z", "pattern", "q", "k", "v"], positions=["all", "END"]),
    PatchConfig(kinds=["attribution"], sites=["z", "v"], positions=["all", "END"]),
    PatchConfig(kinds=["path"], receivers=["logits"]),
    PatchConfig(kinds=["path"], receivers=["2.1", "2.3"], receiver_site="k"),
]


def _plans(model) -> list:
    ivs = []
    for sweep, method in SWEEPS:
        cfg = OmegaConf.create(
            {"ablate": {"sweep": sweep, "method": method}, "patch": OmegaConf.structured(PatchConfig())}
        )
        ivs += plan(cfg, model.n_layers, model.n_heads)
    for patch in PATCHES:
        cfg = OmegaConf.create({"ablate": {"sweep": "none", "method": "zero"}, "patch": OmegaConf.structured(patch)})
        ivs += plan(cfg, model.n_layers, model.n_heads)[1:]
    return ivs


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
def test_every_intervention_gives_a_prompt_the_same_numbers_padded_as_alone(family, tiny_hf_dir, gpt2_tokenizer):
    model = _load(tiny_hf_dir, gpt2_tokenizer, family)
    # each prompt its own group: a group's mean (and resample draw) is then the same in the batch and alone
    records = [{**r, "group": str(i)} for i, r in enumerate(PAIR)]
    task = from_records(records)
    batch = task.build(0, seed=0, model=model)
    assert batch.inputs["attention_mask"].sum(1).unique().numel() == 2  # two lengths: one is padded
    ivs = _plans(model)
    kinds = {(iv.intervention, iv.method, iv.site) for iv in ivs}
    assert {("path_patch", "path", None), ("patch_head", "attribution", "v"), ("pattern_from", "zero", None)} <= kinds
    together = execute(model, task, batch, ivs, seed=0)
    for i, record in enumerate(records):
        one = from_records([{**record, "group": "0"}])
        alone = execute(model, one, one.build(0, seed=0, model=model), ivs, seed=0)
        torch.testing.assert_close(together[:, i, :3], alone[:, 0, :3], atol=1e-5, rtol=0, equal_nan=True)
    assert (together[1:, :, 0] - together[0, :, 0]).abs().max() > 1e-4  # the interventions do something
