"""The AQN study's own pieces (scripts/pretrain_explore.py, scripts/reproduce_aqn.py): demonstrations that are right
unless they slip, and confidence intervals that are right."""

import random
import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import pretrain_explore  # noqa: E402
import reproduce_aqn  # noqa: E402


@pytest.mark.parametrize("expression", ["3 + 4 + 5 + 6", "9 - 9 - 7 + 0", "15 - 43 + 7", "0 - 8 - 1"])
def test_demonstrations_reach_the_sum_unless_they_slip(monkeypatch, expression):
    terms = pretrain_explore.parse_terms(expression)
    assert sum(terms) == eval(expression)  # noqa: S307 - a fixed arithmetic string
    monkeypatch.setattr(pretrain_explore, "SLIP_RATE", 0.0)
    rng = random.Random(0)
    styles = set()
    for _ in range(30):
        text, answer = pretrain_explore.demonstration(terms, rng)
        assert answer == sum(terms) and text.endswith(f"<answer>{answer}</answer>")
        styles.add(text.count("="))
    assert styles == {1, len(terms) - 1}  # all at once, and step by step


def test_slipped_demonstrations_follow_their_slip(monkeypatch):
    monkeypatch.setattr(pretrain_explore, "SLIP_RATE", 1.0)
    terms = [3, 4, 5, 6]
    rng = random.Random(1)
    answers = [pretrain_explore.demonstration(terms, rng)[1] for _ in range(30)]
    assert all(answer != 18 and abs(answer - 18) <= 9 for answer in answers)


def test_confidence_interval_is_student_t():
    mean, half = reproduce_aqn.interval([0.5, 0.6, 0.7, 0.4, 0.8])
    assert mean == pytest.approx(0.6)
    assert half == pytest.approx(2.776 * 0.158113883 / 5**0.5, rel=1e-6)
    assert reproduce_aqn.interval([0.3]) == (0.3, 0.0)
