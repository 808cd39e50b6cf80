"""Shared fixtures: tiny random models saved as 16-bit checkpoints."""

from __future__ import annotations

import pytest
from _tiny import ARCHITECTURES, tiny_model


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture
def bf16_checkpoint(tmp_path, arch):
    """(architecture, path) of a saved tiny 16-bit model."""
    path = tmp_path / f"{arch}-bf16"
    tiny_model(arch).save_pretrained(path)
    return arch, path
