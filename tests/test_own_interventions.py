"""A user's own interventions (headlab.Intervention with `edit`, run by headlab.execute): batched as the
built-in ones are, equal to a plain forward pass with a hook that makes the same edit, and refused in
one line at the door when they name what the model or the prompts do not have."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

import headlab
from conftest import counting_cfg
from headlab.models.hooked import HookedModel
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import Task, TaskData
from headlab.tasks.counting import CountingTask


def _toy() -> HookedModel:
    torch.manual_seed(0)
    net = ToyTransformer(ToyConfig(vocab_size=7, n_ctx=32, n_layers=2, n_heads=3, d_model=24, d_head=8, d_mlp=32))
    for p in net.parameters():  # larger weights than the init, so every head moves the logits
        p.data.normal_(0, 0.3)
    return hooked_toy(net.eval(), "toy")


def _half(x: Tensor) -> Tensor:
    return 0.5 * x


def _negate_in_place(x: Tensor) -> None:  # a TransformerLens-style hook: edits its argument, returns None
    x.neg_()


def _first_key_only(pattern: Tensor) -> Tensor:
    out = torch.zeros_like(pattern)
    out[..., 0] = 1.0
    return out


def _naive(model: HookedModel, task: Task, data: TaskData, iv: headlab.Intervention) -> Tensor:
    """Per-prompt quantities [n, Q] of one plain forward pass over the whole prompts with one hook making
    iv's edit: z through a torch pre-hook on the attention's output projection (no headlab hook at all),
    the other sites through HeadSites' hook on the full pass (no cache, no batching, no suffix)."""
    site = iv.site or "z"
    heads = list(range(model.n_heads)) if iv.head is None else [iv.head]
    if site in ("k", "v"):
        heads = sorted({model.sites.kv_head_of(h) for h in heads})
    n = data.n
    at: list = [iv.position] * n if iv.token is None else data.token_positions[iv.token].tolist()

    def edit(t: Tensor) -> Tensor:  # t in the site's own layout; heads second in what the edit sees
        t = t.clone()
        fn: Callable = iv.edit  # type: ignore[assignment]
        for i, p in enumerate(at):
            p = slice(None) if p is None else p
            if site == "z":  # [batch, pos, head, d_head]
                part = t[i, p][..., heads, :].movedim(-2, 0)
                new = fn(part.unsqueeze(0).clone())
                t[i][p][..., heads, :] = (part.unsqueeze(0) if new is None else new)[0].movedim(0, -2)
            else:  # [batch, head, pos, ...]
                part = t[i, heads][:, p].unsqueeze(0).clone()
                new = fn(part)
                new = part if new is None else new
                for j, h in enumerate(heads):
                    t[i, h, p] = new[0, j]
        return t

    if site == "z":
        d_head = model.sites.d_head

        def pre_hook(_module, args):
            z = args[0].unflatten(-1, (model.n_heads, d_head))
            return (edit(z).flatten(-2), *args[1:])

        handle = model.sites.out_projs[iv.layer].register_forward_pre_hook(pre_hook)  # type: ignore[index]
        try:
            logits = model.forward(data.inputs)
        finally:
            handle.remove()
    else:
        with model.sites.hooks(iv.layer, **{site: edit}):  # type: ignore[arg-type]
            logits = model.forward(data.inputs)
    rows = torch.arange(n)[:, None]
    return task.per_prompt(logits[rows, data.positions], data)


def _per_prompt(table, names: list[str], quantities) -> np.ndarray:
    """[interventions, prompts, quantities] from the per-prompt rows of a table, by intervention name."""
    rows = table[table["prompt_id"].notna()]
    out = []
    for name in names:
        mine = rows[rows["intervention"] == name].pivot(index="prompt_id", columns="metric", values="value")
        out.append(mine[list(quantities)].to_numpy())
    return np.stack(out)


def _check_against_naive(model, task, data, ivs, **options) -> None:
    names = [iv.intervention for iv in ivs]
    assert len(set(names)) == len(names)
    table = headlab.execute(model, task, ivs, data=data, per_prompt=True, n_boot=0, **options)
    batched = _per_prompt(table, ["none", *names], task.quantities)
    with torch.inference_mode():
        naive = np.stack([_naive(model, task, data, iv).numpy() for iv in ivs])
        clean = task.per_prompt(model.forward(data.inputs)[torch.arange(data.n)[:, None], data.positions], data)
    np.testing.assert_allclose(batched[0], clean.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(batched[1:], naive, atol=1e-5, rtol=0)
    moved = np.abs(batched[1:] - batched[0]).max(axis=(1, 2))
    assert (moved > 1e-4).all(), dict(zip(names, moved))  # every edit changes something
    assert set(table.loc[table["intervention"] != "none", "method"]) == {"custom"}


def test_own_edits_batched_equal_a_hooked_forward_pass_on_a_toy_model():
    model, task = _toy(), CountingTask(counting_cfg())
    data = task.build(24, seed=1)
    first = int(data.positions.min())  # edits at or before it: the engine runs a suffix of positions
    ivs = [
        headlab.Intervention("half_L0H1", layer=0, head=1, position=first - 2, edit=_half),
        headlab.Intervention("half_L1H2", layer=1, head=2, position=first, edit=_half),
        headlab.Intervention("half_L0H2_every_position", layer=0, head=2, edit=_half),
        headlab.Intervention("negate_v_L0H0", layer=0, head=0, site="v", position=-20, edit=_negate_in_place),
        headlab.Intervention("sink_L1H0", layer=1, head=0, site="pattern", position=first, edit=_first_key_only),
        headlab.Intervention("q_L1_every_head", layer=1, site="q", position=first, edit=lambda q: q + 1.0),
        headlab.Intervention("k_L1H1", layer=1, head=1, site="k", edit=lambda k: k.flip(-1)),
    ]
    # chunks of two copies (a copy's widest activation: its scores and pattern, 3 heads, float32):
    # several stacked passes per layer
    _check_against_naive(model, task, data, ivs, chunk_mb=2 * 24 * 3 * 27 * 27 * 8 / 2**20)


@pytest.fixture(scope="module")
def llama(tiny_hf_dir, gpt2_tokenizer, tmp_path_factory) -> HookedModel:
    """The tiny random-weight Llama (grouped-query: 4 heads on 2 kv heads) with GPT-2's tokenizer beside
    it, so that IOI's prompts, padded and with roles such as END, run on it."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("llama-with-tokenizer")
    AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama")).save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    return headlab.load_model(str(path))


def test_own_edits_batched_equal_a_hooked_forward_pass_on_a_tiny_llama(llama):
    task = headlab.load_task("ioi", n_prompts=12)
    data = task.build(12, seed=3, model=llama)
    assert "END" in (data.token_positions or {})
    ivs = [
        headlab.Intervention("half_L0H1_END", layer=0, head=1, token="END", edit=_half),
        headlab.Intervention("half_L1H3_p4", layer=1, head=3, position=4, edit=_half),
        headlab.Intervention("half_L1H0_every_position", layer=1, head=0, edit=_half),
        headlab.Intervention("negate_v_L1H2", layer=1, head=2, site="v", position=2, edit=_negate_in_place),
        headlab.Intervention("scale_k_L2H0", layer=2, head=0, site="k", edit=lambda k: 2.0 * k),
        headlab.Intervention("sink_L2H1_END", layer=2, head=1, site="pattern", token="END", edit=_first_key_only),
        headlab.Intervention("q_L0_every_head", layer=0, site="q", position=3, edit=lambda q: -q),
    ]
    _check_against_naive(llama, task, data, ivs, chunk_mb=0.05)


def test_own_and_built_in_interventions_run_together():
    """A built-in kind run by headlab.execute gives what the same kind gives in a sweep's plan, beside
    a user's edit that makes the same change."""
    model, task = _toy(), CountingTask(counting_cfg())
    data = task.build(16, seed=2)
    ivs = [
        headlab.Intervention("ablate_head", "zero", layer=1, head=0),
        # numpy and torch integers are indices too, as a loop over np.arange or an argmax gives them
        headlab.Intervention("zero_L1H0", layer=np.int64(1), head=torch.tensor(0), edit=torch.zeros_like),
    ]
    table = headlab.execute(model, task, ivs, data=data, per_prompt=True, n_boot=0)
    built_in, own = _per_prompt(table, ["ablate_head", "zero_L1H0"], task.quantities)
    np.testing.assert_allclose(built_in, own, atol=1e-6, rtol=0)
    assert list(table.loc[table["metric"] == "label_acc", "method"]) == ["none", "zero", "custom"]


def _short_prompts() -> TaskData:
    """16 prompts of 12 tokens read at positions 5 and 6 (counting's metrics: SEP, then y)."""
    ids = torch.randint(0, 7, (16, 12), generator=torch.Generator().manual_seed(0))
    return TaskData(
        {"input_ids": ids}, torch.tensor([[5, 6]]).repeat(16, 1), {"label": torch.zeros(16, dtype=torch.long)}
    )


def _refusal(model, task, data, iv) -> str:
    with pytest.raises(headlab.UsageError) as caught:
        headlab.execute(model, task, [iv], data=data, n_boot=0)
    line = str(caught.value)
    assert "\n" not in line and len(line) < 200, line
    return line


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"layer": 2}, "layer 2 is not one of this model's layers 0..1"),
        ({"layer": None}, "layer None"),
        ({"head": 3}, "head 3 is not one of layer 0's heads 0..2"),
        ({"site": "zz"}, "unknown head site 'zz'"),
        ({"position": 12}, "position 12 is not an index into prompts of 12 positions"),
        ({"position": -13}, "position -13 is not an index"),
        ({"position": 9}, "position 9 comes after the last one the task reads (6)"),
        ({"position": 1.5}, "position 1.5"),
        ({"position": None, "token": "END"}, "the task names no position 'END' (it names: none)"),
        ({"token": "END"}, "give a position or a token, not both"),
        ({"edit": "half"}, "edit must be a function"),
        ({"intervention": "ablate_head"}, "name your own edit"),
        ({"intervention": "none"}, "name your own edit"),
        ({"edit": lambda z: z[:, 0]}, "its edit returned (16, 8) for values of shape (16, 1, 8)"),
    ],
)
def test_a_bad_intervention_is_refused_in_one_line(fields, says):
    model, task = _toy(), CountingTask(counting_cfg())
    data = _short_prompts()
    iv = headlab.Intervention(**{"intervention": "mine", "layer": 0, "head": 1, "position": 3, "edit": _half, **fields})
    assert says in _refusal(model, task, data, iv)


def test_a_bad_built_in_intervention_or_argument_is_refused_in_one_line():
    model, task, data = _toy(), CountingTask(counting_cfg()), _short_prompts()
    assert "not a built-in kind" in _refusal(model, task, data, headlab.Intervention("ablate_everything", layer=0))
    assert "needs other_head" in _refusal(model, task, data, headlab.Intervention("pattern_from", "zero", 0, 1))
    assert "method 'sideways'" in _refusal(model, task, data, headlab.Intervention("ablate_head", "sideways", 0, 1))
    assert "not str" in _refusal(model, task, data, "ablate_head")  # type: ignore[arg-type]


def test_the_readme_recipe_runs_as_written():
    """The docs' "Your own intervention" block (docs/concepts/interventions.md), executed on a toy model."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts" / "interventions.md").read_text()
    block = page[page.index("```python\n") + len("```python\n") : page.index("\n```\n")]
    scope = {"headlab": headlab, "model": _toy(), "task": headlab.load_task("counting", n_prompts=32)}
    exec(block, scope)
    table = scope["table"]
    assert list(table.loc[table["metric"] == "label_acc", "intervention"]) == ["none"] + ["half"] * 6
    assert (table["n"] == 64).all()
