"""Count01 quantities the claims read, each against a computation written here: head-output norms and
equal norms at y (where [EOS] is decided), noise_ratio, the value-swap matrix, and the verdicts' rules."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import counting_cfg
from headlab import results
from headlab.api import sweep
from headlab.figures.count01 import aggregation_frame, aggregation_numbers, head_norm_spread
from headlab.figures.count01_claims import CLAIMS, verdicts
from headlab.figures.count01_swaps import swap_numbers, value_swap_matrix
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.studies.context import EVAL_SEED_OFFSET
from headlab.tasks.counting import BOS, NOISE, ONE, ZERO, CountingTask, roc_auc

H, DH, N = 3, 8, 48


def _toy() -> ToyTransformer:
    torch.manual_seed(0)
    model = ToyTransformer(ToyConfig(vocab_size=7, n_ctx=32, n_heads=H, d_model=24, d_head=DH))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model.eval()


def _by_hand(model: ToyTransformer, ids: torch.Tensor, scale_at: torch.Tensor | None = None, factors=None):
    """Logits and each head's term z_h W_O^h [n, pos, head, d_model] of the plain module, read off the
    input of W_O; with scale_at [n], each head's z times its factor at that position of each prompt."""
    o = model.blocks[0].attn.o
    seen = {}

    def hook(_module, args):
        z = args[0].view(*args[0].shape[:2], H, DH).clone()
        if scale_at is not None:
            rows = torch.arange(z.shape[0])
            z[rows, scale_at] = z[rows, scale_at] * torch.tensor(factors, dtype=z.dtype)[:, None]
        seen["z"] = z
        return (z.flatten(2),)

    handle = o.register_forward_pre_hook(hook)
    with torch.no_grad():
        logits = model(ids)
    handle.remove()
    w_o = o.weight.detach().view(-1, H, DH)  # [d_model, head, d_head]
    return logits, torch.einsum("nphd,mhd->nphm", seen["z"], w_o)


def test_counting_names_its_read_positions_sep_and_y():
    data = CountingTask(counting_cfg()).build(16, seed=1)
    assert data.read_roles() == ["SEP", "Y"]
    ids = data.inputs["input_ids"]
    rows = torch.arange(16)
    assert (ids[rows, data.token_positions["SEP"]] == 3).all()  # the SEP token
    assert (ids[rows, data.token_positions["Y"]] == data.answers["label"]).all()  # y, the answer symbol


@pytest.fixture(scope="module")
def uniform():
    """The uniform sweep's table on _toy() and the task it ran."""
    task = CountingTask(counting_cfg(n_prompts=N))
    return task, sweep(hooked_toy(_toy(), "toy"), task, ablate="uniform", n_boot=10)


def test_the_uniform_sweep_equalises_head_norms_at_y_like_a_hand_scaled_model(uniform):
    (task, table), model = uniform, _toy()
    data = task.build(N, seed=EVAL_SEED_OFFSET)
    ids, rows = data.inputs["input_ids"], torch.arange(N)
    clean_logits, terms = _by_hand(model, ids)
    sep, y = data.positions[:, 0], data.positions[:, 1]
    norms = {"SEP": terms[rows, sep].norm(dim=-1).mean(0), "Y": terms[rows, y].norm(dim=-1).mean(0)}
    # the table's output norms are the hand-computed ones, at SEP and at y (which differ)
    got = table[table["method"] == "output_norm"].set_index(["metric", "head"])["value"]
    for role, expected in norms.items():
        assert got[f"output_norm_{role}"].sort_index().to_numpy() == pytest.approx(expected.numpy(), rel=1e-4)
    assert got["output_norm"].sort_index().to_numpy() == pytest.approx(norms["SEP"].numpy(), rel=1e-4)
    assert (norms["SEP"] - norms["Y"]).abs().max() > 0.05  # two positions, two sets of norms
    # scaled at y by the factors of y's norms: every head's mean norm there is the heads' mean; SEP untouched
    factors = (norms["Y"].mean() / norms["Y"]).tolist()
    logits, scaled = _by_hand(model, ids, y, factors)
    at_y = scaled[rows, y].norm(dim=-1).mean(0)
    assert at_y.numpy() == pytest.approx(np.full(H, norms["Y"].mean().item()), rel=1e-5)
    torch.testing.assert_close(scaled[rows, sep], terms[rows, sep])
    quantities = task.per_prompt(logits[rows[:, None], data.positions], data)
    expected = {"label_acc": quantities[:, 0].mean(), "eos_acc": quantities[:, 1].mean()}
    row = table[(table["intervention"] == "scale_heads") & (table["token"] == "Y")].set_index("metric")["value"]
    assert row["eos_acc"] == pytest.approx(float(expected["eos_acc"]))
    assert row["label_acc"] == pytest.approx(float(expected["label_acc"]))
    # the sweep's own intervention at Y equals the hand-scaled model prompt by prompt
    hooked = hooked_toy(model, "toy")
    by_engine = execute(
        hooked, task, data, [CLEAN, Intervention("scale_heads", "uniform", 0, token="Y", scale=factors)]
    )
    torch.testing.assert_close(by_engine[1], quantities, atol=1e-5, rtol=0)
    torch.testing.assert_close(by_engine[1, :, 2], by_engine[0, :, 2])  # the label margin at SEP: unchanged


def test_head_norm_spread_and_the_eos_aggregation_read_the_table_rows(uniform):
    (task, table), model = uniform, _toy()
    data = task.build(N, seed=EVAL_SEED_OFFSET)
    _, terms = _by_hand(model, data.inputs["input_ids"])
    at_y = terms[torch.arange(N), data.positions[:, 1]].norm(dim=-1).mean(0)
    df = table.assign(experiment="count01_aggregation", n_heads=H, objective="all")
    spread = head_norm_spread(df)
    assert spread["output_norm_Y"].iloc[0] == pytest.approx((at_y.max() / at_y.min()).item(), rel=1e-4)
    single = pd.DataFrame(columns=["n_heads", "seed", "head", "method", *("roc_auc", "label_acc", "eos_acc")])
    numbers = aggregation_numbers(aggregation_frame(df, single), spread)
    eos_row = table[(table["token"] == "Y") & (table["metric"] == "eos_acc")]["value"].iloc[0]
    assert numbers["uniform_norm_at_eos_eos_acc"] == pytest.approx(eos_row)
    clean = table[(table["intervention"] == "none") & (table["metric"] == "eos_acc")]["value"].iloc[0]
    assert numbers["learned_eos_acc"] == pytest.approx(clean)


def _noise_head() -> ToyTransformer:
    """One head on one-hot tokens: from every query it scores a 1 log 2 and a 2 -log 2 above a 0, so on
    each prompt one 2 weighs a quarter of one 1 and half of one 0."""
    model = ToyTransformer(
        ToyConfig(vocab_size=7, n_ctx=32, n_heads=1, d_model=8, d_head=2, pos_emb="none", layer_norm=False)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :7] = torch.eye(7)
        attn = model.blocks[0].attn
        attn.q.bias[0] = 1.0
        attn.k.weight[0, ONE] = math.log(2) * 2**0.5  # times the 1/sqrt(d_head) scaling: log 2
        attn.k.weight[0, NOISE] = -math.log(2) * 2**0.5
    return model.eval()


def test_noise_ratio_is_the_weight_on_one_2_over_one_1_per_prompt():
    task = CountingTask(counting_cfg(n_prompts=N))
    table = sweep(hooked_toy(_noise_head(), "one"), task, ablate="none", attention_by_token=True, n_boot=10)
    got = table[table["method"] == "attention"].set_index("metric")["value"]
    assert got["noise_ratio"] == pytest.approx(0.25, abs=1e-6)
    assert got["noise_ratio_to_0"] == pytest.approx(0.5, abs=1e-6)


def _three_heads() -> ToyTransformer:
    """Three heads on one-hot tokens: heads 0 and 2 attend uniformly (q = k = 0), head 1 to BOS only; each
    head's values write (#1 - #0) / #keys on the 1-vs-0 logit difference, scaled by 1, 2, 3."""
    model = ToyTransformer(
        ToyConfig(vocab_size=7, n_ctx=32, n_heads=3, d_model=8, d_head=2, pos_emb="none", layer_norm=False)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :7] = torch.eye(7)
        model.unembed.weight[:, :7] = torch.eye(7)
        attn = model.blocks[0].attn
        attn.q.bias[2] = 1.0
        attn.k.weight[2, BOS] = 1000 * 2**0.5
        for head in range(3):
            attn.v.weight[2 * head, ONE] = attn.v.weight[2 * head + 1, ZERO] = head + 1.0
            attn.o.weight[ONE, 2 * head] = attn.o.weight[ZERO, 2 * head + 1] = 1.0
    return model.eval()


def test_the_value_swap_matrix_follows_the_pattern_head_on_a_hand_built_model():
    task = CountingTask(counting_cfg())
    data = task.build(N, seed=5)
    hooked = hooked_toy(_three_heads(), "three")
    cells = [(j, i) for j in range(3) for i in range(3)]
    ivs = [
        Intervention("keep_head", "zero", 0, i) if i == j else Intervention("values_from", "zero", 0, i, other_head=j)
        for j, i in cells
    ]
    quantities = execute(hooked, task, data, ivs).numpy()
    auc = roc_auc(quantities[:, :, 2], data.answers["label"].numpy())
    # by hand: a head on the uniform pattern separates the classes whatever values it carries, on BOS never
    assert auc.tolist() == [1.0, 0.5, 1.0] * 3
    rows = [iv.row() for iv in ivs]
    table = results.tidy({"experiment": "count01_value_swaps", "model": "m", "task": "counting", "seed": 0}, rows,
                         quantities, task.quantities, data.answers_np(), task.aggregates, n_boot=10)  # fmt: skip
    df = table.assign(n_heads=3)
    m = value_swap_matrix(df, 3, 0)
    np.testing.assert_allclose(m, np.array(auc).reshape(3, 3))
    numbers, shown = swap_numbers(df, "count01_value_swaps", "value_swap")
    assert shown == (3, 0) and numbers["value_swap_roc_auc_n_entries"] == 6
    assert numbers["value_swap_roc_auc_mean_abs_diff_to_pattern_head_alone"] == 0.0
    # the values head alone: heads 0/2 alone 1, head 1 alone 0.5; entries with a values head of the other
    # kind differ by 0.5: (j=1, i=0), (j=1, i=2), (j=0, i=1), (j=2, i=1) of 6
    assert numbers["value_swap_roc_auc_mean_abs_diff_to_values_head_alone"] == pytest.approx(4 * 0.5 / 6)
    assert numbers["value_swap_roc_auc_pearson_with_pattern_head_alone"] == pytest.approx(1.0)
    assert verdicts(numbers)["pattern_over_values"]["verdict"].startswith("agrees")


@pytest.mark.parametrize(
    "eos_at_y, label_at_sep, word",
    [(0.6, 1.0, "agrees"), (0.99, 1.0, "does not agree"), (0.6, 0.8, "partly"), (math.nan, 1.0, "no data")],
)
def test_the_syntax_verdict_follows_its_written_rule(eos_at_y, label_at_sep, word):
    numbers = {
        "learned_eos_acc": 1.0,
        "learned_label_acc": 1.0,
        "uniform_norm_at_eos_eos_acc": eos_at_y,
        "uniform_norm_at_sep_label_acc": label_at_sep,
    }
    said = verdicts(numbers)
    assert set(said) == set(CLAIMS)
    assert said["nonuniform_for_syntax"]["verdict"].startswith(word + " (")
    assert all({"claim", "measure", "differs", "verdict"} == set(v) for v in said.values())
