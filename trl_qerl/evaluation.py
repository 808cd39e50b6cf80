"""Accuracy of a model (optionally base + LoRA adapter) on GSM8K / MATH-500-style data.

Sampling follows the paper's evaluation: temperature 0.6, top-p 0.95. Completions are scored with
the package's ``evaluate`` metric ``math_accuracy`` (shipped with the package, so it loads offline), which uses
`rewards.answers_match` (math-verify), the same check as the RL reward.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources

import evaluate
import torch
from datasets import Dataset
from tqdm.auto import tqdm


@dataclass
class EvalResult:
    """Accuracy over ``num_problems`` problems x ``samples_per_problem`` samples."""

    accuracy: float
    num_problems: int
    samples_per_problem: int
    mean_completion_tokens: float

    def as_dict(self) -> dict[str, float]:
        return {
            "accuracy": self.accuracy,
            "num_problems": self.num_problems,
            "samples_per_problem": self.samples_per_problem,
            "mean_completion_tokens": self.mean_completion_tokens,
        }


@torch.no_grad()
def evaluate_accuracy(
    model,
    tokenizer,
    dataset: Dataset,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 1024,
    samples_per_problem: int = 1,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> EvalResult:
    """Sample completions for every ``prompt`` of ``dataset`` and score them against its ``answer`` column.

    ``temperature=0`` decodes greedily.
    """
    for column in ("prompt", "answer"):
        if column not in dataset.column_names:
            raise ValueError(f"The evaluation dataset needs a '{column}' column; it has {dataset.column_names}.")
    torch.manual_seed(seed)
    with _restored_caller_state(model, tokenizer):
        predictions, references, lengths, rows = _sample(
            model, tokenizer, dataset, temperature, top_p, max_new_tokens, samples_per_problem, batch_size, progress
        )
    metric = evaluate.load(str(resources.files("trl_qerl") / "metrics" / "math_accuracy"))
    return EvalResult(
        accuracy=metric.compute(predictions=predictions, references=references)["accuracy"],
        num_problems=len(rows),
        samples_per_problem=samples_per_problem,
        mean_completion_tokens=sum(lengths) / max(1, len(lengths)),
    )


@contextmanager
def _restored_caller_state(model, tokenizer) -> Iterator[None]:
    """Left padding, a pad token and eval mode for generation; the caller's settings come back on exit, raise or not.

    Restored: the tokenizer's ``padding_side`` and ``pad_token``, every submodule's ``training`` flag (a model the
    caller left partly in train mode comes back exactly so), and the contents of ``model.generation_config``.
    """
    padding_side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    modes = [(module, module.training) for module in model.modules()]
    generation_config = getattr(model, "generation_config", None)
    generation_state = copy.deepcopy(generation_config.__dict__) if generation_config is not None else None
    try:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.eval()
        yield
    finally:
        tokenizer.padding_side = padding_side
        if tokenizer.pad_token != pad_token:
            tokenizer.pad_token = pad_token
        for module, training in modes:
            module.training = training
        if generation_config is not None and generation_config.__dict__ != generation_state:
            generation_config.__dict__.clear()
            generation_config.__dict__.update(generation_state)


def _sample(model, tokenizer, dataset, temperature, top_p, max_new_tokens, samples_per_problem, batch_size, progress):
    """(predictions, references, completion lengths, rows): the sampling loop of `evaluate_accuracy`."""
    device = next(model.parameters()).device
    predictions, references, lengths = [], [], []
    sampling = dict(do_sample=temperature > 0, temperature=temperature or None, top_p=top_p if temperature else None)
    rows = list(dataset)
    eos = tokenizer.eos_token_id
    for start in tqdm(range(0, len(rows), batch_size), desc="Evaluating", disable=not progress):
        batch = rows[start : start + batch_size]
        texts = [
            tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            if isinstance(row["prompt"], list)
            else row["prompt"]
            for row in batch
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        outputs = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            num_return_sequences=samples_per_problem,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            **sampling,
        )
        completions = outputs[:, inputs["input_ids"].shape[1] :]
        for index, completion in enumerate(completions):
            row = batch[index // samples_per_problem]
            ids = completion.tolist()
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids
            lengths.append(len(ids))
            predictions.append(tokenizer.decode(ids, skip_special_tokens=True))
            references.append(str(row["answer"]))
    return predictions, references, lengths, rows
