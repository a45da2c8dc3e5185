"""The prompts an intervention takes its values from: a prompt file without `reference` fields patches path
patching's senders from its corrupted prompts, as plain transformers hooks do, and an intervention whose
source is the prompt itself is refused in one line (on every prompt) or noted (on some)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from headlab.errors import UsageError
from headlab.interventions import CLEAN, Intervention, plan
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.tasks import from_file, from_records
from test_prompts import PAIR, _load

# clean and corrupted prompts of the same length in GPT-2's tokenizer, of three lengths (padded together)
RECORDS = [{k: r[k] for k in ("clean", "corrupted", "answer", "wrong_answer")} for r in PAIR] + [
    {
        "clean": "The cat sat on the old",
        "corrupted": "The dog sat on the old",
        "answer": " mat",
        "wrong_answer": " floor",
    }
]


def _out_projection(module, family: str, layer: int):
    """The module whose input is every head's output, side by side [b, pos, heads * d_head]."""
    if family == "gpt2":
        return module.transformer.h[layer].attn.c_proj
    return module.model.layers[layer].self_attn.o_proj


def _path_by_hand(module, family: str, tokenizer, record: dict, n_heads: int) -> dict[tuple[int, int], float]:
    """Round 1 of path patching into the logits with plain forward pre-hooks on the attention output
    projections, one unpadded prompt at a time: the sender head's output from the corrupted prompt, every
    head of later layers at its clean output, MLPs recomputed; (layer, head) -> answer - wrong logit."""
    layers = module.config.num_hidden_layers
    ids = {k: torch.tensor([tokenizer(record[k])["input_ids"]]) for k in ("clean", "corrupted")}
    answer, wrong = (tokenizer(record[k], add_special_tokens=False)["input_ids"][0] for k in ("answer", "wrong_answer"))

    def heads_of(text: str) -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        handles = [
            _out_projection(module, family, l).register_forward_pre_hook(lambda _m, a: seen.append(a[0].clone()))
            for l in range(layers)
        ]
        with torch.no_grad():
            module(input_ids=ids[text])
        for h in handles:
            h.remove()
        return [z.unflatten(-1, (n_heads, -1)) for z in seen]

    clean, corrupted = heads_of("clean"), heads_of("corrupted")
    senders = [(l, h) for l in range(layers) for h in range(n_heads)]  # copy j of the batch patches sender j

    def edit(args, layer):
        z = args[0].unflatten(-1, (n_heads, -1)).clone()
        for j, (at, head) in enumerate(senders):
            if layer == at:
                z[j, :, head] = corrupted[layer][0, :, head]
            elif layer > at:
                z[j] = clean[layer][0]
        return (z.flatten(-2),)

    handles = [
        _out_projection(module, family, l).register_forward_pre_hook(lambda _m, a, l=l: edit(a, l))
        for l in range(layers)
    ]
    with torch.no_grad():
        last = module(input_ids=ids["clean"].repeat(len(senders), 1)).logits[:, -1]
    for h in handles:
        h.remove()
    return {sender: float(last[j, answer] - last[j, wrong]) for j, sender in enumerate(senders)}


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_path_patching_on_a_file_without_references_patches_from_the_corrupted_prompts(
    family, tiny_hf_dir, gpt2_tokenizer, tmp_path
):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    model = _load(tiny_hf_dir, gpt2_tokenizer, family)
    task = from_file(path)
    data = task.build(0, seed=0, model=model)
    assert torch.equal(data.reference["input_ids"], data.counterfactual["input_ids"])
    assert data.inputs["attention_mask"].sum(1).unique().numel() == 3  # three lengths: two prompts are padded
    cfg = OmegaConf.create(
        {"ablate": {"sweep": "none", "method": "zero"}, "patch": OmegaConf.structured(PatchConfig(kinds=["path"]))}
    )
    ivs = plan(cfg, model.n_layers, model.n_heads)
    got = execute(model, task, data, ivs)[..., 0]  # logit_diff [1 + senders, prompts]

    module = AutoModelForCausalLM.from_pretrained(tiny_hf_dir(family)).eval()  # a copy headlab never touched
    for i, record in enumerate(RECORDS):
        expected = _path_by_hand(module, family, gpt2_tokenizer, record, model.n_heads)
        for j, iv in enumerate(ivs[1:], 1):
            assert got[j, i].item() == pytest.approx(expected[(iv.layer, iv.head)], abs=1e-4), (iv.layer, iv.head, i)
    # the senders move the logit difference well beyond the tolerance: the clean prompt as reference would fail
    assert (got[1:] - got[0]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def gpt2(tiny_hf_dir, gpt2_tokenizer):
    return _load(tiny_hf_dir, gpt2_tokenizer)


def test_a_source_that_is_the_prompt_itself_is_refused_or_noted(gpt2):
    same = [r | {"reference": r["clean"]} for r in RECORDS]
    path_patch = Intervention("path_patch", "path", 0, 1, receivers="logits")
    refusals = [
        (same, [path_patch], "path patching: on each of the 3 prompts its reference prompt is the prompt itself"),
        (same, [Intervention("ablate_head", "resample", 1, 0)], "resample ablation: on each of the 3 prompts"),
        # a group of one prompt whose reference is itself: its mean is the prompt's own activation
        (
            [r | {"group": i} for i, r in enumerate(same)],
            [Intervention("ablate_head", "mean", 1, 0)],
            "mean ablation: on each of the 3 prompts every reference prompt of its group is the prompt itself",
        ),
        (
            [r | {"corrupted": r["clean"]} for r in RECORDS],
            [Intervention("patch_head", "activation", 1, 0, token="END")],
            "activation patching: on each of the 3 prompts its counterfactual",
        ),
    ]
    for records, ivs, message in refusals:
        task = from_records(records)
        with pytest.raises(UsageError, match=message) as e:
            execute(gpt2, task, task.build(0, seed=0, model=gpt2), ivs)
        assert "\n" not in str(e.value) and len(str(e.value)) < 200
    # one group of every prompt, each its own reference: the mean is over three prompts, not the prompt
    task = from_records([r | {"group": "all"} for r in same])
    report: dict = {}
    mean = execute(
        gpt2, task, task.build(0, seed=0, model=gpt2), [Intervention("ablate_head", "mean", 1, 0)], report=report
    )
    assert "notes" not in report and mean.isfinite().all()
    # the first prompt its own reference, the others the corrupted one: run, with a note
    task = from_records([same[0], *RECORDS[1:]])
    data = task.build(0, seed=0, model=gpt2)
    got = execute(gpt2, task, data, [CLEAN, path_patch], report=report)[..., 0]
    assert report["notes"] == [
        "path patching: on 1 of the 3 prompts its reference prompt is the prompt itself, and it changes nothing there"
    ]
    assert (
        got[1, 0].item() == pytest.approx(got[0, 0].item(), abs=1e-6) and (got[1, 1:] - got[0, 1:]).abs().min() > 1e-4
    )


def test_cli_refuses_path_patching_from_the_clean_prompts_in_one_line(tiny_hf_dir, tmp_path):
    from conftest import GPT2_TOKENIZER, error_line, run_headlab

    path = tmp_path / "same.jsonl"
    path.write_text("".join(json.dumps(r | {"reference": r["clean"]}) + "\n" for r in RECORDS))
    model = ["model=hf", f"model.path={tiny_hf_dir('gpt2')}", f"model.tokenizer={GPT2_TOKENIZER}"]
    proc = run_headlab(
        "run", *model, "task=prompts", f"task.path={path}", "ablate=none", "patch=path", f"output.root={tmp_path}",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "path patching: on each of the 3 prompts its reference prompt is the prompt itself" in error_line(proc)
    assert not list(tmp_path.glob("runs/**/results.parquet")) and not list(tmp_path.glob("runs/**/meta.json"))
