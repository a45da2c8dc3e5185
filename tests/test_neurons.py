"""MLP neuron site and joint (multi-layer) interventions, checked against computations that do not go
through HookedModel: edited weights, and plain torch hooks on the down projection / output projection."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute, execute_joint
from headlab.models.hf import load_hf
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import Task, TaskData

N, T, VOCAB = 12, 10, 7
NEURONS = (1, 4, 5, 17, 30)


def _toy(n_layers=2, d_mlp=32, seed=0):
    torch.manual_seed(seed)
    model = ToyTransformer(
        ToyConfig(vocab_size=VOCAB, n_ctx=32, n_layers=n_layers, n_heads=3, d_model=24, d_head=8, d_mlp=d_mlp)
    )
    for p in model.parameters():  # larger weights than the init, so every neuron moves the logits
        p.data.normal_(0, 0.3)
    return hooked_toy(model.eval(), "toy")


class _Logits(Task):
    """Every logit at the read positions, as quantities: comparisons see the whole output."""

    name = "logits"

    def __init__(self, vocab: int, n_positions: int):
        self.quantities = tuple(f"logit_{i}" for i in range(vocab * n_positions))
        self.aggregates = {}

    def per_prompt(self, logits, data):
        return logits.flatten(-2)


def _data(vocab=VOCAB, n=N, t=T, groups=False, seed=0) -> TaskData:
    gen = torch.Generator().manual_seed(seed)
    ids = lambda: torch.randint(0, vocab, (n, t), generator=gen)  # noqa: E731
    return TaskData(
        inputs={"input_ids": ids()},
        positions=torch.tensor([[t - 3, t - 1]]).repeat(n, 1),
        answers={},
        counterfactual={"input_ids": ids()},
        reference={"input_ids": ids()},
        token_positions={"MID": torch.randint(1, t, (n,), generator=gen)},
        groups=torch.arange(n) % 3 if groups else None,
        reference_groups=(torch.arange(n) + 1) % 3 if groups else None,
    )


def _plain(net: torch.nn.Module, data: TaskData, hooks=()) -> Tensor:
    """Logits at the read positions from a plain forward pass, with (module, pre-hook) pairs installed."""
    handles = [m.register_forward_pre_hook(fn) for m, fn in hooks]
    try:
        with torch.inference_mode():
            out = net(data.inputs["input_ids"])
    finally:
        for h in handles:
            h.remove()
    logits = out.logits if hasattr(out, "logits") else out
    rows = torch.arange(data.n).unsqueeze(1)
    return logits[rows, data.positions].flatten(-2)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("naive", [False, True])
def test_zeroing_neurons_equals_zeroing_their_down_projection_columns_on_toy(layer, naive):
    model = _toy()
    data = _data()
    got = execute(
        model,
        _Logits(VOCAB, 2),
        data,
        [CLEAN, Intervention("ablate_neurons", "zero", layer, neurons=NEURONS)],
        naive=naive,
    )
    by_down = copy.deepcopy(model.module)
    with torch.no_grad():  # nn.Linear(d_mlp, d_model): neuron j is column j
        by_down.blocks[layer].mlp[2].weight[:, list(NEURONS)] = 0
    by_up = copy.deepcopy(model.module)
    with torch.no_grad():  # the up projection's row and bias: pre-activation 0, GELU(0) = 0
        by_up.blocks[layer].mlp[0].weight[list(NEURONS)] = 0
        by_up.blocks[layer].mlp[0].bias[list(NEURONS)] = 0
    torch.testing.assert_close(got[0], _plain(model.module, data), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], _plain(by_down, data), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], _plain(by_up, data), atol=1e-5, rtol=0)
    assert (got[1] - got[0]).abs().max() > 1e-2  # the neurons mattered


def _down_proj(net: torch.nn.Module, family: str, layer: int) -> torch.nn.Module:
    if family == "gpt2":
        return net.transformer.h[layer].mlp.c_proj
    return net.model.layers[layer].mlp.down_proj


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_zeroing_neurons_equals_zeroing_their_down_projection_weights_on_hf(family, tiny_hf_dir):
    path = tiny_hf_dir(family)
    model = load_hf(str(path), need_tokenizer=False)
    data = _data(vocab=50257)
    task = _LogitsAt(torch.arange(0, 50257, 997))
    neurons = tuple(range(0, 128, 3))
    ivs = [CLEAN] + [Intervention("ablate_neurons", "zero", layer, neurons=neurons) for layer in (1, 2)]
    got = execute(model, task, data, ivs)
    torch.testing.assert_close(got, execute(model, task, data, ivs, naive=True), atol=1e-5, rtol=0)
    for row, layer in ((1, 1), (2, 2)):
        manual = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        down = _down_proj(manual, family, layer)
        with torch.no_grad():
            if type(down).__name__ == "Conv1D":  # GPT-2 stores [in, out]: neuron j is row j
                down.weight[list(neurons)] = 0
            else:  # nn.Linear stores [out, in]: neuron j is column j
                down.weight[:, list(neurons)] = 0
        expected = task.per_prompt(_full(manual, data), data)
        torch.testing.assert_close(got[row], expected, atol=1e-5, rtol=0)
        assert (got[row] - got[0]).abs().max() > 1e-5  # the neurons mattered


class _LogitsAt(Task):
    """A few vocabulary columns at the read positions (HF vocabularies are large)."""

    name = "logits_at"
    aggregates: dict = {}

    def __init__(self, columns: Tensor):
        self.columns = columns
        self.quantities = tuple(f"q{i}" for i in range(2 * len(columns)))

    def per_prompt(self, logits, data):
        return logits[..., self.columns].flatten(-2)


def _full(net: torch.nn.Module, data: TaskData) -> Tensor:
    with torch.inference_mode():
        logits = net(data.inputs["input_ids"]).logits
    return logits[torch.arange(data.n).unsqueeze(1), data.positions]


def _capture(module: torch.nn.Module, net: torch.nn.Module, ids: Tensor) -> Tensor:
    """The input of `module` over a plain forward pass of `net`."""
    kept = []
    handle = module.register_forward_pre_hook(lambda _m, args: kept.append(args[0].clone()))
    try:
        with torch.inference_mode():
            net(ids)
    finally:
        handle.remove()
    return kept[0]


@pytest.mark.parametrize("groups", [False, True])
def test_mean_ablating_neurons_replaces_them_with_the_reference_mean(groups):
    model = _toy()
    net = model.module
    data = _data(groups=groups)
    layer, idx = 1, list(NEURONS)
    down = net.blocks[layer].mlp[2]
    ref = _capture(down, net, data.reference["input_ids"])  # [n_ref, pos, d_mlp]
    if groups:
        means = torch.stack([ref[data.reference_groups == g].mean(0) for g in range(3)])[data.groups]
    else:
        means = ref.mean(0, keepdim=True).expand(data.n, -1, -1)
    mid = data.token_positions["MID"]
    rows = torch.arange(data.n)

    def every_position(_m, args):
        x = args[0].clone()
        x[..., idx] = means[..., idx]
        return (x,)

    def at_mid(_m, args):
        x = args[0].clone()
        x[rows[:, None], mid[:, None], torch.tensor(idx)] = means[rows[:, None], mid[:, None], torch.tensor(idx)]
        return (x,)

    ivs = [
        Intervention("ablate_neurons", "mean", layer, neurons=NEURONS),
        Intervention("ablate_neurons", "mean", layer, token="MID", neurons=NEURONS),
    ]
    got = execute(model, _Logits(VOCAB, 2), data, ivs)
    torch.testing.assert_close(got[0], _plain(net, data, [(down, every_position)]), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], _plain(net, data, [(down, at_mid)]), atol=1e-5, rtol=0)
    clean = _plain(net, data)
    assert (got[0] - clean).abs().max() > 1e-3 and (got[1] - clean).abs().max() > 1e-3  # the means differ


def test_record_and_hook_neurons():
    model = _toy()
    data = _data()
    with torch.inference_mode():
        recorded = model.record(data.inputs, "neurons")
    assert sorted(recorded) == [0, 1] and recorded[1].shape == (N, T, 32)
    expected = _capture(model.module.blocks[1].mlp[2], model.module, data.inputs["input_ids"])
    torch.testing.assert_close(recorded[1], expected, atol=0, rtol=0)
    attention_only = _toy(d_mlp=0)
    with pytest.raises(ValueError, match="has no MLP"):
        with attention_only.hooks(0, neurons=lambda t: t):
            pass


def test_neuron_rows_keep_the_group_label_and_drop_the_indices():
    iv = Intervention("ablate_neurons", "mean", 3, neurons=(2, 7), group="recall_top8")
    row = iv.row()
    assert row["group"] == "recall_top8" and row["layer"] == 3 and "neurons" not in row and "scale" not in row
    assert iv.edits(4)[0].heads == (2, 7) and iv.edits(4)[0].site == "neurons"
    with pytest.raises(ValueError, match="neuron indices"):
        Intervention("ablate_neurons", "zero", 0).edits(4)


def test_stacked_neuron_ablation_equals_naive_loop():
    model = _toy(n_layers=3)
    data = _data(groups=True)
    ivs = [CLEAN]
    for method in ("zero", "mean", "resample"):
        for layer in range(3):
            for where in ({}, {"position": T - 3}, {"token": "MID"}):  # T - 3 is read
                ivs.append(Intervention("ablate_neurons", method, layer, neurons=NEURONS, **where))
    ivs += [Intervention("ablate_mlp", "mean", 2), Intervention("ablate_head", "zero", 2, 1)]
    task = _Logits(VOCAB, 2)
    # two copies a chunk: a copy's widest activation is its scores and pattern (3 heads, float32)
    fast = execute(model, task, data, ivs, chunk_mb=2 * N * 3 * T * T * 8 / 2**20)
    slow = execute(model, task, data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    moved = (fast[1:] - fast[0]).abs().flatten(1).amax(1)
    assert (moved > 1e-4).all()  # every row changes something (the last layer only at read positions)


def test_joint_knockout_across_layers_equals_manual_hooks():
    model = _toy(n_layers=3)
    net = model.module
    data = _data()
    task = _Logits(VOCAB, 2)
    head, dh = 1, 8
    group = [
        Intervention("ablate_head", "zero", 0, head),
        Intervention("ablate_neurons", "zero", 2, neurons=NEURONS[:2]),
        Intervention("ablate_neurons", "zero", 2, neurons=NEURONS[2:]),  # same layer: both apply
        Intervention("ablate_mlp", "zero", 1),
    ]

    def zero_head(_m, args):  # the output projection's input is z, heads side by side
        x = args[0].clone()
        x[..., head * dh : (head + 1) * dh] = 0
        return (x,)

    def zero_neurons(_m, args):
        x = args[0].clone()
        x[..., list(NEURONS)] = 0
        return (x,)

    mlp1 = net.blocks[1].mlp
    handle = mlp1.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out))
    try:
        expected = _plain(net, data, [(net.blocks[0].attn.o, zero_head), (net.blocks[2].mlp[2], zero_neurons)])
    finally:
        handle.remove()
    singles = [
        Intervention("ablate_neurons", "mean", 1, neurons=NEURONS),
        Intervention("ablate_head", "resample", 2, 0),
        Intervention("ablate_layer", "mean", 0),
        Intervention("ablate_mlp", "resample", 1),
    ]
    got = execute_joint(model, task, data, [group, []] + [[iv] for iv in singles])
    assert got.shape == (2 + len(singles), N, len(task.quantities))
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=0)
    assert (got[0] - _plain(net, data)).abs().max() > 1e-2
    torch.testing.assert_close(got[1], _plain(net, data), atol=1e-5, rtol=0)  # empty group: the clean run
    via_execute = execute(model, task, data, [CLEAN] + singles, naive=True)
    torch.testing.assert_close(got[1], via_execute[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[2:], via_execute[1:], atol=1e-5, rtol=0)
    # two neuron sets at one layer act as their union
    split = [
        Intervention("ablate_neurons", "mean", 1, neurons=NEURONS[:3]),
        Intervention("ablate_neurons", "mean", 1, neurons=NEURONS[3:]),
    ]
    joint = execute_joint(model, task, data, [split, singles[:1]])
    torch.testing.assert_close(joint[0], joint[1], atol=1e-5, rtol=0)


def test_joint_refuses_what_is_not_an_edit_at_one_layer():
    model = _toy()
    with pytest.raises(ValueError, match="single-layer"):
        execute_joint(model, _Logits(VOCAB, 2), _data(), [[Intervention("ablate_layer", "zero", None)]])
