"""reasoning-gym tasks as a dataset source, with their own scorers as the reward.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (Apache-2.0) generates reasoning problems
procedurally (``chain_sum``, ``basic_arithmetic``, ``gsm_symbolic``, ``countdown``, ...) and scores answers with a
task-specific checker. Nothing is downloaded: a problem is a function of (task, config, seed, index). So a dataset
row stores that spec (column ``reasoning_gym``, JSON) and `reasoning_gym_reward` regenerates the problem to score a
completion with the task's own ``score_answer`` (partial credit where the task gives it), reading the answer from the
completion's last ``<answer> </answer>`` block.

Use it as ``dataset_name="reasoning-gym:<task>"`` on the command line (``trl-qerl train --dataset_name
reasoning-gym:chain_sum --reward_funcs reasoning_gym``) or `build_reasoning_gym_dataset` in Python. The train and
test splits use different seeds; tasks with few distinct problems (one-digit sums) can repeat a problem across them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from datasets import Dataset

from .rewards import completion_text


PREFIX = "reasoning-gym:"
COLUMN = "reasoning_gym"
SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, then write the final answer inside "
    "<answer> </answer>."
)
_SPLIT_SEED_OFFSET = {"train": 0, "validation": 1_000_003, "test": 2_000_003}
INSTALL_HINT = "reasoning-gym datasets need the package: pip install 'trl-qerl[reasoning-gym]' (or reasoning-gym)."


def is_reasoning_gym(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def task_name(name: str) -> str:
    """``"reasoning-gym:chain_sum"`` -> ``"chain_sum"`` (checked against reasoning-gym's registry)."""
    task = name[len(PREFIX) :] if is_reasoning_gym(name) else name
    known = _registry()
    if task not in known:
        import difflib

        close = difflib.get_close_matches(task, known, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else f" Tasks: {', '.join(sorted(known)[:30])}, ..."
        raise ValueError(f"reasoning-gym has no task {task!r}.{hint}")
    return task


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return reasoning_gym


def _registry() -> list[str]:
    _reasoning_gym()  # the install hint, before the import below can fail without it
    from reasoning_gym.factory import DATASETS  # the registry `create_dataset` reads (reasoning-gym 0.1.19-0.1.25)

    return list(DATASETS)


@lru_cache(maxsize=32)
def _generator(spec: str):
    settings = json.loads(spec)
    return _reasoning_gym().create_dataset(settings["task"], size=settings["size"], seed=settings["seed"],
                                           **settings["config"])  # fmt: skip


def build_reasoning_gym_dataset(
    task: str,
    split: str = "train",
    size: int = 1000,
    seed: int = 0,
    system_prompt: str | None = SYSTEM_PROMPT,
    **config: Any,
) -> Dataset:
    """``size`` problems of a reasoning-gym task as a GRPO dataset (``prompt`` chat messages, ``answer``, and the
    ``reasoning_gym`` spec that `reasoning_gym_reward` scores with).

    Args:
        task: a reasoning-gym task name (``"chain_sum"``) or ``"reasoning-gym:chain_sum"``.
        split: ``"train"``, ``"validation"`` or ``"test"``: each split draws its problems from its own seed.
        size: number of problems.
        seed: base seed of the problems.
        system_prompt: prepended as a system message (None for none).
        **config: the task's own options (e.g. ``min_terms=2, max_terms=4, min_digits=1, max_digits=2``).
    """
    if split not in _SPLIT_SEED_OFFSET:
        raise ValueError(f"split must be one of {list(_SPLIT_SEED_OFFSET)}, got {split!r}.")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"size must be a positive integer, got {size!r}.")
    spec = {"task": task_name(task), "size": size, "seed": seed + _SPLIT_SEED_OFFSET[split], "config": config}
    spec_json = json.dumps(spec, sort_keys=True)
    problems = _generator(spec_json)
    rows = {"prompt": [], "answer": [], COLUMN: []}
    for index in range(size):
        entry = problems[index]
        messages = [{"role": "user", "content": entry["question"]}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        rows["prompt"].append(messages)
        rows["answer"].append(str(entry["answer"]))
        rows[COLUMN].append(json.dumps({"spec": spec_json, "index": index}))
    return Dataset.from_dict(rows)


def extract_tagged_answer(text: str) -> str | None:
    """The content of the last ``<answer> </answer>`` block, stripped, or None."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end if end != -1 else None)
    if start == -1 or end == -1:
        return None
    return text[start + len("<answer>") : end].strip()


def reasoning_gym_reward(
    completions: Sequence[Any], reasoning_gym: Sequence[str] | None = None, **kwargs: Any
) -> list[float]:
    """The task's own score (0.0-1.0) of the answer in each completion's last ``<answer>`` block (0.0 without one).

    Needs the ``reasoning_gym`` column that `build_reasoning_gym_dataset` writes."""
    if reasoning_gym is None:
        raise ValueError(
            "reasoning_gym_reward needs the 'reasoning_gym' column of a dataset built with "
            "trl_qerl.reasoning_gym.build_reasoning_gym_dataset (or --dataset_name reasoning-gym:<task>)."
        )
    scores = []
    for completion, cell in zip(completions, reasoning_gym):
        row = json.loads(cell)
        spec = json.loads(row["spec"])
        entry = _generator(row["spec"])[row["index"]]
        answer = extract_tagged_answer(completion_text(completion))
        score = 0.0 if answer is None else _reasoning_gym().get_score_answer_fn(spec["task"])(answer, entry)
        scores.append(float(score))
    return scores
