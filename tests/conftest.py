"""Shared fixtures: tiny random models saved as 16-bit checkpoints."""

from __future__ import annotations

import os
import warnings

import torch


if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU machines; the switch is read when Triton is imported,
    # which transformers does early, so it has to be set before anything else is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from _tiny import ARCHITECTURES, tiny_model  # noqa: E402


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture
def bf16_checkpoint(tmp_path, arch):
    """(architecture, path) of a saved tiny 16-bit model."""
    path = tmp_path / f"{arch}-bf16"
    tiny_model(arch).save_pretrained(path)
    return arch, path


@pytest.fixture
def quiet_warnings():
    """Silences library warnings (deprecations, TRL's vLLM version notice) in end-to-end tests that use it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
