"""IOI: prompts and roles on the real GPT-2 tokenizer; its sweeps checked against hand-built HF hooks.

The independent computations here never go through HeadSites: they hook the Hugging Face modules
themselves (GPT-2's c_attn / c_proj, Llama's v_proj) on the tiny random-weight models of conftest.
"""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from headlab.errors import HeadlabError
from headlab.interventions import CLEAN, Intervention, plan
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.models.hf import load_hf
from headlab.tasks.base import bos_prefix
from headlab.tasks.ioi import ABBA_TEMPLATES, BABA_TEMPLATES, IOIConfig, IOITask

LD = 0  # logit_diff, the first IOI quantity


def ioi_task(**kw) -> IOITask:
    return IOITask(OmegaConf.merge(OmegaConf.structured(IOIConfig), kw))


@pytest.fixture(scope="module")
def gpt2(tiny_hf_dir, gpt2_tokenizer):
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    return model


@pytest.fixture(scope="module")
def ioi_data(gpt2):
    task = ioi_task()
    return task, task.build(24, seed=1, model=gpt2)


def test_templates_are_the_papers_fifteen_and_their_abba_versions():
    assert len(BABA_TEMPLATES) == len(ABBA_TEMPLATES) == 15
    assert all(t.count("[B]") == 2 and t.count("[A]") == 2 for t in BABA_TEMPLATES)
    assert all(t.index("[A]") < t.index("[B]") for t in ABBA_TEMPLATES)
    assert all(t.index("[B]") < t.index("[A]") for t in BABA_TEMPLATES)


def test_each_role_sits_on_its_name_and_the_sets_differ_where_they_should(gpt2_tokenizer):
    task = ioi_task()
    data = task.build(120, seed=0, model=SimpleNamespace(tokenizer=gpt2_tokenizer))
    tok = gpt2_tokenizer
    ids, cf, abc = data.inputs["input_ids"], data.counterfactual["input_ids"], data.reference["input_ids"]
    rows = torch.arange(data.n)
    at = {role: ids[rows, p] for role, p in data.token_positions.items()}
    assert torch.equal(at["IO"], data.answers["io"]) and torch.equal(at["S1"], data.answers["s"])
    assert torch.equal(at["S2"], data.answers["s"]) and not (data.answers["io"] == data.answers["s"]).any()
    assert {tok.decode([t]) for t in at["END"].tolist()} == {" to"}
    assert (ids[:, 0] != tok.bos_token_id).all()  # GPT-2's tokenizer puts no BOS before a text (nor do Wang et al.)
    assert torch.equal(data.positions[:, 0], data.token_positions["END"])
    # S2-flipped: only S2 changes, to the IO name
    differ = (ids != cf).nonzero()
    assert torch.equal(differ[:, 1], data.token_positions["S2"][differ[:, 0]]) and len(differ) == data.n
    assert torch.equal(cf[rows, data.token_positions["S2"]], data.answers["io"])
    # ABC: three different names at the three name positions, everything else as in the clean prompt
    names = torch.stack([abc[rows, data.token_positions[r]] for r in ("IO", "S1", "S2")], 1)
    assert all(len(set(r.tolist())) == 3 for r in names)
    same = torch.ones_like(ids, dtype=torch.bool)
    for r in ("IO", "S1", "S2"):
        same[rows, data.token_positions[r]] = False
    assert torch.equal(ids[same], abc[same])
    assert data.groups.unique().numel() == 30
    # the text the model reads is the template with the names in place
    t = int(data.groups[0])
    text = (BABA_TEMPLATES + ABBA_TEMPLATES)[t]
    expect = text[: text.rindex(" [A]")].replace("[A]", tok.decode([at["IO"][0]]).strip())
    expect = expect.replace("[B]", tok.decode([at["S1"][0]]).strip())
    decoded = tok.decode(ids[0, : data.token_positions["END"][0] + 1])
    assert decoded.split(" ")[:3] == expect.split(" ")[:3] and decoded.endswith(" to")


class _AddsBos:
    """A tokenizer that puts its BOS (id 7) before every text it encodes with special tokens, as Gemma's does."""

    bos_token_id = 7

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return {"input_ids": [7, *ids] if add_special_tokens else ids}


def test_bos_follows_the_tokenizer_unless_told(gpt2_tokenizer):
    assert bos_prefix(gpt2_tokenizer, None) == [] and bos_prefix(_AddsBos(), None) == [7]
    assert bos_prefix(gpt2_tokenizer, True) == [gpt2_tokenizer.bos_token_id] and bos_prefix(_AddsBos(), False) == []
    told = ioi_task(prepend_bos=True).build(8, seed=0, model=SimpleNamespace(tokenizer=gpt2_tokenizer))
    plain = ioi_task().build(8, seed=0, model=SimpleNamespace(tokenizer=gpt2_tokenizer))
    assert (told.inputs["input_ids"][:, 0] == gpt2_tokenizer.bos_token_id).all()
    assert torch.equal(told.token_positions["END"], plain.token_positions["END"] + 1)
    assert torch.equal(told.inputs["input_ids"][:, 1:], plain.inputs["input_ids"])


def test_the_reference_set_pairs_each_prompt_and_tops_up_its_templates(gpt2_tokenizer):
    tok = gpt2_tokenizer
    data = ioi_task(n_reference=100).build(16, seed=0, model=SimpleNamespace(tokenizer=tok))
    ids, abc = data.inputs["input_ids"], data.reference["input_ids"]
    assert abc.shape == (100, ids.shape[1]) and torch.equal(data.reference_rows, torch.arange(16))
    assert torch.equal(data.reference_groups[:16], data.groups)
    counts = torch.bincount(data.reference_groups)
    assert set(data.reference_groups.tolist()) == set(data.groups.tolist())  # only the templates in use
    assert counts[data.groups].min() >= 100 // 16 and counts[data.groups].max() <= 100 // 16 + 1
    # every extra ABC prompt lies out as the clean prompts of its template: names at the same three positions,
    # three different ones, the template's other words in place
    first = {int(g): i for i, g in reversed(list(enumerate(data.groups.tolist())))}
    for j in range(16, 100):
        i = first[int(data.reference_groups[j])]
        names = [int(abc[j, data.token_positions[r][i]]) for r in ("IO", "S1", "S2")]
        assert len(set(names)) == 3
        words = tok.decode(abc[j, : data.token_positions["END"][i] + 1]).split(" ")
        clean = tok.decode(ids[i, : data.token_positions["END"][i] + 1]).split(" ")
        assert len(words) == len(clean) and words[-1] == clean[-1] == "to"
    # fewer reference prompts than prompts: each prompt's own ABC version alone
    small = ioi_task(n_reference=4).build(16, seed=0, model=SimpleNamespace(tokenizer=tok))
    assert small.reference["input_ids"].shape[0] == 16 and torch.equal(small.reference["input_ids"], abc[:16])


def test_a_mean_over_fewer_than_two_reference_prompts_is_noted(gpt2):
    task = ioi_task(n_reference=4)
    data = task.build(40, seed=0, model=gpt2)  # 40 prompts over 30 templates: 20 templates have one
    report: dict = {}
    execute(gpt2, task, data, [Intervention("ablate_head", "mean", 0, 0)], report=report)
    thin = int((torch.bincount(data.reference_groups)[data.groups] < 2).sum())
    assert thin == 20 and any(f"on {thin} of the 40 prompts" in n for n in report["notes"])
    report = {}
    execute(
        gpt2, task, ioi_task().build(16, seed=0, model=gpt2), [Intervention("ablate_head", "mean", 0, 0)], report=report
    )
    assert not report.get("notes")


def test_multi_token_names_are_refused_by_name(gpt2_tokenizer):
    multi = ["Xzyqwv", "Bartholomewina", "Qwertyuiopa"]
    few = ioi_task(names=["Mary", "John", "Anna", *multi], min_names=5)
    with pytest.raises(HeadlabError, match="Xzyqwv.*Bartholomewina.*Qwertyuiopa"):
        few.use_tokenizer(gpt2_tokenizer)
    many = [f"Zq{c}xv{c}wy" for c in "abcdefghij"]
    with pytest.raises(HeadlabError) as refused:  # a long list stays out of the one line
        ioi_task(names=["Mary", *many], min_names=5).use_tokenizer(gpt2_tokenizer)
    assert len(str(refused.value)) < 200 and "and 6 more (listed in the warning above)" in str(refused.value)
    enough = ioi_task(names=["Mary", "John", "Anna", "Tom", *multi], min_names=4)
    data = enough.build(40, seed=0, model=SimpleNamespace(tokenizer=gpt2_tokenizer))
    used = set(data.answers["io"].tolist()) | set(data.answers["s"].tolist())
    assert used <= {gpt2_tokenizer(" " + n)["input_ids"][0] for n in ("Mary", "John", "Anna", "Tom")}


def _ioi_cfg(**patch):
    return OmegaConf.create(
        {"ablate": {"sweep": "components", "method": "mean"}, "patch": OmegaConf.structured(PatchConfig(**patch))}
    )


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_ioi_sweeps_equal_the_naive_loop(family, tiny_hf_dir, gpt2_tokenizer):
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    task = ioi_task()
    data = task.build(12, seed=2, model=model)
    ivs = plan(
        _ioi_cfg(kinds=["activation"], sites=["z", "pattern", "v", "k"], positions=["all", "S2", "END"]),
        model.n_layers,
        model.n_heads,
    )
    ivs = [iv for iv in ivs if iv.layer in (None, 1)]
    fast = execute(model, task, data, ivs, chunk_mb=1)
    slow = execute(model, task, data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    assert (fast[1:, :, LD] - fast[0, :, LD]).abs().amax(1).gt(1e-6).float().mean() > 0.5  # they do something


def _c_proj_prehook(model, layer: int, edit):
    """GPT-2's own attention output projection: its input is z of all heads, merged [b, pos, h*d]."""
    attn = model.module.transformer.h[layer].attn

    def hook(_m, args):
        z = args[0].unflatten(-1, (model.n_heads, -1)).clone()
        edit(z)
        return (z.flatten(-2),)

    return attn.c_proj.register_forward_pre_hook(hook)


def _merged_z(model, inputs) -> dict[int, torch.Tensor]:
    got = {}
    handles = [_c_proj_prehook(model, l, lambda z, l=l: got.__setitem__(l, z.clone())) for l in range(model.n_layers)]
    with torch.no_grad():
        model.module(**inputs)
    for h in handles:
        h.remove()
    return got


def _logit_diff(model, inputs, data) -> torch.Tensor:
    with torch.no_grad():
        logits = model.module(**inputs).logits
    end = logits[torch.arange(data.n), data.positions[:, 0]]
    return end.gather(1, data.answers["io"][:, None])[:, 0] - end.gather(1, data.answers["s"][:, None])[:, 0]


def test_mean_ablation_takes_the_mean_over_abc_prompts_of_the_same_template(gpt2, ioi_data):
    task, data = ioi_data
    layer, head = 1, 2
    abc = _merged_z(gpt2, data.reference)[layer][:, :, head]  # [n, pos, d]
    means = {int(g): abc[data.reference_groups == g].mean(0) for g in data.groups.unique()}

    def edit(z):
        for i, g in enumerate(data.groups.tolist()):
            z[i, :, head] = means[g]

    handle = _c_proj_prehook(gpt2, layer, edit)
    expected = _logit_diff(gpt2, data.inputs, data)
    handle.remove()
    got = execute(gpt2, task, data, [CLEAN, Intervention("ablate_head", "mean", layer, head)])
    torch.testing.assert_close(got[1, :, LD], expected, atol=1e-5, rtol=0)
    assert (got[1, :, LD] - got[0, :, LD]).abs().max() > 1e-4


def test_grouped_query_value_patching_touches_exactly_the_shared_kv_head(tiny_hf_dir, gpt2_tokenizer):
    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)  # 4 query heads on 2 kv heads
    model.tokenizer = gpt2_tokenizer
    task = ioi_task()
    data = task.build(12, seed=3, model=model)
    assert [model.sites.kv_head_of(h) for h in range(4)] == [0, 0, 1, 1]
    layer = 0
    v_proj = model.module.model.layers[layer].self_attn.v_proj
    seen = {}
    handle = v_proj.register_forward_hook(lambda _m, _a, out: seen.__setitem__("cf", out.clone()))
    with torch.no_grad():
        model.module(**data.counterfactual)
    handle.remove()

    def patch_kv0(_m, _a, out):
        out = out.clone()
        out[..., : model.sites.d_head] = seen["cf"][..., : model.sites.d_head]
        return out

    handle = v_proj.register_forward_hook(patch_kv0)
    expected = _logit_diff(model, data.inputs, data)
    handle.remove()
    ivs = [CLEAN] + [Intervention("patch_head", "activation", layer, h, site="v") for h in range(4)]
    got = execute(model, task, data, ivs)
    for h in (0, 1):
        torch.testing.assert_close(got[1 + h, :, LD], expected, atol=1e-5, rtol=0)
    assert (got[3, :, LD] - expected).abs().max() > 1e-5
    torch.testing.assert_close(got[3], got[4])


def _path_reference(model, data, sender, receivers, site):
    """Wang et al. App. B with GPT-2's own modules: pass A (sender from ABC, later heads frozen clean,
    receiver inputs read off c_attn), pass B (a clean run with the receivers' q/k/v replaced)."""
    s_layer, s_head = sender
    paired = {k: v[data.reference_rows] for k, v in data.reference.items()}  # prompt i's own ABC version
    clean, abc = _merged_z(model, data.inputs), _merged_z(model, paired)
    d = model.sites.d_model
    offset = {"q": 0, "k": d, "v": 2 * d}.get(site, 0)
    handles = []

    def freeze(layer):
        def edit(z):
            if layer == s_layer:
                z[:, :, s_head] = abc[layer][:, :, s_head]
            elif layer > s_layer:
                z[:] = clean[layer]

        return edit

    handles = [_c_proj_prehook(model, l, freeze(l)) for l in range(model.n_layers)]
    qkv = {}
    for layer in {l for l, _ in receivers}:
        attn = model.module.transformer.h[layer].attn
        handles.append(attn.c_attn.register_forward_hook(lambda _m, _a, out, l=layer: qkv.__setitem__(l, out.clone())))
    pass_a = _logit_diff(model, data.inputs, data)
    for h in handles:
        h.remove()
    if not receivers:
        return pass_a
    d_head = model.sites.d_head

    def replace(layer):
        def hook(_m, _a, out):
            out = out.clone()
            for l, h in receivers:
                if l == layer:
                    cols = slice(offset + h * d_head, offset + (h + 1) * d_head)
                    out[..., cols] = qkv[layer][..., cols]
            return out

        return hook

    handles = [
        model.module.transformer.h[l].attn.c_attn.register_forward_hook(replace(l)) for l in {l for l, _ in receivers}
    ]
    pass_b = _logit_diff(model, data.inputs, data)
    for h in handles:
        h.remove()
    return pass_b


@pytest.mark.parametrize("receivers,site", [("logits", None), ("2.1 2.3", "q"), ("1.0 2.2", "v")])
def test_path_patching_equals_a_hand_built_two_pass_run(gpt2, ioi_data, receivers, site):
    task, data = ioi_data
    senders = [(0, 1), (0, 3), (1, 2)]
    ivs = [CLEAN] + [Intervention("path_patch", "path", l, h, site=site, receivers=receivers) for l, h in senders]
    got = execute(gpt2, task, data, ivs)
    heads = [] if receivers == "logits" else [tuple(map(int, r.split("."))) for r in receivers.split()]
    for i, sender in enumerate(senders, 1):
        downstream = [r for r in heads if r[0] > sender[0]]
        expected = _path_reference(gpt2, data, sender, downstream, site) if downstream or not heads else got[0, :, LD]
        torch.testing.assert_close(got[i, :, LD], expected, atol=2e-5, rtol=0)
    assert (got[1:, :, LD] - got[0, :, LD]).abs().max() > 1e-5


def test_path_patching_to_the_logits_from_the_last_layer_is_activation_patching_from_abc(gpt2, ioi_data):
    task, data = ioi_data
    last = gpt2.n_layers - 1
    got = execute(
        gpt2,
        task,
        data,
        [
            Intervention("path_patch", "path", last, 1, receivers="logits"),
            Intervention("ablate_head", "resample", last, 1),
        ],
    )
    torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=0)


def test_attribution_is_the_directional_derivative_of_the_logit_difference(tiny_hf_dir, gpt2_tokenizer):
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False, dtype="float64")
    model.tokenizer = gpt2_tokenizer
    task = ioi_task()
    data = task.build(10, seed=4, model=model)
    layer, head = 1, 3
    ivs = [
        CLEAN,
        Intervention("patch_head", "attribution", layer, head, site="z"),
        Intervention("patch_head", "attribution", layer, head, site="z", token="END"),
    ]
    got = execute(model, task, data, ivs)
    assert torch.isnan(got[1:, :, 1:]).all()  # only the logit difference has an estimate
    clean, cf = _merged_z(model, data.inputs)[layer], _merged_z(model, data.counterfactual)[layer]
    rows, end = torch.arange(data.n), data.positions[:, 0]
    for i, only_end in ((1, False), (2, True)):

        def at(eps, only_end=only_end):
            def edit(z):
                mix = clean[:, :, head] + eps * (cf[:, :, head] - clean[:, :, head])
                if only_end:
                    z[rows, end, head] = mix[rows, end]
                else:
                    z[:, :, head] = mix

            handle = _c_proj_prehook(model, layer, edit)
            value = _logit_diff(model, data.inputs, data)
            handle.remove()
            return value

        derivative = (at(1e-4) - at(-1e-4)) / 2e-4
        torch.testing.assert_close(got[i, :, LD] - got[0, :, LD], derivative, atol=1e-6, rtol=1e-4)
        assert derivative.abs().max() > 1e-4
    assert all(p.requires_grad for p in model.module.parameters())  # the weights' flags are given back


def test_a_directorys_own_tokenizer_loads_when_first_asked_for(tiny_hf_dir, gpt2_tokenizer, tmp_path):
    import shutil

    shutil.copytree(tiny_hf_dir("gpt2"), tmp_path / "m")
    model = load_hf(str(tmp_path / "m"), need_tokenizer=False)
    assert model.tokenizer is None  # nothing beside the weights
    gpt2_tokenizer.save_pretrained(tmp_path / "m")
    model = load_hf(str(tmp_path / "m"), need_tokenizer=False)
    text = "When Mary and John went to the store"
    assert model.tokenizer(text)["input_ids"] == gpt2_tokenizer(text)["input_ids"]
    unread = load_hf(str(tmp_path / "m"), need_tokenizer=False)
    for f in (tmp_path / "m").iterdir():  # read when first asked for, not at loading: gone by then
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            f.unlink()
    assert unread.tokenizer is None


def test_cli_runs_ioi_on_a_local_model_and_refuses_bad_input_with_one_line(tiny_hf_dir, gpt2_tokenizer, tmp_path):
    from conftest import GPT2_TOKENIZER
    from test_cli import _error_line, headlab

    model = ["model=hf", f"model.path={tiny_hf_dir('gpt2')}", f"model.tokenizer={GPT2_TOKENIZER}"]
    small = ["task=ioi", "task.n_prompts=16", "output.n_boot=20", f"output.root={tmp_path}"]
    proc = headlab(
        "run", *model, *small, "ablate.method=mean", "patch=activation", "patch.positions=[END,S2]", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_parquet(next(tmp_path.glob("runs/*/*/results.parquet")))
    patched = df[(df.intervention == "patch_head") & (df.metric == "logit_diff")]
    assert set(patched["token"]) == {"END", "S2"} and set(patched["site"]) == {"z"} and len(patched) == 2 * 12
    assert len(df[(df.intervention == "ablate_head") & (df.metric == "accuracy")]) == 12
    proc = headlab("run", *model, *small, "patch=activation", "patch.positions=[XYZ]", cwd=tmp_path)
    roles = "patch.positions=XYZ: expected all, an index, or a role task ioi names: IO, S1, S2, END"
    assert proc.returncode == 2 and roles in _error_line(proc)
    proc = headlab("run", "model=hf", f"model.path={tiny_hf_dir('gpt2')}", *small, cwd=tmp_path)
    assert proc.returncode == 1 and "set model.tokenizer=" in _error_line(proc)
