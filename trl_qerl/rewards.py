"""Reward functions for math RL with TRL's GRPOTrainer.

Every function takes ``completions`` (strings, or chat messages for conversational data) plus the dataset columns
as keyword arguments, and returns one float per completion. None of them raises on model output: garbage, empty
or unparsable completions score 0.

* `accuracy_reward`: the extracted answer (``<answer>``, ``####``, the last ``\\boxed{}``, else the last number)
  equals the ``answer`` column, checked with math-verify (robust to formatting: ``1,234`` = ``1234``, ``0.5`` = ``\\frac{1}{2}``);
* `format_reward`: ``<think> ... </think> <answer> ... </answer>`` and nothing else;
* `make_length_penalty`: DAPO's soft overlong penalty.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_MAX_TEXT = 20_000  # longer outputs are cut before parsing: bounds the time a pathological completion can cost


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of the last message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return "" if completion is None else str(completion)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        brace = text.find("{", start)
        if brace == -1:
            return None
        depth = 0
        for index in range(brace, len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    return text[brace + 1 : index].strip()
        start = text.rfind("\\boxed", 0, start)  # unbalanced: try an earlier one
    return None


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####``, thousands separators removed, or None."""
    matches = _GSM8K.findall(text)
    return matches[-1].replace(",", "").strip() if matches else None


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last ``<answer>`` block, else ``#### x``, else the last ``\\boxed{}``, else the
    last number in the text (how GSM8K answers are usually read)."""
    text = text[-_MAX_TEXT:]
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        inner = tagged[-1].strip()
        return extract_boxed(inner) or inner
    explicit = extract_gsm8k_answer(text) or extract_boxed(text)
    if explicit is not None:
        return explicit
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise ImportError(
            "accuracy_reward checks answers with math-verify: pip install 'trl-qerl[math]' (or math-verify)."
        ) from error
    return parse, verify


def answers_match(gold: str, predicted: str | None) -> bool:
    """True when ``predicted`` is mathematically equal to ``gold`` (math-verify); never raises."""
    if predicted is None or not str(predicted).strip():
        return False
    if str(predicted).strip() == str(gold).strip():
        return True
    parse, verify = _math_verify()
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(_as_math(gold), parsing_timeout=timeout)
        predicted_parsed = parse(_as_math(predicted), parsing_timeout=timeout)
        return bool(
            gold_parsed and predicted_parsed and verify(gold_parsed, predicted_parsed, timeout_seconds=timeout)
        )
    except Exception:  # noqa: BLE001 - a reward must score garbage as wrong, not crash the run
        return False


def _as_math(text: str) -> str:
    """Wrap a bare answer in ``$...$`` so math-verify reads LaTeX answers (``\\frac12``) as math."""
    text = str(text).strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def accuracy_reward(completions: Sequence[Any], answer: Sequence[str] | None = None, **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer equals the row's ``answer`` (math-verify), else 0.0."""
    if answer is None:
        raise ValueError(
            "accuracy_reward needs an 'answer' column in the dataset (build it with trl_qerl.data.build_math_dataset)."
        )
    _math_verify()  # fail early with the install hint, not once per completion
    return [
        1.0 if answers_match(gold, extract_answer(completion_text(completion))) else 0.0
        for completion, gold in zip(completions, answer)
    ]


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 for ``<think> ... </think> <answer> ... </answer>`` with nothing around, else 0.0."""
    return [1.0 if _FORMAT.match(completion_text(completion)[-_MAX_TEXT:]) else 0.0 for completion in completions]


def make_length_penalty(max_completion_length: int, buffer: int = 256, penalty: float = 1.0) -> Callable:
    """DAPO's soft overlong penalty: 0 up to ``max - buffer`` tokens, then linearly down to ``-penalty`` at ``max``.

    Pass ``reward_weights`` to weigh it against accuracy, or use it as one more reward function.
    """
    if max_completion_length <= 0 or not 0 <= buffer < max_completion_length:
        raise ValueError(f"Need 0 <= buffer < max_completion_length, got {buffer} and {max_completion_length}.")
    threshold = max_completion_length - buffer

    def length_penalty(completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None, **kwargs):
        lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else [
            len(completion_text(c)) for c in completions
        ]  # fmt: skip
        return [-penalty * min(1.0, max(0, n - threshold) / max(1, buffer)) for n in lengths]

    length_penalty.__name__ = "length_penalty"
    return length_penalty


REWARDS: dict[str, Callable] = {"accuracy": accuracy_reward, "format": format_reward}
"""Reward functions by the names recipes and the CLI use."""
