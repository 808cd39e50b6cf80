"""Shared fixtures: tiny random models saved as 16-bit checkpoints."""

from __future__ import annotations

import logging
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


class _CompileFallbacks(logging.Handler):
    """Collects the fused decoder's "compiling ... failed; running it eagerly" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "compiling the fused decode step failed" in record.getMessage():
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_compile_fallback_on_cuda(request):
    """On CUDA, a test whose compiled decode step fell back to eager layers fails. The fallback keeps every number
    right (it is there so that rollouts never stop), so only this catches a change that breaks compilation; one did
    in the twentieth session, and the engine ran 1.5x slower while every test passed. A test that breaks the compile
    on purpose says so with ``@pytest.mark.compile_fallback_expected``."""
    if not torch.cuda.is_available() or request.node.get_closest_marker("compile_fallback_expected"):
        yield
        return
    handler = _CompileFallbacks()
    logger = logging.getLogger("trl_qerl.rollout.fused_decode")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    assert not handler.messages, handler.messages[0]
