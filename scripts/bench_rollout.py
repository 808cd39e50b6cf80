"""Rollout throughput: TRL's default generate vs transformers' compiled static-cache generate vs our CUDA-graph
backend (bf16 + LoRA, and NVFP4 + LoRA + AQN) with each decode engine, all in one run on one GPU.

Engines of our backend (`StaticCacheGenerator(engine=..., compile=...)`): ``model`` calls the model's forward on a
transformers StaticCache; ``fused`` runs `FusedDecoder` eagerly; ``fused+compile`` compiles its layers;
``fused+compile+split_kv`` also takes the split-KV decode attention kernel instead of SDPA; ``+pdl`` launches the
NVFP4 decode kernel with Programmatic Dependent Launch. Each is
captured as a CUDA graph. ``--profile`` adds, per engine, the kernels of one (uncaptured) decode step at each of
``--profile-batches`` by name and category: the same kernels the graph replays; and the idle time between the kernels of
a few graph replays, by the pair of kernels around it.

Random weights at real Qwen2.5 shapes are built directly on the GPU (no checkpoint). Prompts of exactly
``--prompt-tokens`` random tokens, sampling at temperature 1 (random weights practically never emit EOS, so every
row decodes the full length). Reported: decode throughput (tokens/s over the timed call), ms per decode step, and
the one-off cost (compilation / graph capture + kernel choice) of the first call, separately.

Usage:
    python scripts/bench_rollout.py --model qwen2.5-7b --batches 1 8 32 --new-tokens 512 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import warnings
from pathlib import Path

import torch
from bench_settings import module_settings
from bench_twiddle import window_ms
from model_shapes import NAMES, qwen25_config, spread_eos
from transformers import AutoModelForCausalLM, GenerationConfig

from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.noise import NormNoise
from trl_qerl.nvfp4 import cuda_mma, cuda_wgmma, kernels
from trl_qerl.quantizer import quantize_model
from trl_qerl.rollout import fast, fused_decode
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator, nvfp4_codes


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def hf_generate(model, batch, prompt_tokens, new_tokens, vocab, static: bool):
    ids = torch.randint(3, vocab, (batch, prompt_tokens), device="cuda")
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    kwargs = {"cache_implementation": "static"} if static else {"disable_compile": True}
    return lambda: model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs
    )


def ours(generator, batch, prompt_tokens, new_tokens, vocab, eos=(1,), generations=1):
    """A timed call of ``generator``: ``batch`` rows of ``batch // generations`` distinct prompts, each repeated
    ``generations`` times in a row (GRPO's completions of one prompt)."""
    if batch % generations:
        raise SystemExit(f"--generations {generations} must divide every batch (got {batch})")
    distinct = torch.randint(3, vocab, (batch // generations, prompt_tokens)).tolist()
    prompts = [prompt for prompt in distinct for _ in range(generations)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)

    def call():
        torch.manual_seed(0)  # every call and engine draws the same lengths (until rows are compacted)
        return generator.generate(prompts, params, eos_token_ids=list(eos), pad_token_id=0)

    return call


_SDPA, _SPLIT = (
    dict(decode_attention="sdpa", compact_finished=False, twiddled_decode=False),
    dict(decode_attention="split_kv", compact_finished=False, twiddled_decode=False),
)
_TWIDDLE = {**_SPLIT, "twiddled_decode": True}
ENGINES = {"model": dict(engine="model", compile=False, compact_finished=False, twiddled_decode=False),
           "fused": dict(engine="fused", compile=False, **_SDPA),
           "fused+compile": dict(engine="fused", compile=True, **_SDPA),
           "fused+compile+split_kv": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+pdl": dict(engine="fused", compile=True, **_SDPA),
           "fused+compile+split_kv+pdl": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+compact": dict(engine="fused", compile=True, decode_attention="sdpa", compact_finished=True,
                                         twiddled_decode=False),
           "fused+compile+split_kv+lora_unfused": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+shrink_unfused": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+shrink_per_row": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+alt_choices": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+one_launch_attention": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+norm_shrink_before": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+shrink_settings": dict(engine="fused", compile=True, **_SPLIT),
           "fused+compile+split_kv+eager_prefill": dict(engine="fused", compile=True, capture_prefill=False, **_SPLIT),
           "fused+compile+split_kv+unshared_prefill": dict(engine="fused", compile=True, share_prefill=False,
                                                           capture_prefill=False, **_SPLIT),
           "fused+compile+split_kv+twiddle": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+add_in_layer": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+alt_choices": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+shrink_settings": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+lora_cublas": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+shrink_beside": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+shrink_beside_all_rows": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+lane_order": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+lane_order+shrink_beside": dict(engine="fused", compile=True, **_TWIDDLE),
           "fused+compile+split_kv+twiddle+lane_order+shrink_beside+group_sums": dict(engine="fused", compile=True,
                                                                                      **_TWIDDLE),
           "default": dict(engine="auto"),
           "default+narrow_wgmma": dict(engine="auto"),
           "default+wgmma_from_32": dict(engine="auto"),
           "default+tile_spread": dict(engine="auto"),
           "default+spread_64": dict(engine="auto"),
           "default+alt_choices": dict(engine="auto"),
           "default+own_choices": dict(engine="auto"),
           "default+eager_ends": dict(engine="auto"),
           "default+rotary_in_attention": dict(engine="auto"),
           "default+fused_shrink_16": dict(engine="auto"),
           "default+untimed_lora": dict(engine="auto"),
           "default+shrink_settings": dict(engine="auto"),
           "default+pdl": dict(engine="auto"),
           "default+pdl_rotary": dict(engine="auto"),
           "default+no_pdl": dict(engine="auto"),
           "default+plain_shrink": dict(engine="auto"),
           "default+plain_rotary": dict(engine="auto"),
           "default+pdl_depth2": dict(engine="auto"),
           "default+pdl_nc_activations": dict(engine="auto"),
           "default+pdl_evict_last": dict(engine="auto"),
           "default+pdl_l2": dict(engine="auto"),
           "default+pdl_l2_2": dict(engine="auto")}  # fmt: skip
"""Each engine names every switch, so that a changed default does not change what a name measures; ``default`` is
`StaticCacheGenerator`'s defaults (today split-KV attention on Hopper, compaction of steps of 32 rows or more).
``+pdl``: the step's own kernels launched with Programmatic Dependent Launch (`cuda_mma.PROGRAMMATIC` True while that
engine captures and runs; the other named engines launch without it): the NVFP4 decode kernel and, since 2026-12-07,
the rollout's Triton kernels (`rollout._pdl_kernel`; the ``fused+compile+pdl`` engines measured the NVFP4 kernel alone
on 2026-12-02). ``+compact``: rows still decoding move to a smaller step once at most half are left
(`StaticCacheGenerator(compact_finished=True)`; measure it with ``--eos-rate``). ``+lora_unfused``: LoRA terms
expanded by their own kernels instead of the NVFP4 kernel's epilogue (`fused_decode.LORA_EPILOGUE` False while that
engine compiles and captures; the default engines above add them in the epilogue). ``+shrink_unfused``: the LoRA
shrinks left to inductor, each a reduction of its own, instead of made with their input in one launch
(`fused_decode.FUSED_SHRINK` False while that engine compiles and captures). ``+shrink_per_row``: the fused shrinks
of the seventh session (one program per row and rank block, up to 8 rows; `_fused_shrink_kernel.ROWS_FROM` and
`fused_decode.FUSED_SHRINK_ROWS` set back while that engine compiles, captures and runs). ``+alt_choices``: the
NVFP4 kernel choices of ``--alt-choices`` (a table saved by ``bench_kernels.py --choices``) replace the shipped ones
for the keys they hold while that engine compiles, captures and runs: an A/B of two choice tables in one process
(``+twiddle+alt_choices``: the same in the twiddled build, against ``+twiddle``; ``default+alt_choices``: on the
generator's defaults, against ``default+own_choices``).
``+one_launch_attention``: the split-KV attention's partials merged by the partials launch itself
(`decode_attention.MERGE_IN_PARTIALS` True while that engine captures and runs; the other engines merge with a second
kernel). ``+norm_shrink_before``: the norm shrinks of the ninth session (each row in two passes, A loaded after the
statistics; `_fused_shrink_kernel.NORM_ONE_STEP` 0 and `NORM_ROWS` 1 while that engine captures). ``+shrink_settings``:
the `_fused_shrink_kernel` settings of ``--shrink-settings`` (``NAME=VALUE,...``) while that engine captures and
runs (``+twiddle+shrink_settings``: the same in the twiddled build, against ``+twiddle``; ``default+shrink_settings``:
on the generator's defaults, against ``default``). ``+eager_prefill``: the
prefill runs eagerly (``capture_prefill=False``; the other engines replay a CUDA graph per prefill shape up to
`fast.PREFILL_GRAPH_TOKENS` tokens). ``+unshared_prefill``: also every row prefilled, rows whose prompt repeats too
(``share_prefill=False``; the other engines prefill each distinct prompt once, which ``--generations`` exercises): the
eighth session's prefill. ``+twiddle``: the decode steps read the codes in the
twiddled bit order (``twiddled_decode=True``: codes permuted in place for the decode loop only, decode-kernel builds
with ``-DNVFP4_TWIDDLED=1``, up to `fast.TWIDDLE_MAX_ROWS` rows; the other named engines have it off, ``default``
has the generator's default, on for bf16 models). ``+add_in_layer``: each layer's last residual add made in the layer,
not by the next layer's input norm (`fused_decode.ADD_IN_NEXT_NORM` False while that engine compiles, captures and
runs; the default since 2026-12-04). ``+lora_cublas``: above the epilogue's 16 rows, LoRA products as fp32 cuBLAS
products and an add per projection, not `lora_rows`' two Triton launches per group (`fused_decode.LORA_ROW_KERNELS`
False while that engine compiles, captures and runs). ``+shrink_beside``: above the epilogue's 16 rows, each group's
LoRA shrink on a second stream beside its base products (`fused_decode.LORA_SHRINK_BESIDE` True while that engine
compiles, captures and runs). ``+shrink_beside_all_rows``: the same at every row count up to the row kernels' limit,
up to 16 rows in place of the norm shrinks and the NVFP4 epilogue (`fused_decode.LORA_BESIDE_MIN_ROWS` 1 too).
The other named engines have it off (``default``: the generator's default, on from `fused_decode.LORA_BESIDE_MIN_ROWS`
rows since 2026-12-05; the ``+shrink_beside`` engines take it from the row kernels' first row, 17, as they did when
they were measured). ``+lane_order``: the decode window holds the codes in the lane order, which the wgmma kernel reads
too, up to `fast.LANE_ORDER_MAX_ROWS` rows (`fast.LANE_ORDER` True while that engine captures, False for the other
named engines; captured states keep their order; the generator's default since 2026-12-05).
``+lane_order+shrink_beside``: both. ``+group_sums``: the row shrink sums its column spans' partials in groups
(`_lora_rows_kernel.GROUP_SPLITS` `GROUP_SUMS` while that engine captures and runs); the other named engines sum in one
level, as they did when they were measured (``default``: the shipped setting, groups of 8 since 2026-12-05).
``default+<suffix>`` for each suffix of `OWN_CHOICE_ENGINES` (``+narrow_wgmma``, ``+wgmma_from_32``,
``+tile_spread``, ``+spread_64``, ``+eager_ends``, ``+rotary_in_attention``, ``+fused_shrink_16``, ``+untimed_lora``,
``+pdl``, ``+pdl_rotary``, ``+no_pdl``, ``+plain_shrink``, ``+plain_rotary``, ``+pdl_depth2``, ``+pdl_nc_activations``,
``+pdl_evict_last``, ``+pdl_l2``, ``+pdl_l2_2``, ``+own_choices``): the generator's defaults (as ``default``; before
2026-12-06 these engines ran with the named engines' settings) with that suffix's settings while the engine runs, and
its own kernel choices: the chooser starts from the shipped table and forgets what that engine timed afterwards, so the
other engines time their keys themselves. Compare them with ``default+own_choices`` (no settings), not with
``default``, whose choices stay."""


SHIPPED_CHOICES = dict(kernels.CHOOSER.choices)
"""The kernel choices this process started with (the shipped table, ``NVFP4_KERNEL_CHOICES``), before any timing."""

PDL_DEPTH2_BUILD = (*cuda_mma.PDL_BUILD, "-DNVFP4_DEPTH=2")
"""The ``+pdl_depth2`` engines' PDL build of the NVFP4 decode kernel (`cuda_mma.PDL_BUILD` while they run): without
PDL, depths 2 and 3 measured no faster than the default 1 (2026-12-02); with PDL, the blocks loaded ahead are the loads
that overlap the kernel before."""

OWN_CHOICE_ENGINES = {
    "+narrow_wgmma": (cuda_wgmma, {"SPREAD_CANDIDATES": False}),
    "+wgmma_from_32": (kernels, {"WGMMA_ROWS": (32, kernels.WGMMA_ROWS[1])}),
    "+tile_spread": (cuda_mma, {"TILE_SPREAD_CANDIDATES": True}),
    "+spread_64": (cuda_wgmma, {"SPREAD_MAX_ROWS": 64}),
    "+eager_ends": (fused_decode, {"COMPILE_ENDS": False}),
    "+rotary_in_attention": (fused_decode, {"ROTARY_IN_ATTENTION": True}),
    "+fused_shrink_16": (fused_decode, {"FUSED_SHRINK_ROWS": 16}),
    "+untimed_lora": (kernels, {"TIME_WITH_LORA": False}),
    "+pdl": (cuda_mma, {"PROGRAMMATIC": True}),
    "+no_pdl": (cuda_mma, {"PROGRAMMATIC": False}),
    "+plain_shrink": (fused_decode, {"PLAIN_SHRINK": True}),
    "+pdl_rotary": ((cuda_mma, {"PROGRAMMATIC": True}), (fused_decode, {"ROTARY_IN_ATTENTION": True})),
    "+plain_rotary": (fused_decode, {"PLAIN_SHRINK": True, "ROTARY_IN_ATTENTION": True}),
    "+pdl_depth2": (cuda_mma, {"PDL_BUILD": PDL_DEPTH2_BUILD}),
    "+pdl_nc_activations": (cuda_mma, {"PDL_BUILD": (*cuda_mma.PDL_BUILD, "-DNVFP4_NC_ACTIVATIONS=1")}),
    "+pdl_evict_last": (cuda_mma, {"PDL_BUILD": (*cuda_mma.PDL_BUILD, "-DNVFP4_ACTIVATIONS_EVICT_LAST=1")}),
    "+pdl_l2": (cuda_mma, {"PDL_BUILD": (*cuda_mma.PDL_BUILD, "-DNVFP4_PDL_L2_BLOCKS=6")}),
    "+pdl_l2_2": (cuda_mma, {"PDL_BUILD": (*cuda_mma.PDL_BUILD, "-DNVFP4_PDL_L2_BLOCKS=2")}),
    "+own_choices": (kernels, {}),
}
"""Engine suffixes and the module settings (`module_settings`) that change which kernels the chooser times: without the wgmma kernel's spread
candidates (the candidates before 2026-12-06), with the wgmma kernel a candidate from the 32-row bucket, with the
tiled kernel's spread candidates (`cuda_mma.TILE_SPREAD_CANDIDATES`), with the wgmma kernel's spread candidates only up to
64 rows (`cuda_wgmma.SPREAD_MAX_ROWS` before 2026-12-06; ``+spread_128`` measured 128, now the default), with the decode step's ends and sampling eager (`fused_decode.COMPILE_ENDS` False, as before 2026-12-06; it
changes no kernel choice), with the rotary embedding
and the cache writes made in the attention's partials launch (`fused_decode.ROTARY_IN_ATTENTION` True; no kernel choice
either), with the fused norm and SiLU·up shrinks up to 16 rows (`fused_decode.FUSED_SHRINK_ROWS` 16: measured slower
at 16 rows on 2026-12-02, before the norm shrinks' rank blocks of 2026-12-06 took 9.2 / 6.6 instead of 11.5 / 8.2 µs
at 14B; no kernel choice), with the plain choice taken for a launch with LoRA terms without timing the epilogue against
it (`kernels.TIME_WITH_LORA` False, as before 2026-12-07), with the step's own kernels launched with Programmatic
Dependent Launch (`cuda_mma.PROGRAMMATIC`; the kernels it times run so too), the same with the rotary embedding
and the cache writes in the attention's partials launch (which then follows the NVFP4 q/k/v product, a PDL kernel, not
inductor's rotary kernel), with no kernel launched so (the default before 2026-12-07: `cuda_mma.PROGRAMMATIC` False;
the default launches up to `cuda_mma.PDL_MAX_ROWS` rows so), with the o projection's LoRA shrink in our own launch
(`fused_decode.PLAIN_SHRINK`), the same with the rotary embedding and the cache writes in the attention's
partials launch (at up to `cuda_mma.PDL_MAX_ROWS` rows every kernel of a layer is then a PDL launch of ours), with the
NVFP4 decode kernel's PDL build loading two 128-column blocks of weights ahead instead of one (`PDL_DEPTH2_BUILD`, so
that twice the weights are in flight before it waits for the kernel before it), with the PDL build's activations
loaded through the non-coherent path, as before 2026-12-07 (~0.1 ms a step faster at batch 8 on an H100, but ptxas may
move those loads above the wait: a race; never the default), with the PDL build's coherent activation loads
marked to stay in L1 longest (``ld.global.L1::evict_last``, ``NVFP4_ACTIVATIONS_EVICT_LAST``: every warp re-reads
them, and the weights already bypass L1; no faster at batch 1 and 8 on an H100, 2026-12-07), with that build asking
for a warp's next 6 or 2 blocks of weights into L2 before it waits (``NVFP4_PDL_L2_BLOCKS``: at 7B, 6 is every block
of the q/k/v, o and gate/up products' warps at one row and a third of down's), and none (the control). A suffix takes
one ``(module, settings)`` pair or a tuple of them."""

GROUP_SUMS = 8
"""Spans per group of the ``+group_sums`` engines' row shrink (the value measured and shipped on 2026-12-05)."""


def twiddled_agreement(model, engine: str, batch: int, prompt_tokens: int, vocab: int, steps: int = 32) -> dict:
    """Greedy tokens of the same prompts from ``engine`` with its codes twiddled and a copy of it without: the share of
    identical tokens, the first step that differs per row, and the largest log-prob difference of a token both drew
    before any difference (products differ only in the order of fp32 sums, so the first tokens agree unless a tie
    flips; a kernel misreading the twiddled codes would agree with almost nothing)."""
    prompts = torch.randint(3, vocab, (batch, prompt_tokens)).tolist()
    params = SamplingParams(max_new_tokens=steps, temperature=0.0)
    samples = [StaticCacheGenerator(model, **{**ENGINES[engine], "twiddled_decode": twiddled}).sample(
               prompts, params, eos_token_ids=[1], pad_token_id=0) for twiddled in (False, True)]  # fmt: skip
    standard, twiddled = (sample.completion_ids for sample in samples)
    standard_lp, twiddled_lp = (sample.logprobs for sample in samples)
    first = [next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), None) for s, t in zip(standard, twiddled)]
    pairs = [(a, b) for s, t in zip(standard, twiddled) for a, b in zip(s, t)]
    gaps = [abs(a - b) for row, (s_lp, t_lp) in enumerate(zip(standard_lp, twiddled_lp))
            for a, b in list(zip(s_lp, t_lp))[: first[row]]]  # fmt: skip
    window = window_ms(nvfp4_codes(model), lanes=fast.LANE_ORDER)  # (the order this engine's window holds)
    return {"identical": sum(a == b for a, b in pairs) / max(len(pairs), 1), "first_difference": first,
            "max_logprob_gap": max(gaps, default=0.0), "window_ms": window}  # fmt: skip


@contextlib.contextmanager
def engine_environment(engine: str, alt_choices: str | None = None, shrink_settings: str | None = None):
    """The settings of ``engine`` (see `ENGINES`) while the block runs: ``LORA_EPILOGUE = False`` for the
    ``+lora_unfused`` engines and ``FUSED_SHRINK = False`` for the ``+shrink_unfused`` ones (read when a layer
    compiles), per-row shrinks for the ``+shrink_per_row`` ones, the split-KV merge in the partials launch for the
    ``+one_launch_attention`` ones (read at each call: captured graphs keep it), the table ``alt_choices`` over the
    kernel choices for the ``+alt_choices`` ones (read at each uncaptured call; captured graphs keep the launch), the
    shrink kernels' settings for the ``+norm_shrink_before`` and ``+shrink_settings``
    ones (read at each launch: captured graphs keep them), ``ADD_IN_NEXT_NORM = False`` for the ``+add_in_layer``
    ones (read when a layer compiles and at each uncaptured step), ``LORA_ROW_KERNELS = False`` for the ``+lora_cublas``
    ones (read when a layer compiles and at each uncaptured step), ``LORA_SHRINK_BESIDE`` True from 17 rows for the
    ``+shrink_beside`` ones, from 1 row (``LORA_BESIDE_MIN_ROWS``) for the ``+shrink_beside_all_rows`` ones and False
    for the other named ones (the same), ``fast.LANE_ORDER`` True for the ``+lane_order`` ones and False for the other
    named ones (read when a decode state is captured), the row shrink's ``GROUP_SPLITS`` `GROUP_SUMS` for the
    ``+group_sums`` ones and 0 for the other named ones (read at each launch: captured graphs keep it),
    ``fused_decode.ROTARY_IN_ATTENTION`` False for the named ones (read when a layer compiles) and
    ``cuda_mma.PROGRAMMATIC`` True for their ``+pdl`` ones, False for the others (read at each launch); ``default``
    keeps the generator's settings; else unchanged."""
    from trl_qerl.rollout import _fused_shrink_kernel as shrink_kernels  # needs Triton
    from trl_qerl.rollout import _lora_rows_kernel as row_shrink
    from trl_qerl.rollout import decode_attention

    pdl, epilogue, shrink = engine.endswith("+pdl"), fused_decode.LORA_EPILOGUE, fused_decode.FUSED_SHRINK
    shrink_rows, rows_from = fused_decode.FUSED_SHRINK_ROWS, shrink_kernels.ROWS_FROM
    alternative = engine.endswith("+alt_choices")
    own = next((settings for suffix, settings in OWN_CHOICE_ENGINES.items() if engine.endswith(suffix)), None)
    shipped = dict(kernels.CHOOSER.choices) if alternative or own is not None else None
    if own is not None:
        kernels.CHOOSER.choices.clear()
        kernels.CHOOSER.choices.update(SHIPPED_CHOICES)
    if alternative:
        if alt_choices is None:
            raise SystemExit(f"engine {engine!r} needs --alt-choices FILE (a table saved by bench_kernels.py)")
        kernels.CHOOSER.load(alt_choices)
    fused_decode.LORA_EPILOGUE = epilogue and not engine.endswith("+lora_unfused")
    fused_decode.FUSED_SHRINK = shrink and not engine.endswith("+shrink_unfused")
    add_in_next_norm = fused_decode.ADD_IN_NEXT_NORM
    fused_decode.ADD_IN_NEXT_NORM = add_in_next_norm and not engine.endswith("+add_in_layer")
    row_kernels = fused_decode.LORA_ROW_KERNELS
    fused_decode.LORA_ROW_KERNELS = row_kernels and not engine.endswith("+lora_cublas")
    beside, beside_rows = fused_decode.LORA_SHRINK_BESIDE, fused_decode.LORA_BESIDE_MIN_ROWS
    group_splits, rotary_in_attention = row_shrink.GROUP_SPLITS, fused_decode.ROTARY_IN_ATTENTION
    programmatic = cuda_mma.PROGRAMMATIC
    on_defaults = engine.split("+")[0] == "default"  # ``default`` and its own-choice variants
    if not on_defaults:  # named engines measure what they measured before these became defaults
        switches = engine.split("+")
        all_rows = "shrink_beside_all_rows" in switches
        fused_decode.LORA_SHRINK_BESIDE = all_rows or "shrink_beside" in switches
        fused_decode.LORA_BESIDE_MIN_ROWS = 1 if all_rows else fused_decode.LORA_REDUCTION_ROWS + 1
        row_shrink.GROUP_SPLITS = GROUP_SUMS if "group_sums" in switches else 0
        fused_decode.ROTARY_IN_ATTENTION = False
        cuda_mma.PROGRAMMATIC = pdl
    if engine.endswith("+shrink_per_row"):
        fused_decode.FUSED_SHRINK_ROWS, shrink_kernels.ROWS_FROM = 8, 1 << 30
    lane_order = fast.LANE_ORDER
    fast.LANE_ORDER = lane_order if on_defaults else "+lane_order" in engine
    merge_in_partials = decode_attention.MERGE_IN_PARTIALS
    decode_attention.MERGE_IN_PARTIALS = merge_in_partials or engine.endswith("+one_launch_attention")
    try:
        with (
            module_settings(shrink_kernels, _shrink_settings(engine, shrink_settings)),
            contextlib.ExitStack() as own_settings,
        ):
            for module, settings in _setting_pairs(own):
                own_settings.enter_context(module_settings(module, settings))
            yield
    finally:
        decode_attention.MERGE_IN_PARTIALS = merge_in_partials
        fast.LANE_ORDER = lane_order
        fused_decode.LORA_EPILOGUE, fused_decode.FUSED_SHRINK = epilogue, shrink
        fused_decode.ADD_IN_NEXT_NORM = add_in_next_norm
        fused_decode.LORA_ROW_KERNELS = row_kernels
        fused_decode.LORA_SHRINK_BESIDE, fused_decode.LORA_BESIDE_MIN_ROWS = beside, beside_rows
        row_shrink.GROUP_SPLITS, fused_decode.ROTARY_IN_ATTENTION = group_splits, rotary_in_attention
        cuda_mma.PROGRAMMATIC = programmatic
        fused_decode.FUSED_SHRINK_ROWS, shrink_kernels.ROWS_FROM = shrink_rows, rows_from
        if alternative or own is not None:
            kernels.CHOOSER.choices.clear()
            kernels.CHOOSER.choices.update(shipped)


def _setting_pairs(own) -> tuple:
    """The ``(module, settings)`` pairs of an `OWN_CHOICE_ENGINES` entry (one pair or a tuple of them; none for
    None)."""
    if own is None:
        return ()
    return own if isinstance(own[0], tuple) else (own,)


def _shrink_settings(engine: str, settings: str | None) -> dict[str, int]:
    """`_fused_shrink_kernel` settings an engine runs with (see `ENGINES`)."""
    if engine.endswith("+norm_shrink_before"):
        return {"NORM_ONE_STEP": 0, "NORM_ROWS": 1}
    if not engine.endswith("+shrink_settings"):
        return {}
    if settings is None:
        raise SystemExit(
            f"engine {engine!r} needs --shrink-settings NAME=VALUE,... (settings of _fused_shrink_kernel)"
        )
    from bench_fused_shrink import parse_settings

    return parse_settings(settings)


def category(kernel: str) -> str:
    """Coarse kind of a CUDA kernel, by name (for the decode-step time split)."""
    name = kernel.lower()
    if name.startswith(("triton_", "cpp_fused")):  # inductor names fusions after the ops they feed
        return "elementwise / norms / glue"
    if "nvfp4" in name:
        return "NVFP4 matmul"
    if "splitk_reduce" in name:  # our Triton split-K epilogue (cuBLAS's is `splitKreduce_kernel`)
        return "NVFP4 split-K reduce"
    if any(key in name for key in ("fmha", "attention", "flash", "attn")):
        return "attention"
    if any(key in name for key in ("gemv", "gemm", "cutlass", "xmma", "sm90_", "splitkreduce", "cublas")):
        return "cuBLAS (LoRA, lm_head, bf16 weights)"
    if any(key in name for key in ("argmax", "sort", "topk", "exponential", "uniform", "distribution", "softmax",
                                   "log_softmax", "isin", "cunn_")):  # fmt: skip
        return "sampling"
    return "elementwise / norms / glue"


@contextlib.contextmanager
def rewound_state(generator, steps: int):
    """``generator``'s decode state of its last call, ``steps`` positions back (so that as many steps stay inside the
    cache and the output buffers), with the codes and builds its step was captured for. (Private state, read in this
    one place: trl-qerl 2026-12-03.)"""
    state = next(iter(generator._states.values()))
    state.cache_position.fill_(int(state.cache_position) - steps)
    state.step_index.fill_(1)
    with generator._twiddled(state):
        yield state


def profile_step(generator, label, rows):
    """Kernels of one eager decode step of ``generator``'s current state (batch and shape of its last call)."""
    from torch.profiler import ProfilerActivity, profile

    with rewound_state(generator, 2) as state:
        state.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            state.step()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    split, names = {}, {}
    for event in events:
        kind = category(event.name)
        split.setdefault(kind, [0, 0.0])
        split[kind][0] += 1
        split[kind][1] += event.device_time_total
        names.setdefault(event.name, [0, 0.0])
        names[event.name][0] += 1
        names[event.name][1] += event.device_time_total
    total = sum(t for _, t in split.values())
    print(f"\nprofile {label}: {len(events)} kernels, {total / 1e3:.2f} ms of kernel time per decode step")
    print("| category | kernels | ms |\n|---|---|---|")
    for kind, (count, time_us) in sorted(split.items(), key=lambda item: -item[1][1]):
        print(f"| {kind} | {count} | {time_us / 1e3:.3f} |")
    top = sorted(names.items(), key=lambda item: -item[1][1])[:12]
    for name, (count, time_us) in top:
        print(f"  {time_us / 1e3:7.3f} ms {count:5d}x {name[:110]}")
    rows.append({"profile": label, "kernels": len(events), "kernel_ms": total / 1e3,
                 "split": {k: {"kernels": c, "ms": t / 1e3} for k, (c, t) in split.items()},
                 "kernels_by_name": [{"name": n, "count": c, "ms": t / 1e3, "kind": category(n)}
                                     for n, (c, t) in sorted(names.items(), key=lambda item: -item[1][1])]})  # fmt: skip


def kernel_gaps(kernels: list[tuple[str, float, float]], replays: int) -> dict | None:
    """``{"kernels", "span", "idle", "overlap", "gaps", "widest", "times", "calls"}`` of ``replays`` equal steps'
    ``(name, start, end)`` kernels (µs, in start order), each the median over the steps (one step's hiccup, such as
    the profiler's own start, does not count as the step's cost): the time from a step's first start to its last end;
    each kernel's start against the latest end before it in its step, summed per step by the pair of names around it
    (negative: it overlapped), with their positive and negative sums; ``widest``, each pair's largest sum in any one
    step (far above its median: an outlier); and each kernel's own time and calls per step by its name with the names
    of the kernels before and after it (``(before, name, after)``; that tells apart the products one instance makes:
    q/k/v comes between a norm and the rotary, gate/up between a norm and the SiLU). None when a step has fewer than
    two kernels or the count does not split into equal steps."""
    per_step, extra = divmod(len(kernels), replays)
    if per_step < 2 or extra:
        return None
    step_gaps, step_times, calls, spans = [], [], {}, []
    for first in range(0, len(kernels), per_step):
        step = kernels[first : first + per_step]
        gaps, times, latest_end = {}, {}, step[0][2]
        spans.append(max(end for _, _, end in step) - step[0][1])
        afters = [name for name, _, _ in step[2:]] + [""]
        for (before, _, _), (name, start, end), after in zip(step, step[1:], afters):
            pair, around = (before, name), (before, name, after)
            gaps[pair] = gaps.get(pair, 0.0) + start - latest_end
            times[around] = times.get(around, 0.0) + end - start
            calls[around] = calls.get(around, 0) + 1
            latest_end = max(latest_end, end)
        step_gaps.append(gaps)
        step_times.append(times)
    gaps, times = _median_by_key(step_gaps), _median_by_key(step_times)
    return {"kernels": per_step, "span": _median(spans),
            "idle": sum(g for g in gaps.values() if g > 0), "overlap": -sum(g for g in gaps.values() if g < 0),
            "gaps": dict(sorted(gaps.items(), key=lambda item: -abs(item[1]))),
            "widest": {pair: max(step.get(pair, 0.0) for step in step_gaps) for pair in gaps},
            "times": dict(sorted(times.items(), key=lambda item: -item[1])),
            "calls": {pair: count // replays for pair, count in calls.items()}}  # fmt: skip


def _median(values: list[float]) -> float:
    """The middle value (of an even count, the later of the two)."""
    return sorted(values)[len(values) // 2]


def _median_by_key(per_step: list[dict]) -> dict:
    """Each key's `_median` over the steps' dicts, a key a step lacks counting 0 there (two kernels that start at the
    same time may sort either way)."""
    keys = dict.fromkeys(key for step in per_step for key in step)
    return {key: _median([step.get(key, 0.0) for step in per_step]) for key in keys}


def _print_step_ends(events: list, per_step: int, shown: int = 3) -> None:
    """The first and last ``shown`` kernels of the second replayed step (start against the step's first start,
    duration; names in full, which `kernel_gaps` cuts), and the time between steps: the graph launch's own gap, which
    the decode loop pays as well unless the host runs ahead."""
    if len(events) < 2 * per_step:
        return
    step = events[per_step : 2 * per_step]
    origin = step[0].time_range.start
    for event in step[:shown] + step[-shown:]:
        print(f"  at {event.time_range.start - origin:8.1f} µs for {event.time_range.end - event.time_range.start:6.1f}"
              f" µs: {event.name[:110]}")  # fmt: skip
    between = [events[first].time_range.start - max(e.time_range.end for e in events[first - per_step : first])
               for first in range(per_step, len(events), per_step)]  # fmt: skip
    print(f"  between steps: {', '.join(f'{gap:.1f}' for gap in between)} µs idle")


def profile_replay(generator, label, rows, replays: int = 5, top: int = 10):
    """Where the captured decode step's wall time goes between its kernels (`kernel_gaps` of ``replays`` graph
    replays). Kernel time alone (`profile_step`) cannot tell a change that adds idle time between kernels from one
    that does not."""
    from torch.profiler import ProfilerActivity, profile

    with rewound_state(generator, replays + 2) as state:
        if state.graph is None:
            return
        state.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                state.replay()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    kernels = [(e.name[:40], e.time_range.start, e.time_range.end) for e in events]
    found = kernel_gaps(kernels, replays)
    if found is None:
        print(f"\nreplay {label}: {len(kernels)} kernels in {replays} replays do not split into steps")
        return
    print(f"\nreplay {label}: {found['kernels']} kernels, {found['span'] / 1e3:.2f} ms from first start to last end "
          f"per step; {found['idle'] / 1e3:.3f} ms idle between kernels, {found['overlap'] / 1e3:.3f} ms overlapped")  # fmt: skip
    for (before, after), gap in list(found["gaps"].items())[:top]:
        print(f"  {gap:8.1f} µs  {before} -> {after} (widest in one step: {found['widest'][before, after]:.1f} µs)")
    _print_step_ends(events, found["kernels"])
    print("  kernel time per step by the kernels before and after it:")
    for (before, name, after), time_us in list(found["times"].items())[:top]:
        calls = found["calls"][before, name, after]
        print(f"  {time_us:8.1f} µs  {calls:4d}x {name} ({before} -> · -> {after}): {time_us / calls:.2f} µs a call")
    rows.append({"replay": label, "kernels": found["kernels"], "span_ms": found["span"] / 1e3,
                 "idle_ms": found["idle"] / 1e3, "overlap_ms": found["overlap"] / 1e3,
                 "gaps_us": [{"before": b, "after": a, "us": g, "widest_us": found["widest"][b, a]}
                             for (b, a), g in found["gaps"].items()],
                 "times_us": [{"before": b, "name": n, "after": a, "us": t, "calls": found["calls"][b, n, a]}
                              for (b, n, a), t in found["times"].items()]})  # fmt: skip


SHORT_CALL_REPEATS = 5
"""Timed calls of the one- and two-token calls of ``--prefill`` (after the first), of which the median counts: one
timing of such a call varied by ~10 ms on an H100 (2026-12-07), as much as a 128-token call's whole decode window."""


def measure(name, make_call, batch, new_tokens, rows, repeat_first=True, count_tokens=False, repeats=1):
    """Time ``make_call`` (twice unless ``repeat_first`` is False; with ``repeats`` > 1, the first call and then the
    median of ``repeats`` more). ``count_tokens``: the call returns completions whose lengths vary (EOS spread):
    tokens/s counts what was generated, ms/step divides by the longest row."""
    try:
        first, _ = timed(make_call)
        if repeat_first:
            times = [timed(make_call) for _ in range(max(1, repeats))]
            seconds, completions = sorted(times, key=lambda timing: timing[0])[len(times) // 2]
        else:
            seconds, completions = first, None
    except Exception as error:  # noqa: BLE001 - one failing configuration must not hide the others
        print(f"{name} batch {batch}: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
        return
    lengths = [len(c) for c in completions] if count_tokens else [new_tokens] * batch
    tokens, steps = sum(lengths), max(lengths)
    row = {"backend": name, "batch": batch, "new_tokens": new_tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / steps,
           "first_call_extra_s": first - seconds}  # fmt: skip
    if count_tokens:
        row |= {"mean_length": tokens / batch, "max_length": steps}
    rows.append(row)
    spread = f" (lengths: mean {row['mean_length']:.0f}, longest {steps})" if count_tokens else ""
    print(f"| {name}{spread} | {batch} | {row['tokens_per_s']:.0f} | {row['ms_per_step']:.2f} | "
          f"{row['first_call_extra_s']:.1f} |", flush=True)  # fmt: skip
    return row


def decode_alone(full, prefill_only, two_tokens=None) -> None:
    """Decode step without the call's fixed part: ``(t(n tokens) - t(1 token)) / (n - 1)`` from a full call and a
    prefill-only call (one new token) of the same path and batch, both timed in this run; added to the full call's
    row. With ``two_tokens``, a call of two new tokens timed alike, also the step without what a rollout pays once
    from its first decode step on (the decode window's weight reordering, which a one-token call skips):
    ``(t(n) - t(2)) / (n - 2)``, and that once-per-rollout part, ``t(2) - t(1)`` less one such step."""
    if full is None or prefill_only is None or full["new_tokens"] < 2:
        return
    ms = 1e3 * (full["seconds"] - prefill_only["seconds"]) / (full["new_tokens"] - 1)
    full |= {"decode_ms_per_step": ms, "prefill_ms": 1e3 * prefill_only["seconds"]}
    split = ""
    if two_tokens is not None and full["new_tokens"] > 2:
        steady = 1e3 * (full["seconds"] - two_tokens["seconds"]) / (full["new_tokens"] - 2)
        once = 1e3 * (two_tokens["seconds"] - prefill_only["seconds"]) - steady
        full |= {"decode_ms_per_step_after_first": steady, "once_per_rollout_ms": once}
        split = f" ({steady:.2f} ms from the second step on; once per rollout {once:.1f} ms)"
    print(f"|   {full['backend']}: decode step alone {ms:.2f} ms{split}, prefill + first draw "
          f"{1e3 * prefill_only['seconds']:.1f} ms | {full['batch']} | | | |", flush=True)  # fmt: skip


def profile_call(call, label, rows):
    """Host and device time of one whole generator call (prefill, state set-up, first draw, ...) by operator: what a
    rollout costs besides its decode steps."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - start)
    averages = prof.key_averages()
    by_host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:15]
    by_device = sorted(averages, key=lambda e: -e.self_device_time_total)[:15]
    print(f"\nprofile of one call, {label}: {wall_ms:.1f} ms wall (under the profiler)")
    print("| op (by host time) | calls | self host ms | self device ms |\n|---|---|---|---|")
    for event in by_host:
        print(f"| {event.key[:80]} | {event.count} | {event.self_cpu_time_total / 1e3:.2f} | "
              f"{event.self_device_time_total / 1e3:.2f} |")  # fmt: skip
    for event in by_device:
        print(f"  device {event.self_device_time_total / 1e3:7.2f} ms {event.count:5d}x {event.key[:100]}")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time_total for e in kernels) / 1e3
    print(f"  {len(kernels)} kernels, {device_ms:.1f} ms of kernel time")
    rows.append({"profile_call": label, "wall_ms": wall_ms, "kernels": len(kernels), "kernel_ms": device_ms,
                 "host": [{"op": e.key, "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1e3,
                           "self_device_ms": e.self_device_time_total / 1e3} for e in by_host],
                 "device": [{"op": e.key, "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3}
                            for e in by_device]})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--trl-new-tokens", type=int, default=64, help="TRL's default path is slow: fewer steps")
    parser.add_argument("--compiled-batches", nargs="*", type=int, default=[8], help="batches for the compiled HF run")
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=1e-2, help="AQN noise on the NVFP4 run")
    parser.add_argument("--engines", nargs="+", default=["model", "fused", "fused+compile"], choices=list(ENGINES))
    parser.add_argument("--skip-bf16", action="store_true", help="measure only the NVFP4 model")
    parser.add_argument("--profile", action="store_true", help="kernel profile of one decode step per engine")
    parser.add_argument("--profile-batches", nargs="+", type=int, default=[1], help="batches that --profile profiles")
    parser.add_argument("--eos-rate", type=float, default=0.0,
                        help="also run each batch with this share of the vocabulary ending completions (a length "
                        "spread: what rows that finish early still cost)")  # fmt: skip
    parser.add_argument("--prefill", action="store_true",
                        help="also time a prefill-only call (one new token) and a two-token call per path and batch "
                        "of our engines, and from them the decode step alone: (full call - prefill-only call) / (new "
                        "tokens - 1), and from the second step on: (full call - two-token call) / (new tokens - 2)")  # fmt: skip
    parser.add_argument("--generations", type=int, default=1,
                        help="rows per distinct prompt in our engines' calls (GRPO's num_generations; must divide "
                        "every batch); 1: every prompt distinct")  # fmt: skip
    parser.add_argument("--profile-prefill", action="store_true",
                        help="profile one prefill-only call (one new token) per engine and batch, host and device")  # fmt: skip
    parser.add_argument("--lora-reduction-rows", type=int, default=None,
                        help="set fused_decode.LORA_REDUCTION_ROWS for this process: up to this many rows the "
                        "compiled step writes LoRA products as fused reductions, above it as matmuls")  # fmt: skip
    parser.add_argument("--shrink-settings", default=None, metavar="SETTINGS",
                        help="_fused_shrink_kernel settings (NAME=VALUE,...) of the +shrink_settings engine")  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument("--choices", default=None,
                        help="save this GPU's kernel choices made during the run here (merged into the file if it exists)")  # fmt: skip
    parser.add_argument("--alt-choices", default=None, metavar="FILE",
                        help="kernel choices (saved by bench_kernels.py --choices) for the +alt_choices engines")  # fmt: skip
    args = parser.parse_args()
    if args.lora_reduction_rows is not None:
        fused_decode.LORA_REDUCTION_ROWS = args.lora_reduction_rows  # read when a layer compiles: before any engine
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    # one process compiles the decode layer for every engine, arm and batch (a training run: one engine, one arm)
    torch._dynamo.config.recompile_limit = 64

    config = qwen25_config(args.model)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    vocab, rows = config.vocab_size, []
    print(f"Rollouts, {args.model} shapes (random weights), {args.prompt_tokens}-token prompts, temperature 1; "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("| backend | batch | tokens/s | ms/step | first-call extra s |\n|---|---|---|---|---|")
    for batch in args.batches:
        measure("TRL default generate, bf16", hf_generate(model, batch, args.prompt_tokens, args.trl_new_tokens, vocab, False),
                batch, args.trl_new_tokens, rows, repeat_first=False)  # fmt: skip
    for batch in args.compiled_batches:
        name = "transformers static-cache compiled, bf16"
        full = measure(name, hf_generate(model, batch, args.prompt_tokens, args.new_tokens, vocab, True), batch,
                       args.new_tokens, rows)  # fmt: skip
        if args.prefill:
            alone = measure(f"{name}, prefill only", hf_generate(model, batch, args.prompt_tokens, 1, vocab, True),
                            batch, 1, rows, repeats=SHORT_CALL_REPEATS)  # fmt: skip
            decode_alone(full, alone)

    def run_engines(model, label, context):
        for engine in args.engines:
            twiddled = ENGINES[engine].get("twiddled_decode")
            generator = StaticCacheGenerator(model, **ENGINES[engine])
            with context(), engine_environment(engine, args.alt_choices, args.shrink_settings):
                if twiddled and nvfp4_codes(model):
                    agreement = twiddled_agreement(model, engine, max(args.batches), args.prompt_tokens, vocab)
                    rows.append({"backend": f"ours ({engine}), {label}", "greedy_agreement": agreement})
                    print(f"{engine}, {label}: greedy tokens with twiddled vs standard codes: "
                          f"{agreement['identical']:.1%} identical; first difference per row {agreement['first_difference']}; "
                          f"largest log-prob gap before it {agreement['max_logprob_gap']:.2e}; "
                          f"window (permute in and out) {agreement['window_ms']:.1f} ms",
                          flush=True)  # fmt: skip
                for batch in args.batches:
                    full = measure(f"ours ({engine}), {label}", ours(generator, batch, args.prompt_tokens,
                                   args.new_tokens, vocab, generations=args.generations), batch, args.new_tokens,
                                   rows)  # fmt: skip
                    if args.eos_rate > 0:
                        eos = spread_eos(vocab, args.eos_rate)
                        measure(f"ours ({engine}), {label}, EOS rate {args.eos_rate:g}", ours(generator, batch,
                                args.prompt_tokens, args.new_tokens, vocab, eos), batch, args.new_tokens, rows,
                                count_tokens=True)  # fmt: skip
                    if args.prefill:  # one new token: the prompt's prefill and the first sample, nothing else
                        alone = measure(f"ours ({engine}), {label}, prefill only", ours(generator, batch,
                                        args.prompt_tokens, 1, vocab, generations=args.generations), batch, 1,
                                        rows, repeats=SHORT_CALL_REPEATS)  # fmt: skip
                        two = measure(f"ours ({engine}), {label}, two tokens", ours(generator, batch,
                                      args.prompt_tokens, 2, vocab, generations=args.generations), batch, 2,
                                      rows, repeats=SHORT_CALL_REPEATS)  # fmt: skip
                        decode_alone(full, alone, two)
                    if args.profile_prefill:
                        profile_call(ours(generator, batch, args.prompt_tokens, 1, vocab, generations=args.generations),
                                     f"{engine}, {label}, batch {batch}, prefill only", rows)  # fmt: skip
                for batch in args.profile_batches if args.profile else ():
                    ours(generator, batch, args.prompt_tokens, 8, vocab)()
                    profile_step(generator, f"{engine}, {label}, batch {batch}", rows)
                    try:  # a profiler failure must not cost the rest of the run's measurements
                        profile_replay(generator, f"{engine}, {label}, batch {batch}", rows)
                    except Exception as error:  # noqa: BLE001
                        print(f"replay profile FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
            print(f"graph captures ({engine}): {generator.captures}; compactions: {generator.compactions}", flush=True)
            del generator
            torch.cuda.empty_cache()

    peft_model = get_peft_model(model, nvfp4_lora_config(model, r=args.lora_r, train_norms=False))
    if not args.skip_bf16:
        run_engines(peft_model, f"bf16 + LoRA r{args.lora_r}", contextlib.nullcontext)
    model = quantize_model(peft_model.unload())  # drop the bf16 adapters, then NVFP4 in place
    del peft_model
    torch.cuda.empty_cache()
    peft_model = get_peft_model(model, nvfp4_lora_config(model, r=args.lora_r, train_norms=False))
    noise = NormNoise(peft_model, seed=0)
    noise.set_step(1, args.sigma)
    run_engines(peft_model, f"NVFP4 + LoRA r{args.lora_r} + AQN", noise.rollout)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if args.choices:
        kernels.CHOOSER.save(args.choices, device=torch.cuda.get_device_name(), merge=True)


if __name__ == "__main__":
    main()
