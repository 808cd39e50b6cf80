"""Build the embedded default: a synthetic reasoning task, its tokenizer, and a tiny supervised model.

Stages (each seeded and reproducible; outputs go to ``trl_qerl/assets/tiny`` unless ``--output`` says otherwise):

* ``data``: multi-step arithmetic word problems with a chain of thought and a verifiable answer, split into
  train / test by problem (no test problem appears in training);
* ``tokenizer``: a byte-level BPE tokenizer (digits kept as single tokens) with a chat template;
* ``model``: a small Qwen2-architecture model (all dimensions multiples of 16, so every projection quantises to
  NVFP4) trained by supervised learning on fresh worked problems (never a held-out one), leaving room for RL.

The supervised solutions carry a planted bad habit, like noisy demonstrations: in ``HABIT_RATE`` of them the chain
of thought is right but the final answer repeats the *first* intermediate result. The model learns the arithmetic
from the chains and the habit as a coin flip: its greedy chains are right on 95% of held-out problems, yet it
answers only 0.53 of them correctly (39% of answers sampled at temperature 1), so RL with an accuracy reward has
something it can fix in a few minutes on a CPU. Models without the habit, or whose chains were often wrong, did not
improve measurably in that time (BENCHMARKS.md, "The embedded default").

Runtime: the ``model`` stage takes about 16 minutes on 2 CPU cores (1,500 steps of 32 problems, 1.72 M parameters);
``data`` and ``tokenizer`` take seconds. The shipped model came from the defaults below (seed 0).

Usage:
    python scripts/pretrain_tiny.py --stages data tokenizer model
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from trl_qerl.data import TINY_SYSTEM_PROMPT


ASSETS = Path(__file__).resolve().parents[1] / "trl_qerl" / "assets" / "tiny"
SYSTEM_PROMPT = TINY_SYSTEM_PROMPT  # one prompt for pretraining, RL and evaluation
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


HABIT_RATE = 0.5


def with_habit(row: dict, rng: random.Random) -> str:
    """The supervised target: the clean solution, or (HABIT_RATE of the time) one answering the first step."""
    steps = row["solution"].split("</think>")[0].removeprefix("<think>").split(". ")
    first_result = steps[0].split("= ")[-1].rstrip(".")
    if rng.random() >= HABIT_RATE or first_result == row["answer"]:
        return row["solution"]
    return row["solution"].replace(f"<answer>{row['answer']}</answer>", f"<answer>{first_result}</answer>")


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
    train = read_split(output, "train")
    save_tokenizer([SYSTEM_PROMPT] + [row["question"] + "\n" + row["solution"] for row in train], output, vocab_size)


def save_tokenizer(corpus: list[str], output: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (digits kept as single tokens) with the chat template, trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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


MODEL = dict(
    hidden_size=192,  # multiples of 16 everywhere: every projection quantises to NVFP4
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)


def _chat(tokenizer, question: str, solution: str | None = None):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if solution is None:
        return prompt_ids
    completion_ids = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


def greedy_accuracy(model, tokenizer, output: Path) -> float:
    """Fraction of the held-out problems in ``output`` whose greedy answer is right (the RL reward's check)."""
    from trl_qerl.data import build_math_dataset
    from trl_qerl.evaluation import evaluate_accuracy

    test = build_math_dataset(output / "arithmetic_test.jsonl", split="test", kind="tiny", system_prompt=SYSTEM_PROMPT)
    result = evaluate_accuracy(model, tokenizer, test, temperature=0.0, max_new_tokens=48, batch_size=50,
                               progress=False)  # fmt: skip
    return result.accuracy


def supervised_examples(tokenizer, count: int, held_out: set[str], seed: int) -> list[tuple[list[int], list[int]]]:
    """``count`` fresh worked problems (never a held-out one) as (tokens, labels) pairs.

    Fresh problems rather than epochs over the shipped training split: with 4,000 problems seen 8 times the model
    memorised them and got a third of held-out chains wrong, too many for a few minutes of RL to get past.
    """
    rng, habit_rng = random.Random(seed + 1), random.Random(seed)
    examples = []
    while len(examples) < count:
        row = make_problem(rng)
        if row["question"] in held_out:
            continue
        prompt_ids, completion_ids = _chat(tokenizer, row["question"], with_habit(row, habit_rng))
        examples.append((prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids))
    return examples


def supervised_step(model, optimizer, scheduler, pairs: list[tuple[list[int], list[int]]], pad_id: int) -> float:
    """One optimizer step on (tokens, labels) pairs, right-padded into a batch on the model's device; the loss."""
    import torch

    width = max(len(tokens) for tokens, _ in pairs)
    ids = torch.full((len(pairs), width), pad_id)
    labels = torch.full((len(pairs), width), -100)
    for row, (tokens, targets) in enumerate(pairs):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, : len(targets)] = torch.tensor(targets)
    device = next(model.parameters()).device
    ids, labels = ids.to(device), labels.to(device)
    loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != pad_id), labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def train_model(output: Path, seed: int, steps: int, learning_rate: float, batch_size: int) -> None:
    import time

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(output)
    test = read_split(output, "test")
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **MODEL)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    examples = supervised_examples(tokenizer, steps * batch_size, {row["question"] for row in test}, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.05)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        loss = supervised_step(model, optimizer, scheduler, examples[step * batch_size : (step + 1) * batch_size],
                               tokenizer.pad_token_id)  # fmt: skip
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step}/{steps} loss {loss:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = True
    accuracy = greedy_accuracy(model, tokenizer, output)
    model.to(torch.bfloat16).save_pretrained(output)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {steps} steps in "
          f"{time.perf_counter() - start:.0f} s, held-out greedy accuracy {accuracy:.3f} -> {output}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=["data", "tokenizer", "model"],
                        choices=["data", "tokenizer", "model"])  # fmt: skip
    parser.add_argument("--output", type=Path, default=ASSETS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps, each on fresh problems")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    if "data" in args.stages:
        write_data(args.output, args.seed)
    if "tokenizer" in args.stages:
        write_tokenizer(args.output)
    if "model" in args.stages:
        train_model(args.output, args.seed, args.steps, args.learning_rate, args.batch_size)


if __name__ == "__main__":
    main()
