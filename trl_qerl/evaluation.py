"""Accuracy of a model (optionally base + LoRA adapter) on GSM8K / MATH-500-style data.

Sampling follows the paper's evaluation: temperature 0.6, top-p 0.95. Completions are scored with
the package's ``evaluate`` metric ``math_accuracy`` (shipped with the package, so it loads offline), which uses
`rewards.answers_match` (math-verify), the same check as the RL reward.
"""

from __future__ import annotations

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
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
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
    if was_training:
        model.train()
    metric = evaluate.load(str(resources.files("trl_qerl") / "metrics" / "math_accuracy"))
    return EvalResult(
        accuracy=metric.compute(predictions=predictions, references=references)["accuracy"],
        num_problems=len(rows),
        samples_per_problem=samples_per_problem,
        mean_completion_tokens=sum(lengths) / max(1, len(lengths)),
    )
