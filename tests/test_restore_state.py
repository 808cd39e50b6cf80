"""Library functions restore what they change (issue 11): the caller's tokenizer and model after an evaluation,
the process' warning filters, logger levels and progress-bar switches after the demo."""

import logging
import warnings

import pytest
import torch
from _tiny import tiny_model, tiny_tokenizer
from datasets import Dataset
from transformers.utils import logging as hf_logging

from trl_qerl.demo import quiet_libraries, run_demo
from trl_qerl.evaluation import evaluate_accuracy


def _model_and_tokenizer():
    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tokenizer), dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _problems():
    return Dataset.from_dict({"prompt": ["1+1=", "12+30="], "answer": ["2", "42"]})


def _evaluate(model, tokenizer):
    return evaluate_accuracy(
        model, tokenizer, _problems(), temperature=0.0, max_new_tokens=2, batch_size=2, progress=False
    )


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_evaluation_restores_the_callers_tokenizer_and_model(padding_side):
    model, tokenizer = _model_and_tokenizer()
    tokenizer.padding_side = padding_side
    model.train()
    model.model.layers[0].eval()  # a mixed mode comes back as it was, not as a blanket model.train()
    modes = [module.training for module in model.modules()]
    generation_config = model.generation_config.to_dict()

    result = _evaluate(model, tokenizer)

    assert result.num_problems == 2
    assert tokenizer.padding_side == padding_side
    assert [module.training for module in model.modules()] == modes
    assert model.generation_config.to_dict() == generation_config


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_evaluation_restores_the_tokenizer_when_generation_raises(padding_side, monkeypatch):
    model, tokenizer = _model_and_tokenizer()
    tokenizer.padding_side = padding_side
    model.train()
    seen = {}

    def failing_generate(*args, **kwargs):
        seen["padding_side"], seen["training"] = tokenizer.padding_side, model.training
        raise RuntimeError("generation failed")

    monkeypatch.setattr(model, "generate", failing_generate)
    with pytest.raises(RuntimeError, match="generation failed"):
        _evaluate(model, tokenizer)

    assert seen == {"padding_side": "left", "training": False}, "generation itself runs left-padded in eval mode"
    assert tokenizer.padding_side == padding_side
    assert model.training and all(module.training for module in model.modules())


def test_evaluation_lends_a_missing_pad_token_and_takes_it_back():
    model, tokenizer = _model_and_tokenizer()
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"

    _evaluate(model, tokenizer)

    assert tokenizer.pad_token is None and tokenizer.padding_side == "right"


def _process_state():
    return (
        list(warnings.filters),
        logging.getLogger().level,
        logging.getLogger("transformers").level,
        hf_logging.get_verbosity(),
        logging.getLogger("datasets").level,
        logging.root.manager.disable,
        hf_logging.is_progress_bar_enabled(),
    )


@pytest.fixture
def callers_process_state():
    """A caller with its own (non-default) warning filters and logger levels; put back after the test."""
    root, library = logging.getLogger().level, logging.getLogger("transformers").level
    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        logging.getLogger().setLevel(logging.INFO)
        hf_logging.set_verbosity_info()
        try:
            yield _process_state()
        finally:
            logging.getLogger().setLevel(root)
            logging.getLogger("transformers").setLevel(library)


def test_quiet_libraries_silences_inside_and_restores_after(callers_process_state):
    with quiet_libraries():
        assert warnings.filters[0][0] == "ignore"
        assert hf_logging.get_verbosity() == logging.ERROR
        # What the demo's Trainer and libraries may do on top, all undone on exit.
        hf_logging.set_verbosity_debug()
        logging.getLogger().setLevel(logging.CRITICAL)
        logging.getLogger("datasets").setLevel(logging.CRITICAL)
        logging.disable(logging.WARNING)
        hf_logging.disable_progress_bar()
        warnings.simplefilter("error")
    assert _process_state() == callers_process_state


def test_quiet_libraries_restores_after_an_exception(callers_process_state):
    with pytest.raises(KeyError), quiet_libraries():
        hf_logging.set_verbosity_debug()
        raise KeyError("boom")
    assert _process_state() == callers_process_state


def test_run_demo_restores_process_state_when_it_raises(tmp_path, callers_process_state):
    with pytest.raises(ValueError, match="quantization"):
        run_demo(tmp_path, steps=1, batch=8, eval_problems=1, quantization="bogus", verbose=False)
    assert _process_state() == callers_process_state


@pytest.mark.slow
def test_shortest_run_demo_restores_process_state(tmp_path, callers_process_state):
    # The smallest demo: 1 step of 8 completions (one prompt group), 1 held-out problem, 16-bit LoRA (skips the
    # NVFP4 kernels, which run in Triton's interpreter on CPU; the scoping is the same); ~20 s on 2 idle CPU cores.
    summary = run_demo(tmp_path, steps=1, batch=8, eval_problems=1, quantization="bf16", verbose=False)
    assert summary["steps"] == 1
    assert _process_state() == callers_process_state
