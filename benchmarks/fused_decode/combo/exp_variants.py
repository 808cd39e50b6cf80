"""The harness that produced this folder's variant rows (provenance, not project code).

It runs ``scripts/bench_rollout.py`` with one change patched into the compiled decode layer, chosen by the
``VARIANT`` environment variable (parts joined by ``_``): ``cdt`` (inductor coordinate-descent tuning), ``combo``
(inductor combo kernels), ``nocudnn`` (cuDNN SDPA off), ``flex`` (FlexAttention for the decode step), ``texp`` /
``tshr`` (LoRA expand / shrink written output-transposed). Run from the repository root with ``scripts`` on the path:

    VARIANT=combo PYTHONPATH=$PWD:$PWD/scripts python benchmarks/fused_decode/combo/exp_variants.py x \
        --model qwen2.5-7b --batches 1 8 --new-tokens 256 --trl-new-tokens 1 --compiled-batches \
        --engines fused+compile --skip-bf16 --profile --profile-batches 8 --json out.json

(``x`` is a placeholder first argument that the harness drops.) The shipped code took ``combo`` only:
`trl_qerl.rollout.fused_decode.COMPILE_OPTIONS`.
"""

import os
import sys

import bench_rollout
import torch
from torch.nn.attention.flex_attention import flex_attention

from trl_qerl.rollout import fused_decode as fd


VARIANT = os.environ.get("VARIANT", "base")
OPTIONS = {"emulate_precision_casts": True}
if "cdt" in VARIANT:
    OPTIONS["coordinate_descent_tuning"] = True
if "combo" in VARIANT:
    OPTIONS["combo_kernels"] = True


def compiled_layer():
    return torch.compile(fd.decoder_layer, fullgraph=True, options=dict(OPTIONS))


SDPA_ATTENTION = fd.attention


def flex_decode_attention(q, keys, values, mask, scaling):
    if not torch.compiler.is_compiling() or q.shape[2] != 1:
        return SDPA_ATTENTION(q, keys, values, mask, scaling)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + mask[b, 0, q_idx, kv_idx].float()

    return flex_attention(q, keys, values, score_mod=score_mod, scale=scaling, enable_gqa=True)


def transposed_lora(x, projections, outputs):
    for index, projection in enumerate(projections):
        if not projection.lora:
            continue
        update = 0
        for term in projection.lora:
            xa = x.to(term.lora_a.dtype)
            if "tshr" in VARIANT:
                hidden = (term.lora_a[:, None, :] * xa[None]).sum(-1).T
            else:
                hidden = (xa[:, None, :] * term.lora_a[None]).sum(-1)
            if "texp" in VARIANT:
                update = update + (term.lora_b[:, None, :] * hidden[None]).sum(-1).T * term.scaling
            else:
                update = update + (hidden[:, None, :] * term.lora_b[None]).sum(-1) * term.scaling
        outputs[index] = (outputs[index] + update).to(x.dtype)
    return outputs


def main() -> None:
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    fd._compiled_layer = compiled_layer
    if "nocudnn" in VARIANT:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "flex" in VARIANT:
        fd.attention = flex_decode_attention
    if "texp" in VARIANT or "tshr" in VARIANT:
        fd._add_lora_as_reductions = transposed_lora
    print("VARIANT", VARIANT, OPTIONS, flush=True)
    bench_rollout.main()


if __name__ == "__main__":
    main()
