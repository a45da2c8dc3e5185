"""Source roles of attention-output SAE features (sae/source_roles.py): the rules on a hand-written row, and
the grid of every feature's top contexts against a per-context computation that goes through
direct_feature_attribution (itself held to the SAE's pre-activation in test_sae.py) and plain Python rules."""

from __future__ import annotations

import pytest
import torch

from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.sae.activations import Corpus, corpus_z, real_tokens
from headlab.sae.head_attribution import direct_feature_attribution, top_activations
from headlab.sae.relu_l1 import ReluL1SAE
from headlab.sae.source_roles import LOCAL_WINDOW, SOURCE_ROLES, source_classes, source_role_grid

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, T, H, DH = 7, 24, 4, 8


def test_each_source_position_takes_the_first_rule_that_holds():
    ids = torch.tensor([5, 1, 2, 3, 1, 2, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 1])
    role = {name: i for i, name in enumerate(SOURCE_ROLES)}
    got = source_classes(ids, torch.tensor([4, 16]))
    # destination 4 (token 1): the first token, an earlier 1 (same), the token after it (induction), the
    # previous token, itself; nothing after it
    assert got[0, :5].tolist() == [
        role["first token"],
        role["same token"],
        role["induction"],
        role["previous token"],
        role["current token"],
    ]
    assert (got[0, 5:] == -1).all()
    # destination 16 (token 1 again): s = 2 and s = 5 follow a 1 (induction), s = 1 and 4 are 1s (same
    # token), the 6s within LOCAL_WINDOW are local context, the rest before them long range
    expected = []
    for s in range(17):
        if s == 0:
            expected.append(role["first token"])
        elif s == 16:
            expected.append(role["current token"])
        elif s == 15:
            expected.append(role["previous token"])
        elif ids[s - 1] == 1:
            expected.append(role["induction"])
        elif ids[s] == 1:
            expected.append(role["same token"])
        elif 16 - s <= LOCAL_WINDOW:
            expected.append(role["local context"])
        else:
            expected.append(role["long range"])
    assert got[1].tolist() == expected
    assert {role["induction"], role["same token"], role["local context"], role["long range"]} <= set(expected)


def _rules(ids: list[int], t: int, s: int) -> int:
    """The rules once more, one position at a time."""
    if s == 0:
        return 0
    if s == t:
        return 1
    if s == t - 1:
        return 2
    if ids[s - 1] == ids[t]:
        return 3
    if ids[s] == ids[t]:
        return 4
    return 5 if t - s <= LOCAL_WINDOW else 6


@pytest.mark.parametrize("layer", [0, 1])
def test_the_grid_is_each_contexts_role_by_its_positive_attribution(layer):
    torch.manual_seed(0)
    model = ToyTransformer(
        ToyConfig(vocab_size=VOCAB, n_ctx=32, n_layers=2, n_heads=H, d_model=32, d_head=DH, d_mlp=32)
    )
    for p in model.parameters():  # peaked patterns
        p.data.normal_(0, 0.3)
    model = hooked_toy(model.eval(), "toy")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (6, T), generator=gen)
    lengths = torch.tensor([T, 20, 17, T, 12, 22])
    corpus = Corpus(ids, lengths, torch.full_like(ids, -100))
    sae = ReluL1SAE(H * DH, 48, seed=2).eval()
    with torch.no_grad():
        sae.b_enc.copy_(0.2 * torch.randn(48, generator=gen))
    x = corpus_z(model, layer, corpus, 4)
    values, where, _ = top_activations(sae, x, 5)
    locate = real_tokens(corpus).nonzero()
    grid = source_role_grid(model, layer, sae, corpus, locate, values, where, batch=4)
    assert grid.shape == values.shape and ((grid >= 0) <= (values > 0)).all()
    checked = 0
    for rank, feature in (values > 0).nonzero().tolist():
        row, t = locate[where[rank, feature]].tolist()
        dfa = direct_feature_attribution(model, layer, sae, ids[row, : lengths[row]], t, feature).sum(0)
        mass = [0.0] * len(SOURCE_ROLES)
        for s in range(t + 1):
            mass[_rules(ids[row].tolist(), t, s)] += max(float(dfa[s]), 0.0)
        want = max(range(len(mass)), key=lambda r: (mass[r], -r)) if sum(mass) > 0 else -1
        if want >= 0 and sorted(mass)[-1] - sorted(mass)[-2] < 1e-5:
            continue  # a tie to float rounding
        assert int(grid[rank, feature]) == want, (rank, feature, mass)
        checked += 1
    assert checked > 50 and len(set(grid[grid >= 0].tolist())) >= 3
