"""Build the embedded default: a synthetic reasoning task, its tokenizer, and a tiny supervised model.

Stages (each seeded and reproducible; outputs go to ``trl_qerl/assets/tiny`` unless ``--output`` says otherwise):

* ``data``: multi-step arithmetic word problems with a chain of thought and a verifiable answer, split into
  train / test by problem (no test problem appears in training);
* ``tokenizer``: a byte-level BPE tokenizer (digits kept as single tokens) with a chat template;
* ``model``: a small Qwen2-architecture model (all dimensions multiples of 16, so every projection quantises to
  NVFP4) trained by supervised learning on the worked solutions until it solves a minority of held-out problems,
  leaving room for RL.

Usage:
    python scripts/pretrain_tiny.py --stages data tokenizer model
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


ASSETS = Path(__file__).resolve().parents[1] / "trl_qerl" / "assets" / "tiny"
SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, then write the final number inside "
    "<answer> </answer>."
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = ["Tom", "Ann", "Bob", "Eve", "Max", "Mia", "Sam", "Zoe", "Leo", "Ivy", "Ben", "Amy"]
ITEMS = ["apples", "marbles", "coins", "books", "cards", "pens", "shells", "stamps"]
GAINS = ["gets {n} more", "finds {n} more", "buys {n} more", "is given {n} more"]
LOSSES = ["loses {n}", "gives away {n}", "sells {n}", "drops {n}"]


def make_problem(rng: random.Random) -> dict:
    """One problem: a start amount and two or three changes, every intermediate amount non-negative."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    amount = rng.randint(2, 20)
    sentences = [f"{name} has {amount} {item}."]
    steps = []
    for index in range(rng.choice((2, 3))):
        change = rng.randint(1, 9)
        if rng.random() < 0.5 or change > amount:
            phrase, result, op = rng.choice(GAINS).format(n=change), amount + change, "+"
        else:
            phrase, result, op = rng.choice(LOSSES).format(n=change), amount - change, "-"
        sentences.append(f"{'Then ' if index else ''}{name} {phrase}.")
        steps.append(f"{amount} {op} {change} = {result}.")
        amount = result
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    solution = f"<think>{' '.join(steps)}</think> <answer>{amount}</answer>"
    return {"question": question, "solution": solution, "answer": str(amount)}


def make_splits(seed: int = 0, train_size: int = 4000, test_size: int = 200) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < train_size + test_size:
        problem = make_problem(rng)
        if problem["question"] not in seen:
            seen.add(problem["question"])
            problems.append(problem)
    return problems[test_size:], problems[:test_size]


def write_data(output: Path, seed: int) -> None:
    train, test = make_splits(seed)
    output.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        with open(output / f"arithmetic_{split}.jsonl", "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    print(f"data: {len(train)} train / {len(test)} test problems -> {output}")


def read_split(output: Path, split: str) -> list[dict]:
    with open(output / f"arithmetic_{split}.jsonl") as handle:
        return [json.loads(line) for line in handle]


def write_tokenizer(output: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train = read_split(output, "train")
    corpus = [SYSTEM_PROMPT] + [row["question"] + "\n" + row["solution"] for row in train]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(output)
    config_path = output / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # Name the class explicitly: next to a qwen2 config.json, transformers would otherwise pick Qwen2's
    # tokenizer class and re-normalise this vocabulary.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    print(f"tokenizer: {len(wrapped)} tokens -> {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=["data", "tokenizer", "model"],
                        choices=["data", "tokenizer", "model"])  # fmt: skip
    parser.add_argument("--output", type=Path, default=ASSETS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "data" in args.stages:
        write_data(args.output, args.seed)
    if "tokenizer" in args.stages:
        write_tokenizer(args.output)
    if "model" in args.stages:
        raise SystemExit("the model stage is not written yet")


if __name__ == "__main__":
    main()
