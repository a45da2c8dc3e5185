"""Count01 reproduction mechanics: swaps, keep-one-head, uniform scaling, token weights, end to end."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import counting_cfg
from headlab.analysis.heads import attention_by_token, head_output_norms, uniform_scales
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks.counting import CountingTask

H, DH = 3, 8


def _toy(seed=0):
    torch.manual_seed(seed)
    model = ToyTransformer(ToyConfig(vocab_size=7, n_ctx=32, n_heads=H, d_model=24, d_head=DH))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model.eval()


def _rows(head):
    return slice(head * DH, (head + 1) * DH)


@pytest.fixture(scope="module")
def setup():
    task = CountingTask(counting_cfg())
    return task, task.build(48, seed=5)


def test_pattern_swap_between_identical_heads_changes_nothing(setup):
    task, data = setup
    model = _toy()
    attn = model.blocks[0].attn
    with torch.no_grad():
        for proj in (attn.q, attn.k):  # head 0 computes the same pattern as head 1
            proj.weight[_rows(0)] = proj.weight[_rows(1)]
            proj.bias[_rows(0)] = proj.bias[_rows(1)]
    hooked = hooked_toy(model, "toy")
    got = execute(
        hooked,
        task,
        data,
        [
            CLEAN,
            Intervention("pattern_from", "swap", 0, 0, other_head=1),
            Intervention("pattern_from", "swap", 0, 2, other_head=1),
        ],
    )
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=0)
    assert (got[2] - got[0]).abs().max() > 1e-3


def test_value_swap_equals_a_model_whose_head_has_the_other_heads_value_weights(setup):
    task, data = setup
    model = _toy()
    swapped = _toy()
    with torch.no_grad():
        swapped.blocks[0].attn.v.weight[_rows(0)] = swapped.blocks[0].attn.v.weight[_rows(2)]
        swapped.blocks[0].attn.v.bias[_rows(0)] = swapped.blocks[0].attn.v.bias[_rows(2)]
    got = execute(hooked_toy(model, "toy"), task, data, [Intervention("values_from", "swap", 0, 0, other_head=2)])
    expected = execute(hooked_toy(swapped, "toy"), task, data, [CLEAN])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", range(H))
def test_head_alone_equals_a_one_head_model_built_from_its_weights(setup, head):
    task, data = setup
    model = _toy()
    torch.manual_seed(1)
    alone = ToyTransformer(ToyConfig(vocab_size=7, n_ctx=32, n_heads=1, d_model=24, d_head=DH)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name in ("q", "k", "v"):
        state[f"blocks.0.attn.{name}.weight"] = state[f"blocks.0.attn.{name}.weight"][_rows(head)]
        state[f"blocks.0.attn.{name}.bias"] = state[f"blocks.0.attn.{name}.bias"][_rows(head)]
    state["blocks.0.attn.o.weight"] = state["blocks.0.attn.o.weight"][:, _rows(head)]
    alone.load_state_dict(state)
    got = execute(hooked_toy(model, "toy"), task, data, [Intervention("keep_head", "zero", 0, head)])
    expected = execute(hooked_toy(alone, "toy"), task, data, [CLEAN])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_scaling_heads(setup):
    task, data = setup
    hooked = hooked_toy(_toy(), "toy")
    one_hot = tuple(float(h == 1) for h in range(H))
    got = execute(
        hooked,
        task,
        data,
        [
            CLEAN,
            Intervention("scale_heads", "uniform", 0, scale=(1.0,) * H),
            Intervention("scale_heads", "uniform", 0, scale=one_hot),
            Intervention("keep_head", "zero", 0, 1),
        ],
    )
    torch.testing.assert_close(got[1], got[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[2], got[3], atol=1e-6, rtol=0)
    # at one position only: scaling every head by 0 there is ablating the layer there
    sep = int(data.positions[0, 0])
    same_len = data.positions[:, 0] == sep
    at_pos = execute(
        hooked,
        task,
        data,
        [
            Intervention("scale_heads", "uniform", 0, position=sep, scale=(0.0,) * H),
            Intervention("ablate_layer", "zero", 0, position=sep),
        ],
    )
    torch.testing.assert_close(at_pos[0], at_pos[1], atol=1e-6, rtol=0)
    assert (at_pos[0, same_len] - got[0, same_len]).abs().max() > 1e-3
    norms = head_output_norms(hooked, data)[0]
    scaled = norms * torch.tensor(uniform_scales({0: norms})[0])
    torch.testing.assert_close(scaled, torch.full((H,), norms.mean().item()))


def test_attention_by_token_sums_to_one_at_sep(setup):
    task, data = setup
    quantities, labels = attention_by_token(hooked_toy(_toy(), "toy"), data, task.token_names)
    assert quantities.shape == (H, 48, len(task.token_names)) and [l["head"] for l in labels] == [0, 1, 2]
    # every key up to SEP is BOS, 0, 1, 2 or SEP itself
    assert abs(quantities.sum(-1) - 1).max() < 1e-5


def test_quick_reproduction_end_to_end(tmp_path):
    from headlab.reproduce import run_all

    result = run_all("count01", tmp_path, quick=True, log=lambda m: None)
    names = {p.split("/")[-1] for p in result["figures"]}
    assert names == {"fig_single_heads.png", "fig_aggregation.png", "fig_swaps.png", "fig_token_weights.png"}
    numbers = result["numbers"]
    assert 0 <= numbers["frac_heads_alone_label_acc_ge_0.9_zero"] <= 1
    assert set(json.loads((tmp_path / "reproduce" / "count01-quick" / "numbers.json").read_text())) == set(numbers)
    logs = []
    run_all("count01", tmp_path, quick=True, log=logs.append)  # everything is done: only redrawn
    assert logs and all("skip (done)" in line for line in logs)
