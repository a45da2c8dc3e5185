"""`headlab check` / headlab.check: every check passes on each HF family and on a toy model, and a
planted bug in where headlab thinks a head lives is reported as a MISMATCH (exit code 1)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

import headlab
from conftest import error_line, run_headlab
from headlab.models.check import RELATIVE_TOLERANCE, TOLERANCE
from headlab.models.families import FAMILIES
from headlab.models.hf import ATTN_IMPLEMENTATION, load_hf
from headlab.models.sites import HeadSites, headlab_attention
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy, save_toy

HF_CHECKS = [
    "idle_hooks_vs_eager",
    "idle_hooks_vs_sdpa",
    "zero_head_vs_W_O",
    "k_edit_hits_kv_group",
    "v_edit_hits_kv_group",
]


def by_name(verdicts: list[headlab.Verdict]) -> dict[str, headlab.Verdict]:
    return {v.name: v for v in verdicts}


EAGER_BY_DEFAULT = {"gemma2"}  # transformers runs Gemma 2 eagerly (its attention softcap): no sdpa to compare


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_check_passes_on_each_family(family, tiny_hf_dir):
    verdicts = headlab.check(load_hf(str(tiny_hf_dir(family)), need_tokenizer=False))
    assert [v.name for v in verdicts] == [
        c for c in HF_CHECKS if not (c.endswith("sdpa") and family in EAGER_BY_DEFAULT)
    ]
    for v in verdicts:
        assert v.ok and v.max_abs_diff is not None and v.max_abs_diff <= v.tolerance == TOLERANCE[torch.float32], v
    assert "4 query heads on 2 kv heads" in by_name(verdicts)["k_edit_hits_kv_group"].detail or family in (
        "gpt2",
        "gpt_neox",
    )


def test_a_path_is_loaded_first_and_half_precision_gets_a_wider_tolerance(tiny_hf_dir):
    verdicts = headlab.check(str(tiny_hf_dir("llama")), dtype="bfloat16")
    assert all(v.ok and v.tolerance >= RELATIVE_TOLERANCE[torch.bfloat16] for v in verdicts), verdicts


def test_a_toy_model_skips_the_reference_comparison(tmp_path):
    torch.manual_seed(0)
    verdicts = headlab.check(hooked_toy(ToyTransformer(ToyConfig(vocab_size=5, n_layers=2)), "toy"))
    idle, *rest = verdicts
    assert idle.skipped and "no implementation but headlab's own" in idle.detail
    assert [v.name for v in rest] == HF_CHECKS[2:] and all(v.ok and not v.skipped for v in rest)


def test_a_wrong_kv_mapping_is_caught(tiny_hf_dir, monkeypatch):
    hooked = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)
    monkeypatch.setattr(hooked.sites, "kv_head_of", lambda head: head % hooked.sites.n_kv_heads)  # 0,1,0,1
    verdicts = by_name(headlab.check(hooked))
    for site in "kv":
        v = verdicts[f"{site}_edit_hits_kv_group"]
        assert not v.ok and v.max_abs_diff > 100 * v.tolerance, v
        assert "kv head 0 changed query heads [0, 1], expected [0, 2]" in v.detail
        assert v.line().startswith(f"MISMATCH {site}_edit_hits_kv_group")
    assert verdicts["zero_head_vs_W_O"].ok and verdicts["idle_hooks_vs_eager"].ok


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])  # Conv1D [in, out] and nn.Linear [out, in]
def test_wrong_head_slicing_of_w_o_is_caught(family, tiny_hf_dir, monkeypatch):
    hooked = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    sites, right = hooked.sites, hooked.sites.w_o
    # head h read as d_head interleaved columns (h, h + n_heads, ...) instead of one contiguous block
    wrong = lambda layer: right(layer).reshape(sites.d_head, sites.n_heads, -1).transpose(0, 1)  # noqa: E731
    monkeypatch.setattr(sites, "w_o", wrong)
    v = by_name(headlab.check(hooked))["zero_head_vs_W_O"]
    assert not v.ok and v.max_abs_diff > 100 * v.tolerance and v.detail.startswith("differs at L0H0"), v


def test_a_broken_attention_is_caught_by_the_idle_check(tiny_hf_dir, monkeypatch):
    hooked = load_hf(str(tiny_hf_dir("gpt_neox")), need_tokenizer=False)

    def broken(*args, **kwargs):
        z, pattern = headlab_attention(*args, **kwargs)
        return z * 1.001, pattern

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, broken)
    verdicts = by_name(headlab.check(hooked))
    for name in ("idle_hooks_vs_eager", "idle_hooks_vs_sdpa"):
        assert not verdicts[name].ok and verdicts[name].max_abs_diff > verdicts[name].tolerance, verdicts[name]
    assert verdicts["zero_head_vs_W_O"].ok  # both sides of that check run the same broken attention


def test_cli_prints_one_ok_line_per_check(tiny_hf_dir, tmp_path):
    result = run_headlab("check", "model=hf", f"model.path={tiny_hf_dir('llama')}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["ok", name] for name in HF_CHECKS], result.stdout
    assert lines[0].startswith("ok   idle_hooks_vs_eager  ") and "(tol 1e-04)" in lines[0]


def test_cli_exits_1_on_a_mismatch(tiny_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(HeadSites, "kv_head_of", lambda self, head: head % self.n_kv_heads)
    result = run_headlab("check", "model=hf", f"model.path={tiny_hf_dir('qwen2')}", cwd=tmp_path)
    assert result.returncode == 1
    status = {line.split()[1]: line.split()[0] for line in result.stdout.splitlines()}
    assert status == {name: "MISMATCH" if "kv_group" in name else "ok" for name in HF_CHECKS}, result.stdout


def test_cli_checks_a_toy_checkpoint(tmp_path):
    torch.manual_seed(0)
    save_toy(ToyTransformer(ToyConfig(vocab_size=3)), tmp_path / "toy")
    result = run_headlab("check", "model=toy-attn-1l", f"model.path={tmp_path / 'toy'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["skip", "ok", "ok", "ok"], result.stdout


def test_cli_reports_a_model_that_cannot_be_loaded_in_one_line(tmp_path):
    result = run_headlab("check", "model=hf", f"model.path={tmp_path / 'missing'}", cwd=tmp_path)
    assert result.returncode != 0
    assert "cannot load local directory" in error_line(result)
