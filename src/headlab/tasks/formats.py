"""Prompt files read into records: one reader per format, behind FORMATS.

A record is a clean prompt, its corrupted twin, the answer and the wrong answer (each a string, a token
id, or a list of alternatives), and optionally the read position, a reference prompt and a group. The
schemas, and where each was taken from:

  jsonl        one JSON object per line with the fields clean, corrupted, answer, wrong_answer
  csv          the same columns; an answer cell that holds a JSON list is a list, every other cell is text
  autocircuit  auto-circuit's dataset JSON (UFO-101/auto-circuit, auto_circuit/data.py,
               load_datasets_from_json): {"prompts": [{"clean", "corrupt", "answers", "wrong_answers"}]},
               the answers lists of alternative strings
  eap_ig       EAP-IG's CSV (hannamw/EAP-IG, ioi.ipynb and ioi_llama.csv): clean, corrupted and the label
               as token ids, correct_idx and incorrect_idx (or one label column holding both as a list)
  mib          MIB benchmark rows (hannamw/MIB-circuit-track, MIB_circuit_track/dataset.py,
               HFEAPDataset), as .jsonl or a .json list: a prompt, counterfactual fields
               <name>_counterfactual each with its own prompt, the answer as label or choices[answerKey];
               the wrong answer is the counterfactual's answer, except for IOI rows (metadata with
               indirect_object and subject), whose answers are " IO" and " S" as MIB's loader has them
Every format also reads the optional fields position, reference and group by those names; a record
without a reference takes its corrupted prompt, which every format requires (tasks/prompts.py).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config_rules import PROMPT_FORMATS
from ..errors import HeadlabError, UsageError

Prompt = str | tuple[int, ...]  # text, or token ids taken as they are
Answer = tuple[str | int, ...]  # alternatives: strings to tokenize or token ids
REQUIRED = ("clean", "corrupted", "answer", "wrong_answer")
OPTIONAL = ("position", "reference", "group")


@dataclass(frozen=True)
class Record:
    where: str  # the row's place in its source ("p.jsonl line 7", "records[3]"), for error messages
    clean: Prompt
    corrupted: Prompt
    answer: Answer
    wrong_answer: Answer
    position: int | None = None  # token index into the tokenized clean prompt; None: its last token
    reference: Prompt | None = None  # None: the corrupted prompt
    group: str | int | None = None


def read(path: str | Path, fmt: str = "auto", counterfactual: str | None = None) -> list[Record]:
    """The records of a prompt file; every problem with it is one HeadlabError line."""
    return read_as(path, fmt, counterfactual)[1]


def read_as(path: str | Path, fmt: str = "auto", counterfactual: str | None = None) -> tuple[str, list[Record]]:
    """(the file's format, auto resolved; its records)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise HeadlabError(f"task.path {path}: no such file")
    if file.stat().st_size == 0:
        raise HeadlabError(f"{file.name} is empty")
    fmt = detect(file) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise UsageError(f"unknown task.format '{fmt}'; choose from: auto, {', '.join(FORMATS)}")
    if counterfactual and fmt != "mib":
        raise UsageError(f"task.counterfactual picks a field of MIB rows; {file.name} reads as {fmt}")
    records = FORMATS[fmt](file, counterfactual)
    if not records:
        raise HeadlabError(f"{file.name} holds no prompts")
    return fmt, records


def detect(file: Path) -> str:
    """The format by extension, then by fields."""
    suffix = file.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "mib" if is_mib_row(next(_json_lines(file), ("", {}))[1]) else "jsonl"
    if suffix == ".json":
        data = _json(file)
        if isinstance(data, dict) and "prompts" in data:
            return "autocircuit"
        if isinstance(data, list) and data and is_mib_row(data[0]):
            return "mib"
        raise HeadlabError(f'{file.name}: a .json file is auto-circuit\'s {{"prompts": [...]}} or a list of MIB rows')
    if suffix == ".csv":
        header = _csv_header(file)
        return "eap_ig" if "answer" not in header and {"correct_idx", "label"} & set(header) else "csv"
    raise UsageError(f"{file.name}: set task.format ({', '.join(FORMATS)}); its extension says none")


def is_mib_row(row: Any) -> bool:
    return isinstance(row, dict) and "prompt" in row and any(k.endswith("_counterfactual") for k in row)


def to_record(row: Any, where: str) -> Record:
    """A record from a mapping with the fields clean, corrupted, answer, wrong_answer (+ optional ones)."""
    if not isinstance(row, Mapping):
        raise HeadlabError(f"{where}: expected an object with fields {', '.join(REQUIRED)}")
    missing = [k for k in REQUIRED if row.get(k) in (None, "", [])]
    if missing:
        raise HeadlabError(f"{where}: missing {', '.join(missing)} (fields: {', '.join(REQUIRED + OPTIONAL)})")
    return Record(
        where,
        _prompt(row["clean"], where, "clean"),
        _prompt(row["corrupted"], where, "corrupted"),
        _answer(row["answer"], where, "answer"),
        _answer(row["wrong_answer"], where, "wrong_answer"),
        _position(row.get("position"), where),
        None if row.get("reference") in (None, "") else _prompt(row["reference"], where, "reference"),
        _group(row.get("group"), where),
    )


# --- readers, one per format ---------------------------------------------------------------------------
def read_jsonl(file: Path, _counterfactual: str | None) -> list[Record]:
    return [to_record(row, where) for where, row in _json_lines(file)]


def read_csv(file: Path, _counterfactual: str | None) -> list[Record]:
    _require_columns(file, REQUIRED)
    out = []
    for where, cells in _csv_rows(file):
        row: dict[str, Any] = dict(cells)
        for column in ("answer", "wrong_answer"):
            row[column] = _list_or_text(cells.get(column))
        out.append(to_record(row, where))
    return out


def read_autocircuit(file: Path, _counterfactual: str | None) -> list[Record]:
    data = _json(file)
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list):
        raise HeadlabError(f'{file.name}: auto-circuit\'s format is {{"prompts": [...]}}; no "prompts" list in it')
    names = {"clean": "clean", "corrupt": "corrupted", "answers": "answer", "wrong_answers": "wrong_answer"}
    out = []
    for i, p in enumerate(prompts):
        where = f"{file.name} prompts[{i}]"
        missing = [k for k in names if not isinstance(p, dict) or p.get(k) in (None, "", [])]
        if missing:
            raise HeadlabError(f"{where}: missing {', '.join(missing)} (auto-circuit fields: {', '.join(names)})")
        out.append(to_record({**p, **{ours: p[theirs] for theirs, ours in names.items()}}, where))
    return out


def read_eap_ig(file: Path, _counterfactual: str | None) -> list[Record]:
    header = _require_columns(file, ("clean", "corrupted"))
    if not {"correct_idx", "incorrect_idx"} <= set(header) and "label" not in header:
        raise HeadlabError(f"{file.name}: EAP-IG's label columns are correct_idx and incorrect_idx (token ids)")
    out = []
    for where, cells in _csv_rows(file):
        if "correct_idx" in cells:
            answer, wrong = _token_ids(cells["correct_idx"], where), _token_ids(cells["incorrect_idx"], where)
        else:
            pair = _list_or_text(cells["label"])
            if not isinstance(pair, list) or len(pair) != 2 or not all(_is_id(v) for v in pair):
                raise HeadlabError(f"{where}: label {short(str(cells['label']))} is not [correct id, incorrect id]")
            answer, wrong = pair
        out.append(to_record({**cells, "answer": answer, "wrong_answer": wrong}, where))
    return out


def read_mib(file: Path, counterfactual: str | None) -> list[Record]:
    if file.suffix.lower() == ".json":
        data = _json(file)
        if not isinstance(data, list):
            raise HeadlabError(f"{file.name}: MIB rows in a .json file are a list of objects")
        rows: Iterator[tuple[str, Any]] = ((f"{file.name} rows[{i}]", r) for i, r in enumerate(data))
    else:
        rows = _json_lines(file)
    return [_mib_record(row, where, counterfactual) for where, row in rows]


# The formats are the words task.format accepts, said once in config_rules.PROMPT_FORMATS; each is read by
# the reader named read_<format> above (a word without one fails here, at import).
Reader = Callable[[Path, str | None], list[Record]]
FORMATS: dict[str, Reader] = {name: globals()[f"read_{name}"] for name in PROMPT_FORMATS if name != "auto"}


def _mib_record(row: Any, where: str, counterfactual: str | None) -> Record:
    if not isinstance(row, dict) or "prompt" not in row:
        raise HeadlabError(f"{where}: a MIB row has a prompt and <name>_counterfactual fields")
    fields = [k for k, v in row.items() if k.endswith("_counterfactual") and isinstance(v, dict)]
    chosen = counterfactual if counterfactual is not None else (fields[0] if len(fields) == 1 else None)
    if chosen not in fields:
        said = f"no field {counterfactual}" if counterfactual else "several counterfactuals"
        raise UsageError(f"{where}: {said}; set task.counterfactual to one of: {', '.join(fields) or 'none'}")
    source = row[chosen]
    metadata = row.get("metadata") or {}
    if isinstance(metadata, dict) and {"indirect_object", "subject"} <= set(metadata):
        answer, wrong = f" {metadata['indirect_object']}", f" {metadata['subject']}"
    else:
        answer, wrong = _mib_answer(row, where), _mib_answer(source, f"{where} {chosen}")
    ours = {k: row.get(k) for k in OPTIONAL}
    return to_record(
        {"clean": row["prompt"], "corrupted": source.get("prompt"), "answer": answer, "wrong_answer": wrong, **ours},
        where,
    )


def _mib_answer(row: dict, where: str) -> str:
    if row.get("label") is not None:
        return str(row["label"])
    choices, key = row.get("choices"), row.get("answerKey")
    labels = choices.get("label") if isinstance(choices, dict) else choices
    if isinstance(labels, list) and isinstance(key, int) and 0 <= key < len(labels):
        return str(labels[key])
    raise HeadlabError(f"{where}: no answer (a label, or choices and an answerKey)")


# --- file access -------------------------------------------------------------------------------------
def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise HeadlabError(f"{file.name} line {e.lineno}: not JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise HeadlabError(f"{file.name}: not UTF-8 text") from None


def _json_lines(file: Path) -> Iterator[tuple[str, Any]]:
    try:
        with file.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise HeadlabError(f"{file.name} line {number}: not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise HeadlabError(f"{file.name} line {number}: expected a JSON object, got {type(row).__name__}")
                yield f"{file.name} line {number}", row
    except UnicodeDecodeError:
        raise HeadlabError(f"{file.name}: not UTF-8 text") from None


def _csv_header(file: Path) -> list[str]:
    try:
        with file.open(encoding="utf-8-sig", newline="") as f:
            return next(csv.reader(f), [])
    except (csv.Error, UnicodeDecodeError) as e:
        raise HeadlabError(f"{file.name} line 1: not a CSV header ({e})") from None


def _require_columns(file: Path, columns: tuple[str, ...]) -> list[str]:
    header = _csv_header(file)
    missing = [c for c in columns if c not in header]
    if missing:
        raise HeadlabError(f"{file.name}: no column {', '.join(missing)} (its columns: {short(', '.join(header), 60)})")
    return header


def _csv_rows(file: Path) -> Iterator[tuple[str, dict[str, str | None]]]:
    """(where, cells) per row; an empty cell is None."""
    with file.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, strict=True)
        try:
            header = next(reader)
            start = reader.line_num + 1
            for cells in reader:
                where, start = f"{file.name} line {start}", reader.line_num + 1
                if not any(c.strip() for c in cells):
                    continue
                if len(cells) != len(header):
                    raise HeadlabError(f"{where}: {len(cells)} fields, the header has {len(header)}")
                yield where, {k: v if v != "" else None for k, v in zip(header, cells)}
        except csv.Error as e:
            raise HeadlabError(f"{file.name} line {reader.line_num}: malformed CSV ({e})") from None
        except UnicodeDecodeError:
            raise HeadlabError(f"{file.name}: not UTF-8 text") from None


# --- values --------------------------------------------------------------------------------------------
def _list_or_text(cell: str | None) -> Any:
    if cell is None or not cell.startswith("["):
        return cell
    try:
        value = json.loads(cell)
    except json.JSONDecodeError:
        return cell  # text that happens to start with a bracket
    return value if isinstance(value, list) else cell


def _token_ids(cell: str | None, where: str) -> Any:
    value = _list_or_text(cell)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, list) and value and all(_is_id(v) for v in value):
        return value
    raise HeadlabError(f"{where}: {short(str(cell))} is not a token id (or a list of them)")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt(value: Any, where: str, field: str) -> Prompt:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(_is_id(v) and v >= 0 for v in value):
        return tuple(value)
    raise HeadlabError(f"{where}: {field} must be text or a list of token ids, not {short(repr(value))}")


def _answer(value: Any, where: str, field: str) -> Answer:
    alternatives = value if isinstance(value, list) else [value]
    ok = lambda v: (isinstance(v, str) and v != "") or (_is_id(v) and v >= 0)  # noqa: E731
    if not alternatives or not all(ok(v) for v in alternatives):
        raise HeadlabError(f"{where}: {field} must be a string, a token id or a list of them, not {short(repr(value))}")
    return tuple(alternatives)


def _position(value: Any, where: str) -> int | None:
    if value is None or value == "":
        return None
    if _is_id(value):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise HeadlabError(f"{where}: position {short(repr(value))} is not a token index")


def _group(value: Any, where: str) -> str | int | None:
    if value is None or isinstance(value, str) or _is_id(value):
        return value
    raise HeadlabError(f"{where}: group {short(repr(value))} must be a string or an integer")


def short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
