"""How the shipped tiny model answers: the failure modes RL has to work with.

Samples ``--generations`` completions for each of ``--prompts`` training problems and sorts every completion into:
correct; the planted habit (chain right, answer = first intermediate result); chain right but another answer;
chain wrong; no answer. Also prints how many correct completions each prompt's group got (GRPO learns only from
groups that are neither all right nor all wrong).

Usage:
    python scripts/diagnose_tiny.py [--temperature 1.0] [--prompts 48] [--generations 8] [--split train]
    python scripts/diagnose_tiny.py --temperature 0 --generations 1 --split test --prompts 40   # greedy
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
from transformers import AutoTokenizer

from trl_qerl import from_pretrained
from trl_qerl.data import tiny_arithmetic_dataset, tiny_assets


def classify(text: str, answer: str) -> str:
    found = re.search(r"<answer>(.*?)</answer>", text)
    given = found.group(1).strip() if found else None
    results = re.findall(r"= (\d+)\.", text)
    chain_right = bool(results) and results[-1] == answer
    if given == answer:
        return "correct"
    if given is None:
        return "no answer"
    if chain_right and given == results[0]:
        return "habit (chain right, answer = first step)"
    return "chain right, other answer" if chain_right else "chain wrong"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(tiny_assets()), help="model directory (default: the shipped one)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--split", choices=["train", "test"], default="train")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets(), padding_side="left")
    model = from_pretrained(args.model, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    modes, groups = collections.Counter(), collections.Counter()
    for row in tiny_arithmetic_dataset(args.split, limit=args.prompts):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"].repeat(args.generations, 1)  # fmt: skip
        with torch.no_grad():
            out = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=args.temperature > 0,
                temperature=args.temperature or None,
                max_new_tokens=48,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        kinds = [
            classify(text, row["answer"])
            for text in tokenizer.batch_decode(out[:, prompt.shape[1] :], skip_special_tokens=True)
        ]
        modes.update(kinds)
        groups[kinds.count("correct")] += 1
    total = sum(modes.values())
    print(f"| completion (T={args.temperature}, {args.prompts} prompts x {args.generations}) | share |\n|---|---|")
    for kind, count in modes.most_common():
        print(f"| {kind} | {count / total:.1%} |")
    print("correct completions per group:", dict(sorted(groups.items())))


if __name__ == "__main__":
    main()
