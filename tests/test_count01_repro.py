"""Count01 reproduction mechanics: swaps, keep-one-head, uniform scaling, token weights, end to end."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import counting_cfg
from headlab.analysis.heads import attention_by_token, head_output_norms, mean_head_logits, uniform_scales
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import TaskData
from headlab.tasks.counting import BOS, NOISE, ONE, SEP, ZERO, CountingTask, roc_auc

H, DH = 3, 8


def _toy(seed=0):
    torch.manual_seed(seed)
    model = ToyTransformer(ToyConfig(vocab_size=7, n_ctx=32, n_heads=H, d_model=24, d_head=DH))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model.eval()


def _rows(head):
    return slice(head * DH, (head + 1) * DH)


def _alone(model: ToyTransformer, head: int) -> ToyTransformer:
    """A one-head model holding `head`'s weights of `model` (and everything else it has)."""
    alone = ToyTransformer(ToyConfig(vocab_size=7, n_ctx=32, n_heads=1, d_model=24, d_head=DH)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name in ("q", "k", "v"):
        state[f"blocks.0.attn.{name}.weight"] = state[f"blocks.0.attn.{name}.weight"][_rows(head)]
        state[f"blocks.0.attn.{name}.bias"] = state[f"blocks.0.attn.{name}.bias"][_rows(head)]
    state["blocks.0.attn.o.weight"] = state["blocks.0.attn.o.weight"][:, _rows(head)]
    alone.load_state_dict(state)
    return alone


def _one_hot(n_heads: int) -> ToyTransformer:
    """Zero weights but a one-hot embedding, no norms, no positions: a test sets the rest by hand."""
    model = ToyTransformer(
        ToyConfig(vocab_size=7, n_ctx=32, n_heads=n_heads, d_model=8, d_head=2, pos_emb="none", layer_norm=False)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :7] = torch.eye(7)
    return model


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
    alone = _alone(model, head)
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
    assert quantities.shape == (H, 48, 2 * len(task.token_names)) and [l["head"] for l in labels] == [0, 1, 2]
    # every key up to SEP is BOS, 0, 1, 2 or SEP itself
    assert abs(quantities[..., :5].sum(-1) - 1).max() < 1e-5


def _two_heads() -> ToyTransformer:
    """Two heads on one-hot tokens, no norms, no positions: head 0 attends uniformly (q = k = 0) and
    writes (#1 - #0) / #keys on the 1-vs-0 logit difference; head 1 attends to BOS only (its score 1000
    there, so softmax gives exactly 1) and its OV circuit writes twice head 0's."""
    model = _one_hot(2)
    attn = model.blocks[0].attn
    with torch.no_grad():
        model.unembed.weight[:, :7] = torch.eye(7)
        attn.q.bias[2] = 1.0
        attn.k.weight[2, BOS] = 1000 * 2**0.5  # times the 1/sqrt(d_head) scaling: 1000
        for head, scale in ((0, 1.0), (1, 2.0)):
            attn.v.weight[2 * head, ONE] = attn.v.weight[2 * head + 1, ZERO] = scale
            attn.o.weight[ONE, 2 * head] = attn.o.weight[ZERO, 2 * head + 1] = 1.0
    return model.eval()


def test_pattern_ov_matrix_on_a_hand_built_model(setup):
    task, data = setup
    model = hooked_toy(_two_heads(), "two")
    # M[p, o]: head o's OV circuit on head p's pattern, head o alone
    cells = [(p, o) for p in range(2) for o in range(2)]
    ivs = [
        Intervention("keep_head", "zero", 0, o) if p == o else Intervention("pattern_from", "zero", 0, o, other_head=p)
        for p, o in cells
    ]
    got = execute(model, task, data, ivs).numpy()
    ids, sep = data.inputs["input_ids"], data.positions[:, 0]
    keys = (sep + 1).float()  # BOS, the string and SEP itself
    ones = ((ids == ONE) & (torch.arange(ids.shape[1]) < sep[:, None])).sum(1).float()
    zeros = ((ids == ZERO) & (torch.arange(ids.shape[1]) < sep[:, None])).sum(1).float()
    for k, (p, o) in enumerate(cells):
        # uniform pattern: the OV head's scale times the share of 1s minus the share of 0s; BOS: nothing
        expected = (1.0 + o) * (ones - zeros) / keys if p == 0 else torch.zeros(data.n)
        torch.testing.assert_close(torch.from_numpy(got[k, :, 2]), expected, atol=1e-6, rtol=0)
    auc = roc_auc(got[:, :, 2], data.answers["label"].numpy())
    # performance follows the pattern head p, not the OV head o: M = [[1, 1], [0.5, 0.5]]
    assert auc.tolist() == [1.0, 1.0, 0.5, 0.5]


def test_mean_head_logits_is_the_mean_of_one_head_models(setup):
    task, data = setup
    model = _toy()
    total = 0
    for head in range(H):
        alone = _alone(model, head)
        with torch.no_grad():
            logits = alone(data.inputs["input_ids"])
        total = total + logits[torch.arange(data.n)[:, None], data.positions]
    expected = task.per_prompt(total / H, data)
    hooked = hooked_toy(model, "toy")
    torch.testing.assert_close(mean_head_logits(hooked, task, data, 0), expected, atol=1e-5, rtol=0)
    # with the final LayerNorm, the mean of logits is not every head's output scaled by 1/H
    third = execute(hooked, task, data, [Intervention("scale_heads", "uniform", 0, scale=(1 / H,) * H)])[0]
    assert (third[:, 2] - expected[:, 2]).abs().max() > 1e-3


def test_attention_per_occurrence_on_a_hand_counted_prompt():
    """Head 0 scores each 1 log 2 above every other key: from SEP of BOS 1 1 0 2 1 SEP the weights are
    2 on each 1 and 1 elsewhere, 10 in all."""
    model = _one_hot(1)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q.bias[0] = 1.0
        attn.k.weight[0, ONE] = torch.log(torch.tensor(2.0)) * 2**0.5
    ids = torch.tensor([[BOS, ONE, ONE, ZERO, NOISE, ONE, SEP, ONE]])
    data = TaskData(inputs={"input_ids": ids}, positions=torch.tensor([[6, 7]]), answers={"label": torch.tensor([1])})
    names = {ZERO: "0", ONE: "1", NOISE: "2", SEP: "sep", BOS: "bos"}
    quantities, _ = attention_by_token(hooked_toy(model.eval(), "one"), data, names)
    summed, per_one = quantities[0, 0, :5], quantities[0, 0, 5:]
    assert summed == pytest.approx([0.1, 0.6, 0.1, 0.1, 0.1], abs=1e-6)  # 0, 1, 2, sep, bos
    assert per_one == pytest.approx([0.1, 0.2, 0.1, 0.1, 0.1], abs=1e-6)


def test_quick_reproduction_end_to_end(tmp_path):
    from headlab.reproduce import run_all

    # shorter than --quick: the test checks the pipeline, the README's quick numbers come from --quick itself
    smaller = ("train.steps=200", "task.n_prompts=64", "output.n_boot=30")
    result = run_all("count01", tmp_path, quick=True, extra=smaller, log=lambda m: None)
    names = {p.split("/")[-1] for p in result["figures"]}
    kinds = ("single_heads", "aggregation", "value_swaps", "pattern_ov", "token_weights")
    assert names == {f"fig_{k}_{obj}.png" for k in kinds for obj in ("all", "decision")}
    numbers = result["numbers"]
    for obj in ("all", "decision"):
        assert 0 <= numbers[obj]["frac_heads_alone_roc_auc_ge_0.9_zero"] <= 1
        assert 0 <= numbers[obj]["frac_heads_alone_label_acc_ge_0.9_zero"] <= 1
        assert -1 <= numbers[obj]["pattern_ov_roc_auc_spearman_with_pattern_head_alone"] <= 1
        assert 0 <= numbers[obj]["mean_logits_eos_acc"] <= 1 and 0 <= numbers[obj]["mean_attn_per_1"] <= 1
        assert 0 <= numbers[obj]["uniform_norm_at_eos_eos_acc"] <= 1 and numbers[obj]["mean_noise_ratio"] > 0
        assert numbers[obj]["head_norm_max_over_min_at_eos"] >= 1
        assert numbers[obj]["value_swap_roc_auc_n_entries"] == 2 + 12  # the 2- and 4-head models' pairs
        said = numbers[obj]["verdicts"]
        assert all(v["verdict"].split(" (")[0] in ("agrees", "partly", "does not agree") for v in said.values())
    assert set(json.loads((tmp_path / "reproduce" / "count01-quick" / "numbers.json").read_text())) == set(numbers)
    logs = []
    run_all("count01", tmp_path, quick=True, extra=smaller, log=logs.append)  # everything is done: only redrawn
    assert logs and all("skip (done)" in line for line in logs)
