"""task=prompts: your prompts read from every supported format give task=ioi's numbers on the same prompts;
bad input is refused in one line. (A prompt's result does not depend on the batch it is padded into:
tests/test_padding.py, on PAIR below, for every intervention; where prompts take their values from:
tests/test_reference.py.)"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import headlab
from headlab.errors import HeadlabError, UsageError
from headlab.interventions import plan
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.models.hf import load_hf
from headlab.tasks import from_file, from_records
from headlab.tasks.ioi import IOIConfig, IOITask

METRICS = {"logit_diff", "answer_prob", "accuracy", "patching_score"}


def _load(tiny_hf_dir, tokenizer, family: str = "gpt2"):
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def gpt2(tiny_hf_dir, gpt2_tokenizer):
    return _load(tiny_hf_dir, gpt2_tokenizer)


def _interventions(model, method: str) -> list:
    cfg = OmegaConf.create(
        {
            "ablate": {"sweep": "heads", "method": method},
            "patch": OmegaConf.structured(PatchConfig(kinds=["activation"], positions=["all", "END"])),
        }
    )
    return plan(cfg, model.n_layers, model.n_heads)


# --- the IOI set written out in every format ---------------------------------------------------------
@pytest.fixture(scope="module")
def ioi(gpt2):
    """IOI's prompts (BOS included, as the text "<|endoftext|>" GPT-2's tokenizer reads as that token),
    their S2-flipped and ABC sets, IO and S names and templates, as records; and task=ioi's quantities."""
    tok = gpt2.tokenizer
    # one ABC prompt per prompt, as the records hold them
    task = IOITask(OmegaConf.merge(OmegaConf.structured(IOIConfig), {"prepend_bos": True, "n_reference": 40}))
    data = task.build(40, seed=1, model=gpt2)
    text = lambda ids, i: tok.decode(ids[i, : int(data.positions[i, 0]) + 1])  # noqa: E731
    records = [
        {
            "clean": text(data.inputs["input_ids"], i),
            "corrupted": text(data.counterfactual["input_ids"], i),
            "answer": tok.decode([int(data.answers["io"][i])]),
            "wrong_answer": tok.decode([int(data.answers["s"][i])]),
            "reference": text(data.reference["input_ids"], i),
            "group": int(data.groups[i]),
        }
        for i in range(data.n)
    ]
    ivs = _interventions(gpt2, "mean")
    return SimpleNamespace(task=task, data=data, records=records, ivs=ivs, quantities=execute(gpt2, task, data, ivs))


def _write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mib_row(r: dict, with_metadata: bool) -> dict:
    io, s = r["answer"], r["wrong_answer"]
    row = {
        "prompt": r["clean"],
        "s2_io_flip_counterfactual": {"prompt": r["corrupted"], "choices": [io, s], "answerKey": 1},
        "abc_counterfactual": {"prompt": r["reference"], "choices": [io, s], "answerKey": 0},
        "choices": [io, s],
        "answerKey": 0,
        "reference": r["reference"],
        "group": r["group"],
    }
    if with_metadata:  # MIB's IOI rows: names without their space; MIB's loader adds it
        row |= {"metadata": {"indirect_object": io.strip(), "subject": s.strip()}, "choices": [io.strip(), s.strip()]}
    return row


def _write(fmt: str, tmp: Path, records: list[dict], tok) -> tuple[Path, dict]:
    """A file of `records` in format `fmt`, and the options that read it back."""
    extra = {"reference": "reference", "group": "group"}
    if fmt == "jsonl":
        return _write_lines(tmp / "ioi.jsonl", records), {}
    if fmt == "csv":
        return _write_csv(tmp / "ioi.csv", records), {}
    if fmt == "autocircuit":
        prompts = [
            {
                "clean": r["clean"],
                "corrupt": r["corrupted"],
                "answers": [r["answer"]],
                "wrong_answers": [r["wrong_answer"]],
            }
            | {k: r[v] for k, v in extra.items()}
            for r in records
        ]
        (tmp / "ioi_prompts.json").write_text(json.dumps({"prompts": prompts}, indent=1))
        return tmp / "ioi_prompts.json", {}
    if fmt == "eap_ig":
        ids = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
        rows = [
            {"": i, "clean": r["clean"], "corrupted": r["corrupted"]}
            | {"correct_idx": ids(r["answer"]), "incorrect_idx": ids(r["wrong_answer"])}
            | {k: r[v] for k, v in extra.items()}
            for i, r in enumerate(records)
        ]
        return _write_csv(tmp / "ioi_eap.csv", rows), {}
    if fmt == "mib_jsonl":
        rows = [_mib_row(r, with_metadata=True) for r in records]
        return _write_lines(tmp / "ioi_mib.jsonl", rows), {"counterfactual": "s2_io_flip_counterfactual"}
    rows = [_mib_row(r, with_metadata=False) for r in records]
    (tmp / "ioi_mib.json").write_text(json.dumps(rows))
    return tmp / "ioi_mib.json", {"counterfactual": "s2_io_flip_counterfactual"}


FORMATS = ("jsonl", "csv", "autocircuit", "eap_ig", "mib_jsonl", "mib_json")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_ioi_set_in_every_format_gives_task_iois_numbers(fmt, gpt2, ioi, tmp_path):
    path, options = _write(fmt, tmp_path, ioi.records, gpt2.tokenizer)
    task = from_file(path, **options)
    data = task.build(0, seed=0, model=gpt2)
    for ours, theirs in ((data.inputs, ioi.data.inputs), (data.counterfactual, ioi.data.counterfactual)):
        assert torch.equal(ours["input_ids"], theirs["input_ids"])  # the same tokens, BOS and padding included
    assert torch.equal(data.reference["input_ids"], ioi.data.reference["input_ids"])
    assert torch.equal(data.positions, ioi.data.positions)
    assert torch.equal(data.answers["answer"][:, 0], ioi.data.answers["io"])
    got = execute(gpt2, task, data, ioi.ivs)
    # mean ablation of every head; activation patching of z at all positions and at END
    assert len(ioi.ivs) == 1 + 12 + 2 * 12
    # logit_diff, answer_prob vs io_prob, correct
    torch.testing.assert_close(got[..., :3], ioi.quantities, atol=1e-5, rtol=0)
    assert (got[1:, :, 0] - got[0, :, 0]).abs().max() > 1e-3  # the interventions do something
    peer = {"mib_jsonl": "mib", "mib_json": "mib"}.get(fmt, fmt)
    if peer in ("autocircuit", "eap_ig", "mib"):  # a peer's format is scored by the peer: one answer each, IOI's
        assert task.quantities[-1] == task.smooth_quantity == f"{peer}_logit_diff"
        torch.testing.assert_close(got[..., 3], ioi.quantities[..., 0], atol=1e-5, rtol=0)
    else:
        assert task.quantities == ("logit_diff", "answer_prob", "correct") and got.shape[-1] == 3
    torch.testing.assert_close(data.answers["clean_score"], got[0, :, 0], atol=1e-5, rtol=0)


# --- two prompts of two lengths (tests/test_padding.py pads them together) ----------------------------
PAIR = [
    {
        "clean": "The capital of France is",
        "corrupted": "The capital of Spain is",
        "answer": " Paris",
        "wrong_answer": " Madrid",
        "reference": "The capital of Italy is",
        "group": "capitals",
    },
    {
        "clean": "When Mary and John went to the store, John gave a drink to",
        "corrupted": "When Mary and John went to the store, Mary gave a drink to",
        "answer": " Mary",
        "wrong_answer": " John",
        "reference": "When Anna and Tom went to the park, Tom gave a drink to",
        "group": "ioi",
    },
]


# --- metrics ------------------------------------------------------------------------------------------
def test_alternatives_token_ids_and_positions(gpt2):
    tok = gpt2.tokenizer
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    base = {"clean": "The capital of France is the city of", "corrupted": "The capital of Spain is the city of"}
    records = [
        base | {"answer": [" Paris", " London"], "wrong_answer": [" Madrid", " Rome"]},
        base | {"answer": [ids(" Paris"), ids(" London")], "wrong_answer": [ids(" Madrid"), ids(" Rome")]},
        base | {"answer": " Paris", "wrong_answer": ids(" Madrid"), "position": 3},
        base | {"answer": " Paris", "wrong_answer": ids(" Madrid"), "position": -5},
    ]
    task = from_records(records)
    data = task.build(0, seed=0, model=gpt2)
    assert data.positions[:, 0].tolist() == [7, 7, 3, 3]
    with torch.no_grad():
        logits = gpt2.module(**data.inputs).logits
    q = task.per_prompt(logits[torch.arange(4)[:, None], data.positions], data)
    end, at3 = logits[0, 7], logits[2, 3]
    paris, london, madrid, rome = (ids(s) for s in (" Paris", " London", " Madrid", " Rome"))
    expect_diff = torch.maximum(end[paris], end[london]) - torch.maximum(end[madrid], end[rome])
    expect_prob = torch.softmax(end, -1)[[paris, london]].sum()
    torch.testing.assert_close(q[0], torch.stack([expect_diff, expect_prob, (expect_diff > 0).float()]))
    torch.testing.assert_close(q[1], q[0])
    torch.testing.assert_close(q[2, 0], at3[paris] - at3[madrid])
    torch.testing.assert_close(q[3], q[2])


def test_sweep_from_records_and_from_file(gpt2, tmp_path):
    table = headlab.sweep(gpt2, from_records(PAIR), ablate="heads", patch="activation", n_boot=20)
    assert set(table.metric) == METRICS
    clean = table[table.intervention == "none"].set_index("metric").value
    assert clean["patching_score"] == pytest.approx(1.0, abs=1e-4)
    path = _write_lines(tmp_path / "pair.jsonl", PAIR)
    again = headlab.sweep(gpt2, from_file(path), ablate="heads", patch="activation", n_boot=20)
    pd.testing.assert_frame_equal(again, table)
    one = headlab.sweep(gpt2, from_file(path, n_prompts=1), ablate="none", n_boot=0)
    assert set(one.n) == {1}


# --- a peer's format scored by the peer's metric ------------------------------------------------------
def _by_hand(model, text: str, right: list[int], wrong: list[int]) -> tuple[float, float, float]:
    """(auto-circuit's mean-over-alternatives difference, EAP-IG's / MIB's first-token difference, headlab's
    max-over-alternatives difference) at the last token of `text`, from one unpadded forward pass."""
    ids = torch.tensor([model.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        last = model.module(input_ids=ids).logits[0, -1].double()
    mean = last[right].mean() - last[wrong].mean()
    first = last[right[0]] - last[wrong[0]]
    best = last[right].max() - last[wrong].max()
    return float(mean), float(first), float(best)


def _same(got: torch.Tensor, expect: list[float]) -> None:
    torch.testing.assert_close(got.double(), torch.tensor(expect, dtype=torch.float64), atol=1e-5, rtol=0)


def _alternatives(tok) -> list[dict]:
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    answers = [([" Paris", " London"], [" Madrid", " Rome", " Berlin"]), ([" Mary", " Anna"], [" John", " Tom"])]
    return [
        {
            "clean": p["clean"],
            "corrupted": p["corrupted"],
            "right": [ids(a) for a in right],
            "wrong": [ids(w) for w in wrong],
        }
        | {"answers": right, "wrong_answers": wrong}
        for p, (right, wrong) in zip(PAIR, answers)
    ]


def test_an_autocircuit_file_is_scored_by_autocircuits_answer_diff(gpt2, tmp_path):
    rows = _alternatives(gpt2.tokenizer)
    prompts = [
        {"clean": r["clean"], "corrupt": r["corrupted"], "answers": r["answers"], "wrong_answers": r["wrong_answers"]}
        for r in rows
    ]
    path = tmp_path / "ac.json"
    path.write_text(json.dumps({"prompts": prompts}))
    clean = [_by_hand(gpt2, r["clean"], r["right"], r["wrong"]) for r in rows]
    corrupted = [_by_hand(gpt2, r["corrupted"], r["right"], r["wrong"]) for r in rows]
    mean = lambda values, j: sum(v[j] for v in values) / len(values)  # noqa: E731
    assert abs(mean(clean, 0) - mean(clean, 2)) > 1e-2  # the two definitions differ on these prompts

    task = from_file(path)
    assert task.smooth_quantity == "autocircuit_logit_diff"
    data = task.build(0, seed=0, model=gpt2)
    _same(data.answers["clean_score"], [c[0] for c in clean])
    _same(data.answers["corrupted_score"], [c[0] for c in corrupted])
    table = headlab.sweep(gpt2, task, ablate="none", n_boot=0).set_index("metric").value
    assert set(table.index) == METRICS | {"autocircuit_logit_diff"}
    assert table["autocircuit_logit_diff"] == pytest.approx(mean(clean, 0), abs=1e-4)
    assert table["logit_diff"] == pytest.approx(mean(clean, 2), abs=1e-4)  # headlab's own beside it
    assert table["patching_score"] == pytest.approx(1.0, abs=1e-4)

    # the user's override: headlab's own score, or auto-circuit's on a file of another format
    own = from_file(path, peer="none")
    assert own.smooth_quantity == "logit_diff" and own.quantities == ("logit_diff", "answer_prob", "correct")
    own_data = own.build(0, seed=0, model=gpt2)
    _same(own_data.answers["corrupted_score"], [c[2] for c in corrupted])
    lines = [
        {"clean": r["clean"], "corrupted": r["corrupted"], "answer": r["answers"], "wrong_answer": r["wrong_answers"]}
        for r in rows
    ]
    as_jsonl = _write_lines(tmp_path / "ac.jsonl", lines)
    assert from_file(as_jsonl).smooth_quantity == "logit_diff"
    again = headlab.sweep(gpt2, from_file(as_jsonl, peer="autocircuit"), ablate="none", n_boot=0)
    assert again.set_index("metric").value["autocircuit_logit_diff"] == pytest.approx(mean(clean, 0), abs=1e-4)


def test_eap_ig_and_mib_files_are_scored_by_their_first_answer_tokens(gpt2, tmp_path):
    rows = _alternatives(gpt2.tokenizer)
    eap = [
        {
            "clean": r["clean"],
            "corrupted": r["corrupted"],
            "correct_idx": json.dumps(r["right"]),
            "incorrect_idx": json.dumps(r["wrong"]),
        }
        for r in rows
    ]
    clean = [_by_hand(gpt2, r["clean"], r["right"], r["wrong"]) for r in rows]
    task = from_file(_write_csv(tmp_path / "eap.csv", eap))
    data = task.build(0, seed=0, model=gpt2)
    assert task.smooth_quantity == "eap_ig_logit_diff"
    _same(data.answers["clean_score"], [c[1] for c in clean])
    assert max(abs(c[1] - c[2]) for c in clean) > 1e-2  # first-token and best-token differences differ
    # MIB rows: the counterfactual's answer is the wrong one; MIB's logit_diff reads each one's first token
    mib = [
        {
            "prompt": r["clean"],
            "abc_counterfactual": {"prompt": r["corrupted"], "label": r["wrong_answers"][0]},
            "label": r["answers"][0],
        }
        for r in rows
    ]
    task = from_file(_write_lines(tmp_path / "mib.jsonl", mib))
    table = headlab.sweep(gpt2, task, ablate="none", n_boot=0).set_index("metric").value
    expect = sum(c[1] for c in clean) / len(clean)
    assert table["mib_logit_diff"] == pytest.approx(expect, abs=1e-4) == table["logit_diff"]


# --- bad input ----------------------------------------------------------------------------------------
def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and len(text) < 200, text
    return text


GOOD = json.dumps(PAIR[0])
BAD_FILES = [
    ("missing.jsonl", None, {}, "missing.jsonl: no such file"),
    ("empty.jsonl", "", {}, "empty.jsonl is empty"),
    ("bad.jsonl", f"{GOOD}\n\n{{oops\n", {}, r"bad.jsonl line 3: not JSON"),
    ("list.jsonl", "[1, 2]\n", {}, "list.jsonl line 1: expected a JSON object, got list"),
    ("noanswer.jsonl", f"{GOOD}\n" + json.dumps({**PAIR[0], "answer": None}), {}, "line 2: missing answer"),
    (
        "short.csv",
        "clean,corrupted,answer,wrong_answer\na,b,c,d\na,b,c\n",
        {},
        "short.csv line 3: 3 fields, the header has 4",
    ),
    ("quote.csv", 'clean,corrupted,answer,wrong_answer\n"a,b,c,d\n', {}, "quote.csv line 2: malformed CSV"),
    ("nocol.csv", "clean,corrupted,answer\na,b,c\n", {}, "nocol.csv: no column wrong_answer"),
    ("blank.csv", "clean,corrupted,answer,wrong_answer\n,b,c,d\n", {}, "blank.csv line 2: missing clean"),
    ("pos.csv", "clean,corrupted,answer,wrong_answer,position\na,b,c,d,x\n", {}, "pos.csv line 2: position 'x'"),
    ("x.jsonl", GOOD, {"format": "xml"}, "unknown task.format 'xml'; choose from: auto, jsonl, csv, autocircuit"),
    ("x.txt", GOOD, {}, r"x.txt: set task.format \(jsonl, csv"),
    ("x.json", GOOD, {}, "x.json: a .json file is auto-circuit's"),
    (
        "ac.json",
        '{"prompts": [{"clean": "a", "answers": ["b"]}]}',
        {},
        "ac.json prompts.0.: missing corrupt, wrong_answers",
    ),
    ("eap.csv", "clean,corrupted,correct_idx,incorrect_idx\na,b,12,x\n", {}, "eap.csv line 2: x is not a token id"),
    (
        "eap2.csv",
        "clean,corrupted,label\na,b,52\n",
        {},
        r"eap2.csv line 2: label 52 is not \[correct id, incorrect id\]",
    ),
    (
        "cf.jsonl",
        GOOD,
        {"counterfactual": "abc"},
        "task.counterfactual picks a field of MIB rows; cf.jsonl reads as jsonl",
    ),
]


@pytest.mark.parametrize(("name", "content", "options", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_are_refused_in_one_line_before_any_work(name, content, options, message, tmp_path):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(HeadlabError, match=message) as error:
        from_file(tmp_path / name, **options)
    _one_line(error)


def test_mib_rows_name_their_counterfactual_fields(tmp_path):
    rows = [
        {"prompt": "a b", "s1_counterfactual": {"prompt": "a c"}, "abc_counterfactual": {"prompt": "d b"}, "label": 1}
    ]
    _write_lines(tmp_path / "mib.jsonl", rows)
    for options, said in (({}, "several counterfactuals"), ({"counterfactual": "xyz"}, "no field xyz")):
        with pytest.raises(
            UsageError, match=f"mib.jsonl line 1: {said}; set task.counterfactual to one of: s1_co"
        ) as e:
            from_file(tmp_path / "mib.jsonl", **options)
        assert "abc_counterfactual" in _one_line(e)
    with pytest.raises(HeadlabError, match="mib.jsonl line 1 s1_counterfactual: no answer"):
        from_file(tmp_path / "mib.jsonl", counterfactual="s1_counterfactual")


def test_bad_records_and_models_are_refused_in_one_line(gpt2):
    long = PAIR[0] | {"answer": " Bartholomewina"}
    aligned = "clean and corrupted prompts tokenize to different lengths; patching needs them aligned"
    cases = [
        (
            [long],
            r"records\[0\]: answer ' Bartholomewina' is \d tokens; give one-token answers or set task.multi_token",
        ),
        (
            [PAIR[0] | {"corrupted": "The capital of the Republic of Spain is"}] * 9,
            f"records.0., records.1. .and 7 more.: {aligned}",
        ),
        ([PAIR[0] | {"position": 5}], r"records\[0\]: position 5 is outside the 5-token prompt"),
        ([PAIR[0] | {"wrong_answer": [" Madrid", " Paris"]}], r"share token \d+ \(' Paris'\)"),
        ([PAIR[0] | {"answer": 10**6}], "token id 1000000 is outside the vocabulary"),
    ]
    for records, message in cases:
        with pytest.raises(HeadlabError, match=message) as e:
            from_records(records).build(0, seed=0, model=gpt2)
        _one_line(e)
    first = from_records([long], multi_token="first").build(0, seed=0, model=gpt2)
    assert first.answers["answer"][0, 0] == gpt2.tokenizer(" Bartholomewina")["input_ids"][0]
    for call, message in (
        (lambda: from_records([]), "from_records: no records given"),
        (lambda: from_records([{"clean": "a"}]), r"records\[0\]: missing corrupted, answer, wrong_answer"),
        (lambda: from_records(PAIR, colour="red"), "unknown task option colour; choose from: counterfactual, format"),
        (lambda: from_records(PAIR, multi_token="all"), "unknown task.multi_token 'all'; choose from: refuse, first"),
        (lambda: from_records(PAIR, peer="acdc"), "unknown task.peer 'acdc'; choose from: auto, none, autocircuit"),
        (lambda: from_records(PAIR).build(0, 0, SimpleNamespace(name="toy")), "model toy has none"),
        (lambda: headlab.load_task("prompts"), "task=prompts reads your prompts from a file: set task.path=FILE"),
    ):
        with pytest.raises(HeadlabError, match=message) as e:
            call()
        _one_line(e)


# --- the command line ---------------------------------------------------------------------------------
def test_cli_runs_a_prompt_file_and_writes_the_four_metrics(tiny_hf_dir, tmp_path):
    from conftest import GPT2_TOKENIZER, error_line, run_headlab

    path = _write_lines(tmp_path / "mine.jsonl", PAIR)
    model = ["model=hf", f"model.path={tiny_hf_dir('gpt2')}", f"model.tokenizer={GPT2_TOKENIZER}"]
    common = ["output.n_boot=20", f"output.root={tmp_path}"]
    proc = run_headlab(
        "run", *model, "task=prompts", f"task.path={path}", "ablate=heads", "patch=activation", *common, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_parquet(next(tmp_path.glob("runs/*/*/results.parquet")))
    assert set(df.metric) == METRICS
    assert len(df[(df.intervention == "patch_head") & (df.metric == "patching_score")]) == 12
    proc = run_headlab("run", *model, "task=prompts", f"task.path={tmp_path / 'nope.csv'}", *common, cwd=tmp_path)
    assert proc.returncode == 1 and "nope.csv: no such file" in error_line(proc)
