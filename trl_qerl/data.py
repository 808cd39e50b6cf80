"""Datasets for math RL, as TRL's GRPOTrainer wants them: a ``prompt`` column of chat messages (system prompt
included) and an ``answer`` column that the reward functions check.

Builders accept a Hub dataset name or a local json / jsonl / parquet file, and recognise the usual shapes:

* GSM8K: ``question`` + ``answer`` ending in ``#### 42``;
* MATH / MATH-500 / BigMath / DAPO-style: ``problem`` (or ``prompt``) + ``solution`` with a ``\\boxed{}`` answer, or
  an ``answer`` column;
* the shipped tiny arithmetic task: ``question`` + ``answer``;
* ``"reasoning-gym:<task>"``: a procedural reasoning-gym task (`trl_qerl.reasoning_gym`).

A dataset of the wrong shape gets an error naming the missing column and the columns it has.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Literal

from datasets import Dataset, DatasetDict, load_dataset

from .reasoning_gym import build_reasoning_gym_dataset, is_reasoning_gym
from .rewards import extract_boxed, extract_gsm8k_answer


SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process is enclosed within <think> </think> and the final answer within <answer> </answer> tags."
)
TINY_SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, then write the final number inside "
    "<answer> </answer>."
)
Kind = Literal["auto", "gsm8k", "math", "tiny"]
_QUESTION_COLUMNS = ("question", "problem", "prompt", "query", "input")
_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def tiny_assets() -> Path:
    """Directory of the shipped tiny model, tokenizer and arithmetic task."""
    return Path(str(resources.files("trl_qerl") / "assets" / "tiny"))


def load_source(name_or_path: str | os.PathLike, split: str = "train", subset: str | None = None) -> Dataset:
    """A split of a Hub dataset or of a local json / jsonl / parquet / csv file (or a directory of them)."""
    path = Path(name_or_path)
    if path.suffix in _LOCAL_FORMATS:
        if not path.exists():
            raise FileNotFoundError(f"Dataset file {path} does not exist.")
        return load_dataset(_LOCAL_FORMATS[path.suffix], data_files={split: str(path)}, split=split)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _LOCAL_FORMATS and split in p.stem)
        if not files:
            raise FileNotFoundError(f"No {split} json/jsonl/parquet/csv file in {path}.")
        return load_dataset(_LOCAL_FORMATS[files[0].suffix], data_files={split: [str(f) for f in files]}, split=split)
    loaded = load_dataset(str(name_or_path), subset, split=split)
    if isinstance(loaded, DatasetDict):
        raise ValueError(f"{name_or_path} has several splits {list(loaded)}; pass split=...")
    return loaded


def _pick(columns: list[str], candidates: tuple[str, ...], role: str, source: str) -> str:
    for name in candidates:
        if name in columns:
            return name
    raise ValueError(
        f"Dataset {source} has no {role} column: expected one of {list(candidates)}, found {columns}. Rename the "
        "column (dataset.rename_column) or pass question_column= / answer_column=."
    )


def _detect_kind(columns: list[str]) -> Kind:
    if "solution" in columns:
        return "math"
    return "gsm8k"


def gold_answer(text: str, kind: Kind) -> str:
    """The reference answer of a dataset row: after ``####`` (GSM8K), inside ``\\boxed{}`` (MATH), or as is."""
    text = str(text)
    if kind == "gsm8k":
        return extract_gsm8k_answer(text) or text.strip()
    if kind == "math":
        return extract_boxed(text) or text.strip()
    return text.strip()


def build_math_dataset(
    name_or_path: str | os.PathLike,
    split: str = "train",
    kind: Kind = "auto",
    system_prompt: str | None = SYSTEM_PROMPT,
    question_column: str | None = None,
    answer_column: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
) -> Dataset:
    """A GRPO-ready dataset (``prompt`` chat messages + ``answer``) from GSM8K, MATH-style or local data.

    Args:
        name_or_path: Hub id (``"openai/gsm8k"`` with ``subset="main"``, ``"HuggingFaceH4/MATH-500"``, ...), a local
            file / directory, or ``"reasoning-gym:<task>"`` (procedural, offline; ``subset`` is then the task's
            options as JSON and ``limit`` the number of problems, default 1000; see `trl_qerl.reasoning_gym`).
        split: which split to read.
        kind: how to read the answer: ``"gsm8k"`` (``#### 42``), ``"math"`` (``\\boxed{}`` in ``solution``),
            ``"tiny"`` (plain), or ``"auto"`` (``"math"`` when there is a ``solution`` column).
        system_prompt: prepended as a system message (None for none).
        question_column / answer_column: override the column detection.
        subset: Hub configuration name.
        limit: keep only the first rows.
    """
    if is_reasoning_gym(name_or_path):
        config = json.loads(subset) if subset else {}
        if not isinstance(config, dict):
            raise ValueError(f"For reasoning-gym, subset is the task's options as a JSON object; got {subset!r}.")
        kwargs = {} if system_prompt == SYSTEM_PROMPT else {"system_prompt": system_prompt}
        return build_reasoning_gym_dataset(str(name_or_path), split=split, size=limit or 1000, **kwargs, **config)
    source = load_source(name_or_path, split=split, subset=subset)
    if limit is not None:
        source = source.select(range(min(limit, len(source))))
    columns = list(source.column_names)
    question_col = question_column or _pick(columns, _QUESTION_COLUMNS, "question", str(name_or_path))
    kind = _detect_kind(columns) if kind == "auto" else kind
    answer_candidates = ("solution", "answer") if kind == "math" else ("answer", "solution", "ground_truth", "target")
    answer_col = answer_column or _pick(columns, answer_candidates, "answer", str(name_or_path))

    def to_prompt(row):
        question = row[question_col]
        if isinstance(question, list):  # already chat messages
            messages = list(question)
        else:
            messages = [{"role": "user", "content": str(question)}]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return {"prompt": messages, "answer": gold_answer(row[answer_col], kind)}

    return source.map(to_prompt, remove_columns=columns)


def tiny_arithmetic_dataset(split: str = "train", limit: int | None = None) -> Dataset:
    """The shipped synthetic arithmetic task (``split`` "train" or "test") with its own system prompt."""
    path = tiny_assets() / f"arithmetic_{split}.jsonl"
    return build_math_dataset(path, split=split, kind="tiny", system_prompt=TINY_SYSTEM_PROMPT, limit=limit)
