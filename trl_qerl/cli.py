"""The ``trl-qerl`` command.

Subcommands:
    quantize   quantise a 16-bit checkpoint to a compressed-tensors NVFP4 checkpoint (vLLM-loadable)
    demo       the embedded default: runs offline on CPU in seconds
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _quantize(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trl-qerl quantize",
        description="Quantise a 16-bit causal LM to NVFP4 (W4A16) and save it as a compressed-tensors checkpoint.",
    )
    parser.add_argument("model", help="Hub id or local directory of a 16-bit checkpoint")
    parser.add_argument("output_dir", help="where to write the NVFP4 checkpoint")
    parser.add_argument("--device", default=None, help="device to quantise on (default: cuda if available, else cpu)")
    parser.add_argument(
        "--keep", nargs="*", default=None, metavar="MODULE", help="extra Linear modules to keep in 16-bit"
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from .loading import from_pretrained
    from .quantizer import NVFP4Config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = from_pretrained(
        args.model, quantization_config=NVFP4Config(modules_to_not_convert=args.keep), device_map=device
    )
    model.save_pretrained(args.output_dir)
    try:
        AutoTokenizer.from_pretrained(args.model).save_pretrained(args.output_dir)
    except (OSError, ValueError):
        print(f"note: no tokenizer found next to {args.model}; copy it to {args.output_dir} yourself")
    print(f"wrote NVFP4 checkpoint to {args.output_dir}")
    return 0


def _demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "quantize": (_quantize, "quantise a 16-bit checkpoint to NVFP4 (compressed-tensors)"),
    "demo": (_demo, "offline demo on an embedded model (no GPU, no network)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: trl-qerl <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
