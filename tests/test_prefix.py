"""Positioned edits run on a suffix of positions (engine: blocks l.. on positions p.., the clean keys and
values before p put in front): equal to one full pass per intervention, for every site and positioned
kind, on absolute- and rotary-position models, with right-padded prompts of different lengths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import HF_FAMILIES
from headlab.interventions import CLEAN, Intervention
from headlab.interventions.engine import execute
from headlab.models.families import FAMILIES
from headlab.models.hf import load_hf
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import Task, TaskData, mean_of

N, LENGTH, GOOD, BAD = 6, 11, 3, 5
LENGTHS = torch.tensor([11, 9, 11, 7, 10, 8])  # real tokens per prompt; the rest is right padding


class LastRealToken(Task):
    name, quantities = "last", ("logit_diff",)
    aggregates = {"logit_diff": mean_of(0)}

    def per_prompt(self, logits, data):
        return (logits[..., 0, GOOD] - logits[..., 0, BAD]).unsqueeze(-1)


def prompts(vocab: int, seed: int = 0) -> TaskData:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(LENGTH) < LENGTHS[:, None]).long()

    def ids():
        return torch.randint(0, vocab, (N, LENGTH), generator=gen) * mask

    end = LENGTHS - 1
    return TaskData(
        inputs={"input_ids": ids(), "attention_mask": mask},
        positions=end[:, None],
        answers={},
        counterfactual={"input_ids": ids(), "attention_mask": mask},
        reference={"input_ids": ids(), "attention_mask": mask},
        token_positions={"END": end, "MID": end - 3},
    )


def positioned(n_layers: int, n_heads: int, mlp: bool) -> list[Intervention]:
    ivs = [CLEAN]
    for layer in range(n_layers):
        head = layer % n_heads
        for site in ("z", "pattern", "q", "k", "v"):
            ivs += [Intervention("patch_head", "activation", layer, head, site=site, token=t) for t in ("END", "MID")]
            ivs += [Intervention("ablate_head", m, layer, head, site=site, token="MID") for m in ("zero", "mean")]
        ivs += [Intervention("ablate_head", "resample", layer, head, token="MID")]
        ivs += [Intervention("ablate_head", "zero", layer, head, position=4)]
        ivs += [Intervention("ablate_layer", "mean", layer, token="MID")]
        if mlp:
            ivs += [Intervention("ablate_mlp", m, layer, token="MID") for m in ("zero", "mean")]
            ivs += [Intervention("ablate_neurons", "zero", layer, neurons=(0, 3, 5), token="END")]
    return ivs


def toy(pos_emb: str):
    torch.manual_seed(0)
    cfg = ToyConfig(vocab_size=7, n_ctx=16, n_layers=2, n_heads=3, d_model=24, d_head=8, d_mlp=32, pos_emb=pos_emb)
    model = ToyTransformer(cfg)
    for p in model.parameters():  # larger weights than the init, so every head moves the logits
        p.data.normal_(0, 0.3)
    return hooked_toy(model.eval(), "toy")


def suffix_starts(model) -> list[int]:
    """Spy: the first position of every chunk's run_blocks call (to the last block; the clean walk steps
    one block at a time)."""
    starts: list[int] = []
    run_blocks = model.run_blocks

    def spy(*args, **kwargs):
        if kwargs.get("stop") is None:
            starts.append(kwargs.get("from_position", 0))
        return run_blocks(*args, **kwargs)

    model.run_blocks = spy
    return starts


def check(model, vocab: int) -> None:
    data = prompts(vocab)
    ivs = positioned(model.n_layers, model.n_heads, mlp=model.mlps[0] is not None)
    starts = suffix_starts(model)
    fast = execute(model, LastRealToken(), data, ivs, chunk_mb=0.05)
    assert starts and min(starts) > 0, starts  # every chunk ran on a suffix
    slow = execute(model, LastRealToken(), data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    # every first-layer edit reaches the last token (one on the last layer at MID may not: nothing reads it)
    first = [i for i, iv in enumerate(ivs) if iv.layer == 0]
    moved = (fast[first, :, 0] - fast[0, :, 0]).abs().amax(1)
    assert (moved > 1e-5).all(), moved


@pytest.mark.parametrize("pos_emb", ["learned", "rotary"])
def test_positioned_edits_on_a_suffix_equal_full_passes_on_toy(pos_emb):
    check(toy(pos_emb), vocab=7)


@pytest.mark.parametrize("family", sorted(f for f, row in FAMILIES.items() if row.suffix_runs))
def test_positioned_edits_on_a_suffix_equal_full_passes_on_hf(family, tiny_hf_dir):
    """Every family whose row claims suffix runs; those with a sliding window (Mistral, Gemma 2 and 3)
    have one of 4 tokens in their tiny models, shorter than the prompts."""
    check(load_hf(str(tiny_hf_dir(family)), need_tokenizer=False), vocab=50257)


@pytest.mark.parametrize("family", ["toy", "llama"])
def test_patching_every_position_from_a_prompt_sharing_a_prefix_runs_after_it(family, tiny_hf_dir):
    """The counterfactual prompts differ from the clean ones from position 5 on: a patch of every
    position writes the clean values back before it, so the run starts there."""
    model = toy("rotary") if family == "toy" else load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    vocab = 7 if family == "toy" else 50257
    data = prompts(vocab)
    other = data.inputs["input_ids"].clone()
    other[:, 5:] = (other[:, 5:] + 1) % vocab
    data = replace(data, counterfactual={**data.inputs, "input_ids": other * data.inputs["attention_mask"]})
    ivs = [CLEAN]
    for layer in range(model.n_layers):
        ivs += [Intervention("patch_head", "activation", layer, 1, site=s) for s in ("z", "pattern", "q", "k", "v")]
    starts = suffix_starts(model)
    fast = execute(model, LastRealToken(), data, ivs, chunk_mb=0.05)
    assert starts and min(starts) == 5 and max(starts) == 5, starts
    slow = execute(model, LastRealToken(), data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    assert (fast[1:, :, 0] - fast[0, :, 0]).abs().amax() > 1e-4


def test_an_edit_at_every_position_runs_the_whole_sequence_and_one_at_a_role_beside_it_its_suffix():
    model = toy("rotary")
    starts = suffix_starts(model)
    ivs = [CLEAN, Intervention("ablate_head", "zero", 1, 0), Intervention("ablate_head", "zero", 1, 1, token="END")]
    report: dict = {}
    # both heads would fit one chunk: each runs in its own, from where it edits
    execute(model, LastRealToken(), prompts(7), ivs, chunk_mb=1.0, report=report)
    groups = report["length_groups"]  # each group of prompts' longest
    earliest_end = [int(LENGTHS[(LENGTHS > lo) & (LENGTHS <= hi)].min()) - 1 for lo, hi in zip([0, *groups], groups)]
    assert sorted(starts) == sorted([0] * len(groups) + earliest_end) and min(earliest_end) > 0


def test_prompts_of_unequal_length_run_in_groups_each_as_far_as_it_is_read():
    """LENGTHS 7..11: each group of prompts runs through its longest prompt's last read position alone,
    and the quantities equal one full pass per intervention over the whole padded batch."""
    model = toy("rotary")
    lengths: list[int] = []
    run_blocks = model.run_blocks

    def spy(h, *args, **kwargs):
        lengths.append(h.shape[1] + kwargs.get("from_position", 0))
        return run_blocks(h, *args, **kwargs)

    model.run_blocks = spy
    ivs = [CLEAN, *(Intervention("ablate_head", "mean", l, h) for l in range(model.n_layers) for h in range(2))]
    report: dict = {}
    fast = execute(model, LastRealToken(), prompts(7), ivs, chunk_mb=1.0, report=report)
    groups = report["length_groups"]
    assert len(groups) > 1 and groups[-1] == int(LENGTHS.max()) and sorted(groups) == groups
    assert set(lengths) == set(groups) and min(lengths) < LENGTH
    model.run_blocks = run_blocks
    slow = execute(model, LastRealToken(), prompts(7), ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert (fast[1:, :, 0] - fast[0, :, 0]).abs().amax() > 1e-4


@pytest.mark.parametrize("family", ["toy", *HF_FAMILIES])
def test_a_layer_edited_at_z_or_after_its_attention_replays_its_attention(family, tiny_hf_dir):
    """Its q, k, v projections never see the sweep's stacked copies (only the clean passes of one batch
    of prompts); a pattern edit recomputes them; both equal full passes."""
    model = toy("learned") if family == "toy" else load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    vocab = 7 if family == "toy" else 50257
    data, last = prompts(vocab), model.n_layers - 1
    attn, out_proj = model.sites.attn_modules[last], model.sites.out_projs[last]
    stacked: list[int] = []  # batch sizes above one batch of prompts that reached an input projection
    for child in attn.children():
        if child is not out_proj:
            child.register_forward_hook(
                lambda _m, args, _out: stacked.extend([args[0].shape[0]] * (args[0].shape[0] > N))
            )
    replayed = [Intervention("ablate_head", m, last, h) for h in range(model.n_heads) for m in ("zero", "mean")]
    replayed += [
        Intervention("patch_head", "activation", last, 1, token="MID"),
        Intervention("ablate_mlp", "zero", last),
    ]
    recomputed = [Intervention("ablate_head", "zero", last, h, site="pattern") for h in (0, 1)]
    for ivs, copies in ((replayed, []), (recomputed, [2 * N])):
        stacked.clear()
        fast = execute(model, LastRealToken(), data, [CLEAN, *ivs], chunk_mb=1.0)
        assert sorted(set(stacked)) == copies
        slow = execute(model, LastRealToken(), data, [CLEAN, *ivs], naive=True)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
        assert (fast[1:, :, 0] - fast[0, :, 0]).abs().amax() > 1e-4
