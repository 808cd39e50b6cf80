"""The private hooks we rely on are listed in one place and checked against the installed versions."""

import pytest

from trl_qerl import _compat
from trl_qerl._compat import PRIVATE_HOOKS, PrivateHook, check_private_hooks, signature_problems


def test_installed_versions_match_every_listed_private_hook():
    assert signature_problems() == []


def test_a_changed_signature_is_reported_by_name_with_the_fix(monkeypatch):
    changed = PrivateHook(
        "trl:GRPOTrainer", "_calculate_rewards", ("inputs", "prompts", "renamed"), "a test", "trl 1.16"
    )
    gone = PrivateHook("trl:GRPOTrainer", "_no_such_method", (), "a test", "trl 1.16")
    monkeypatch.setattr(_compat, "PRIVATE_HOOKS", (*PRIVATE_HOOKS, changed, gone))
    with pytest.raises(ImportError) as error:
        check_private_hooks()
    message = str(error.value)
    assert "GRPOTrainer._calculate_rewards" in message and "'renamed'" in message
    assert "GRPOTrainer._no_such_method is gone" in message and "pyproject.toml" in message
