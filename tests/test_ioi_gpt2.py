"""IOI on the real GPT-2 small, when a local copy is given (HEADLAB_GPT2_DIR); skipped otherwise.

Numbers from Wang et al. 2022: mean logit difference 3.56 over the IOI distribution, and the name
movers 9.9, 9.6 and 10.0 as the heads whose direct path to the logits carries the answer.
"""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.hf import load_hf
from headlab.tasks.ioi import IOIConfig, IOITask

GPT2_DIR = os.environ.get("HEADLAB_GPT2_DIR")
pytestmark = pytest.mark.skipif(not GPT2_DIR, reason="HEADLAB_GPT2_DIR (a local GPT-2 small directory) is not set")


@pytest.fixture(scope="module")
def gpt2():
    return load_hf(GPT2_DIR, need_tokenizer=True)


def test_mean_logit_difference_is_the_papers(gpt2):
    task = IOITask(OmegaConf.structured(IOIConfig))
    data = task.build(500, seed=0, model=gpt2)
    clean = execute(gpt2, task, data, [CLEAN])[0]
    assert abs(float(clean[:, 0].mean()) - 3.56) <= 0.3


def test_name_movers_lead_the_direct_effect_on_the_logit_difference(gpt2):
    task = IOITask(OmegaConf.structured(IOIConfig))
    data = task.build(100, seed=0, model=gpt2)
    senders = [Intervention("path_patch", "path", l, h, receivers="logits") for l in range(12) for h in range(12)]
    got = execute(gpt2, task, data, [CLEAN] + senders)
    effect = (got[1:, :, 0].mean(1) - got[0, :, 0].mean()).view(12, 12)
    most_negative = [f"{int(i) // 12}.{int(i) % 12}" for i in effect.flatten().argsort()[:6]]
    assert {"9.9", "9.6", "10.0"} <= set(most_negative), most_negative
