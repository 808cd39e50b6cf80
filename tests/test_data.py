"""Dataset builders: GSM8K / MATH shapes from local files, the shipped task, and clear errors."""

import json

import pytest

from trl_qerl.data import SYSTEM_PROMPT, build_math_dataset, tiny_arithmetic_dataset


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_gsm8k_shape(tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k_train.jsonl", [
        {"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = 24.\n#### 72"},
        {"question": "Weng earns...", "answer": "...\n#### 1,210"},
    ])  # fmt: skip
    dataset = build_math_dataset(path)
    assert sorted(dataset.column_names) == ["answer", "prompt"]
    assert dataset[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Natalia sold 48 clips..."},
    ]
    assert dataset["answer"] == ["72", "1210"]


def test_math_shape_with_boxed_solution_and_no_system_prompt(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Compute 1/2 + 1/4.", "solution": "It is $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"},
    ])  # fmt: skip
    dataset = build_math_dataset(path, system_prompt=None)
    assert dataset[0]["prompt"] == [{"role": "user", "content": "Compute 1/2 + 1/4."}]
    assert dataset[0]["answer"] == "\\frac{3}{4}"


def test_dapo_style_prompt_messages_and_answer_column(tmp_path):
    path = _write_jsonl(tmp_path / "dapo.jsonl", [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"},
    ])  # fmt: skip
    dataset = build_math_dataset(path, kind="tiny")
    assert dataset[0]["prompt"][0]["role"] == "system"
    assert dataset[0]["prompt"][1]["content"] == "What is 2+2?"
    assert dataset[0]["answer"] == "4"


def test_parquet_and_limit(tmp_path):
    from datasets import Dataset

    Dataset.from_dict(
        {"question": [f"q{i}" for i in range(10)], "answer": [f"#### {i}" for i in range(10)]}
    ).to_parquet(tmp_path / "train.parquet")
    dataset = build_math_dataset(tmp_path / "train.parquet", limit=3)
    assert len(dataset) == 3 and dataset["answer"] == ["0", "1", "2"]


def test_missing_column_is_named(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello", "label": 1}])
    with pytest.raises(ValueError, match=r"no question column: expected one of .*found \['text', 'label'\]"):
        build_math_dataset(path)
    path = _write_jsonl(tmp_path / "noanswer.jsonl", [{"question": "hello"}])
    with pytest.raises(ValueError, match="no answer column"):
        build_math_dataset(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_math_dataset(tmp_path / "missing.jsonl")


def test_shipped_tiny_task_is_split_and_verifiable():
    train, test = tiny_arithmetic_dataset("train"), tiny_arithmetic_dataset("test")
    assert len(train) == 4000 and len(test) == 200
    questions = {row[-1]["content"] for row in train["prompt"]}
    assert not questions & {row[-1]["content"] for row in test["prompt"]}
    assert all(answer.isdigit() for answer in test["answer"])
