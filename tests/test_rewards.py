"""Reward functions on tricky strings: never crash, robust to formatting."""

import pytest

from trl_qerl.rewards import (
    accuracy_reward,
    answers_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k_answer,
    format_reward,
    make_length_penalty,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>5+3=8</think> <answer>8</answer>", "8"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last answer block counts
        ("<answer>\\boxed{7}</answer>", "7"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("so \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
        ("\\boxed{a} and finally \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("The answer is 42.", "42"),
        ("I owe -3 dollars", "-3"),
        ("no numbers at all", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_helpers_on_broken_input():
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_boxed("\\boxed") is None
    assert extract_boxed("\\boxed{x} \\boxed{") == "x"  # the last one is broken: fall back to an earlier one
    assert extract_gsm8k_answer("no marker") is None


@pytest.mark.parametrize(
    "gold, predicted, expected",
    [
        ("72", "72", True),
        ("1234", "1,234", True),
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "0.5", True),
        ("3", "3.0", True),
        ("\\sqrt{2}", "\\sqrt{2}", True),
        ("72", "71", False),
        ("72", "", False),
        ("72", None, False),
        ("72", "\\frac{", False),
        ("72", "}{}{}" * 500, False),
        ("72", "seventy-two", False),
    ],
)
def test_answers_match(gold, predicted, expected):
    assert answers_match(gold, predicted) is expected


def test_accuracy_reward_scores_strings_and_conversations_and_never_raises():
    completions = [
        "<think>48 / 2 = 24, 48 + 24 = 72</think><answer>72</answer>",
        [{"role": "assistant", "content": "so #### 72"}],
        "garbage \\boxed{\\frac{",
        None,
        "",
        "\x00\xff<answer>\n</answer>",
        "<answer>" * 10000,
    ]
    rewards = accuracy_reward(completions, answer=["72"] * len(completions))
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="'answer' column"):
        accuracy_reward(["x"])


def test_format_reward():
    good = "<think>a</think>\n<answer>b</answer>"
    assert format_reward([good, " " + good + "\n", "<answer>b</answer>", good + " extra", "<think></think>"]) == [
        1.0, 1.0, 0.0, 0.0, 0.0,
    ]  # fmt: skip


def test_length_penalty_is_soft_and_validates_its_arguments():
    penalty = make_length_penalty(max_completion_length=100, buffer=20)
    assert penalty.__name__ == "length_penalty"
    scores = penalty(["x"] * 5, completion_ids=[[0] * n for n in (10, 80, 90, 100, 150)])
    assert scores == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer"):
        make_length_penalty(100, buffer=100)
