"""A small model for the AQN study: a reasoning-gym task where sampling carries realistic entropy.

The shipped tiny model samples at 0.03-0.05 nats per token, so noise in its weights barely changes its rollouts
(BENCHMARKS.md). This script builds one whose samples at temperature 1 carry >= 0.3 nats per completion token and
whose accuracy RL can move, on reasoning-gym's ``chain_sum`` (3-4 terms of one digit, or up to two; scored by the task itself):

* ``data`` (needs reasoning-gym): the held-out test problems (reasoning-gym's test seed), and supervised
  demonstrations of fresh training problems (never a test problem). Each demonstration is a varied but valid chain
  of thought (left-to-right partial sums, or positives and negatives gathered first, or the whole sum at once, with
  varied connectives), and in ``SLIP_RATE`` of them one partial result is off by a few (a careless teacher) and the
  answer follows the slip: the model learns several ways to the answer and some uncertainty in its digits, which is
  what sampling explores and what an accuracy reward can sharpen;
* ``tokenizer``: a byte-level BPE tokenizer with single-digit tokens and a chat template;
* ``model``: a small Qwen2-architecture model (dimensions multiples of 16: every projection quantises to NVFP4)
  trained on the demonstrations, on a CPU or a GPU; then greedy and sampled held-out accuracy and the mean entropy
  per sampled completion token at temperature 1 are measured and written to ``stats.json``.

Usage:
    python scripts/pretrain_explore.py --stages data tokenizer model --output benchmarks/aqn_study/model
    python scripts/pretrain_explore.py --max-digits 2 --output benchmarks/aqn_study/model-2digit --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from pretrain_tiny import MODEL, save_tokenizer, supervised_step


TASK = "chain_sum"
TASK_OPTIONS = dict(min_terms=3, max_terms=4, min_digits=1, max_digits=1)  # --max-digits changes the last
SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, then write the final answer inside "
    "<answer> </answer>."
)  # trl_qerl.reasoning_gym.SYSTEM_PROMPT, spelled out so the model stage needs neither package
SLIP_RATE = 0.3
CONNECTIVES = ("", "so ", "then ", "next ")
OUTPUT = Path(__file__).resolve().parents[1] / "benchmarks" / "aqn_study" / "model"


def parse_terms(expression: str) -> list[int]:
    """``"15 - 43 + 7"`` -> ``[15, -43, 7]``."""
    tokens = expression.split()
    terms, sign = [int(tokens[0])], 1
    for token in tokens[1:]:
        if token in "+-":
            sign = 1 if token == "+" else -1
        else:
            terms.append(sign * int(token))
    return terms


def _fmt(a: int, b: int) -> str:
    return f"{a} + {b}" if b >= 0 else f"{a} - {-b}"


def demonstration(terms: list[int], rng: random.Random) -> tuple[str, int]:
    """A worked solution of ``sum(terms)`` in one of three styles, with a slip (``SLIP_RATE``); returns the text
    and the answer it ends with."""
    slip_at = rng.randrange(len(terms) - 1) if rng.random() < SLIP_RATE else -1
    slip = rng.choice([-1, 1]) * rng.randint(1, 9)
    style = rng.randrange(3)
    steps = []
    if style == 2:  # all at once
        total = sum(terms) + (slip if slip_at >= 0 else 0)
        expression = str(terms[0]) + "".join(f" + {t}" if t >= 0 else f" - {-t}" for t in terms[1:])
        steps.append(f"{expression} = {total}.")
    else:
        if style == 1:  # positives first, then the negatives
            terms = sorted(terms, key=lambda t: t < 0)
        total = terms[0]
        for index, term in enumerate(terms[1:]):
            result = total + term + (slip if index == slip_at else 0)
            steps.append(f"{rng.choice(CONNECTIVES)}{_fmt(total, term)} = {result}.")
            total = result
    return f"<think>{' '.join(steps)}</think> <answer>{total}</answer>", total


def write_data(output: Path, seed: int, examples: int, test_size: int) -> None:
    import reasoning_gym

    output.mkdir(parents=True, exist_ok=True)
    # the task the model is for: scripts/reproduce_aqn.py reads it
    (output / "task.json").write_text(json.dumps({"task": TASK, "options": TASK_OPTIONS}, indent=2) + "\n")
    test = reasoning_gym.create_dataset(TASK, size=test_size, seed=seed + 2_000_003, **TASK_OPTIONS)
    held_out = {entry["question"] for entry in test}
    with open(output / "test.jsonl", "w") as handle:
        for entry in test:
            handle.write(json.dumps({"question": entry["question"], "answer": entry["answer"]}) + "\n")
    train = reasoning_gym.create_dataset(TASK, size=examples * 2, seed=seed + 7, **TASK_OPTIONS)
    rng, written = random.Random(seed), 0
    with open(output / "demonstrations.jsonl", "w") as handle:
        for entry in train:
            if entry["question"] in held_out:
                continue
            text, _ = demonstration(parse_terms(entry["metadata"]["expression"]), rng)
            handle.write(json.dumps({"question": entry["question"], "solution": text}) + "\n")
            written += 1
            if written == examples:
                break
    print(f"data: {written} demonstrations, {len(held_out)} held-out problems -> {output}")


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def write_tokenizer(output: Path, vocab_size: int = 320) -> None:
    rows = read_jsonl(output / "demonstrations.jsonl")[:5000]
    save_tokenizer([SYSTEM_PROMPT] + [row["question"] + "\n" + row["solution"] for row in rows], output, vocab_size)


def prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def held_out_stats(model, tokenizer, test: list[dict], samples: int = 4, max_new_tokens: int = 64) -> dict:
    """Greedy and sampled (T=1) accuracy on ``test`` and the mean entropy per sampled completion token."""
    import torch

    device = next(model.parameters()).device
    model.eval()
    greedy_right = sampled_right = entropy_sum = tokens = 0
    for start in range(0, len(test), 50):
        rows = test[start : start + 50]
        encoded = [prompt_ids(tokenizer, row["question"]) for row in rows]
        width = max(map(len, encoded))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded], device=device)
        mask = (ids != tokenizer.pad_token_id).long()
        for do_sample in (False, True):
            repeat = samples if do_sample else 1
            with torch.no_grad():
                out = model.generate(input_ids=ids.repeat_interleave(repeat, 0), max_new_tokens=max_new_tokens,
                                     attention_mask=mask.repeat_interleave(repeat, 0), do_sample=do_sample,
                                     temperature=1.0 if do_sample else None, top_p=1.0, top_k=0,
                                     pad_token_id=tokenizer.pad_token_id, output_scores=do_sample,
                                     return_dict_in_generate=True)  # fmt: skip
            completions = out.sequences[:, width:]
            for index, completion in enumerate(completions):
                text = tokenizer.decode(completion, skip_special_tokens=True)
                answer = text.rsplit("<answer>", 1)[-1].split("</answer>")[0].strip() if "<answer>" in text else None
                right = answer == rows[index // repeat]["answer"]
                if do_sample:
                    sampled_right += right
                else:
                    greedy_right += right
            if do_sample:
                live = (completions != tokenizer.pad_token_id).float()
                for step, scores in enumerate(out.scores):
                    logp = torch.log_softmax(scores.float(), dim=-1)
                    entropy_sum += (-(logp.exp() * logp).sum(-1) * live[:, step]).sum().item()
                tokens += live.sum().item()
    return {"greedy_accuracy": greedy_right / len(test), "sampled_accuracy": sampled_right / (len(test) * samples),
            "entropy_per_token": entropy_sum / max(tokens, 1), "problems": len(test), "samples": samples}  # fmt: skip


def train_model(output: Path, seed: int, steps: int, learning_rate: float, batch_size: int, device: str) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(output)
    rows = read_jsonl(output / "demonstrations.jsonl")
    if len(rows) < steps * batch_size:
        raise SystemExit(f"{len(rows)} demonstrations for {steps} x {batch_size}: rerun the data stage with more")
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **MODEL)  # fmt: skip
    model = Qwen2ForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.05)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        pairs = []
        for row in rows[step * batch_size : (step + 1) * batch_size]:
            prompt = prompt_ids(tokenizer, row["question"])
            completion = tokenizer(row["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            pairs.append((prompt + completion, [-100] * len(prompt) + completion))
        loss = supervised_step(model, optimizer, scheduler, pairs, tokenizer.pad_token_id)
        if step % 250 == 0 or step == steps - 1:
            print(f"step {step}/{steps} loss {loss:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    train_seconds = time.perf_counter() - start
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = True
    stats = held_out_stats(model, tokenizer, read_jsonl(output / "test.jsonl")[:200])
    stats.update(steps=steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed, device=device,
                 train_seconds=round(train_seconds, 1), parameters=sum(p.numel() for p in model.parameters()))  # fmt: skip
    model.to("cpu", torch.bfloat16).save_pretrained(output)
    (output / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=["data", "tokenizer", "model"],
                        choices=["data", "tokenizer", "model"])  # fmt: skip
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=64000, help="demonstrations written by the data stage")
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-digits", type=int, default=1, help="digits per term (benchmarks/aqn_study: 1 and 2)")
    args = parser.parse_args()
    TASK_OPTIONS["max_digits"] = args.max_digits
    if "data" in args.stages:
        write_data(args.output, args.seed, args.examples, args.test_size)
    if "tokenizer" in args.stages:
        write_tokenizer(args.output)
    if "model" in args.stages:
        train_model(args.output, args.seed, args.steps, args.learning_rate, args.batch_size, args.device)


if __name__ == "__main__":
    main()
