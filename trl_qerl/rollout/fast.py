"""Fast rollouts without vLLM: a static KV cache and a CUDA-graphed decode step.

gpt-fast's recipe on transformers' own machinery:

* prompts are left-padded into a `transformers.StaticCache` sized ``prompt + max_new_tokens`` (rounded up);
* prefill runs eagerly; one decode step (model forward on one token per row, logits filtering, a draw, EOS
  bookkeeping, advancing positions) works entirely in place on fixed buffers, so on CUDA it is captured once as a
  CUDA graph and replayed for every token: no per-token host work but the replay launch and an "all finished?"
  check every ``check_every`` steps;
* attention masks are passed ready-made in 4D, so no mask-building code with host synchronisation runs inside the
  graph;
* in steps of 32 rows or more (``compact_finished``, fused step only), rows still decoding move to a smaller
  captured step once at most half of them are left: the smaller step works on the first rows of the same KV cache,
  so it needs no new memory but its token buffers, and each size is captured once.

The decode step itself is `fused_decode.FusedDecoder` where the model is a Llama/Mistral/Qwen2/Qwen3 (its layers
recomputed over the model's tensors, read in place by `decoder_spec.read_decoder`; on CUDA each layer compiled once,
~640 kernels per 7B step instead of ~2,900), else the model's own forward on a transformers `StaticCache`.

CUDA graphs are captured from the step directly rather than through ``torch.compile(mode="reduce-overhead")``:
capture takes about a second, where compiling transformers' whole 7B decode step costs 30-50 s for every new shape.
The fused step compiles one decoder layer (one graph serves every layer, a few seconds); the first change of
batch or cache length compiles once more with dynamic sizes, later shape buckets only capture again.

Everything the graph reads lives in fixed storage updated in place: LoRA weights (the optimizer), norm weights
(the optimizer and AQN noise), the KV cache. Replays therefore see the current adapters and the current noise
draw. If a parameter or buffer moves (``param.data = ...``, a device round trip), the next rollout notices and
captures again instead of replaying a graph that reads freed memory. NVFP4 layers run the `trl_qerl::nvfp4_linear`
custom op inside the graph.

While decode steps run (bf16 NVFP4 models on CUDA, at most `LANE_ORDER_MAX_ROWS` rows), the NVFP4 codes are held in
the lane order (`trl_qerl.nvfp4.twiddle.to_lane_order`): permuted in place before the decode loop and restored after
it, so the CUDA decode, tiled and wgmma kernels need fewer instructions per weight while everything else (prefill,
training, checkpoints) sees the standard order. With `LANE_ORDER` off they are held in the twiddled bit order instead,
which only the decode and tiled kernels read, up to `TWIDDLE_MAX_ROWS` rows. A product that only a standard-order
kernel serves raises inside that window, and the generator then logs once and decodes in the standard order from then
on.

Sampling follows transformers' order and semantics: temperature, top-k, top-p, min-p, then a draw from the
filtered distribution (``temperature=0`` decodes greedily).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import torch
from transformers import StaticCache

from ..nvfp4 import cuda_wgmma, twiddle
from ..nvfp4.linear import NVFP4A16Linear
from . import fused_decode
from .decoder_spec import UnsupportedDecoder, read_decoder
from .fused_decode import DECODE_ATTENTION, FusedDecoder
from .generate import TransformersRollout, sampling_params
from .sampling import SamplingParams, draw_with_stats, filter_logits, sample_tokens, sample_with_stats, uniform_draws


__all__ = ["FastRollout", "SamplingParams", "Samples", "StaticCacheGenerator", "filter_logits", "nvfp4_codes", "sample_tokens",
           "sample_with_stats"]  # fmt: skip


logger = logging.getLogger(__name__)
T = TypeVar("T")


def cache_argument(model) -> str:
    """Name of the KV-cache argument of the model's forward: ``cache`` in recent transformers (which deprecates
    ``past_key_values``), ``past_key_values`` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations the model-forward path can feed a ready-made 4D mask."""
ENGINES = ("auto", "fused", "model")


TWIDDLE_MAX_ROWS = 32
"""Largest batch whose decode steps read the twiddled codes where `LANE_ORDER` is off (`StaticCacheGenerator`'s
``twiddled_decode``): up to here the CUDA decode and tiled kernels compute the NVFP4 products of the step (measured
gain on the H200, 7B, 2026-12-03: 3-5 % of the decode step at batch 1, 8 and 32); from 64 rows the wgmma kernel and
dequantise + cuBLAS, which do not read the twiddled order."""

LANE_ORDER = True
"""Hold the codes in the lane order (`twiddle.to_lane_order`) instead of the twiddled order: the wgmma kernel reads it
as well as the decode and tiled kernels, so that decode steps of up to `LANE_ORDER_MAX_ROWS` rows read it. Its sm_90a
wgmma main loop is 22-31 % shorter (notes/nvfp4-kernels.md "v12"). Hopper GPUs only (elsewhere the twiddled order).
Measured on an H100 (7B, NVFP4 + LoRA r32 + AQN, 2026-12-05, `scripts/bench_rollout.py`'s ``+lane_order`` engines
against ``+twiddle`` in one process): decode step 7.83 -> 7.45 and 7.38 ms at batch 64 (two runs, engines in either
order), 5.73 = 5.73 ms at batch 32, 3.10 -> 3.13 ms at batch 1; the window costs 7.7 ms per rollout instead of 6.1.
``False`` keeps the twiddled order (the default until then; benchmarks' ``+twiddle`` engines)."""

LANE_ORDER_MAX_ROWS = 128
"""Largest batch whose decode steps read the lane order with `LANE_ORDER`: where the shipped choices are CUDA kernels
(from 256 rows they are dequantise + cuBLAS or Triton for q/k/v and o at 7B, which the window would replace)."""


def _bucket(value: int, step: int) -> int:
    return -(-value // step) * step


def storage_fingerprint(model) -> tuple:
    """Where every parameter and buffer of ``model`` lives (data pointers, in module order), and which adapters are
    active. A captured decode step reads these addresses; an assignment such as ``param.data = ...`` or a device
    round trip moves one, and replaying the old graph would then read freed memory (or, after ``set_adapter``, the
    wrong adapter)."""
    tensors = [*model.parameters(), *model.buffers()]
    adapters = getattr(model, "active_adapters", None)
    return (*(t.data_ptr() for t in tensors), tuple(adapters) if isinstance(adapters, (list, tuple)) else adapters)


class _ModelForward:
    """Decoding through the model's own forward and a transformers `StaticCache` (any architecture)."""

    def __init__(self, model, batch: int, cache_len: int, mask_dtype: torch.dtype) -> None:
        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.cache_argument = cache_argument(model)
        self.cache_len, self.mask_dtype = cache_len, mask_dtype

    def reset(self) -> None:
        self.cache.reset()

    def prefill(self, input_ids, mask, position_ids, cache_position) -> torch.Tensor:
        return self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache_position=cache_position,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_argument: self.cache},
        ).logits[:, -1]

    def decode(self, tokens, positions, cache_position, mask) -> torch.Tensor:
        return self.model(
            input_ids=tokens[:, None],
            position_ids=positions[:, None],
            cache_position=cache_position,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_argument: self.cache},
        ).logits[:, -1]


class _DecodeState:
    """Fixed buffers of one (batch, cache length, sampling) shape and the in-place decode step over them."""

    def __init__(self, model, backend, batch, params, eos, pad_id, device, graph: bool, capture_at: int = 0) -> None:
        self.model, self.backend, self.params, self.eos, self.pad_id = model, backend, params, eos, pad_id
        self.batch = batch
        self.storage = storage_fingerprint(model)
        cache_len = backend.cache_len
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.full((batch, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, params.max_new_tokens, dtype=torch.float32, device=device)
        self.entropy = torch.zeros_like(self.logprobs)
        self.visible, self.hidden = _mask_values(backend.mask_dtype)
        self.mask = torch.full((batch, 1, 1, cache_len), self.hidden, dtype=backend.mask_dtype, device=device)
        self.graph = None
        self.twiddled = False
        """Whether the step was captured for the twiddled codes (`StaticCacheGenerator`'s ``twiddled_decode``); the
        states `compacted` makes inherit it (they are captured inside the same window)."""
        self.lanes = False
        """Whether those codes are in the lane order (`LANE_ORDER` when the step was captured), inherited alike."""
        self.smaller: dict[int, _DecodeState] = {}
        """States over the first rows of this one's KV cache (`compacted`), made on first use and kept."""
        self.prefills: dict[tuple[int, int], _PrefillGraph | None] = {}
        """Captured prefills into this state's KV cache by (rows, prompt length); None where capture failed."""
        if graph:
            # Capturing runs the step twice, writing keys/values at `cache_position`: a state made mid-rollout
            # captures at the current position, which the next step overwrites before anything reads it.
            self.cache_position.fill_(capture_at)
            self._capture()

    def step(self) -> None:
        """Decode one token for every row, entirely in place (capturable)."""
        self.mask.index_fill_(-1, self.cache_position, self.visible)
        logits = self.backend.decode(self.tokens, self.positions, self.cache_position, self.mask)
        buffers = (self.tokens, self.positions, self.cache_position, self.step_index, self.finished, self.out,
                   self.logprobs, self.entropy)  # fmt: skip
        args = (logits, uniform_draws(logits, self.params), self.params, self.pad_id, self.eos, *buffers)
        if getattr(self.backend, "compiled", False) and _RECORD.compiled is not None:
            try:
                _RECORD.compiled(*args)
                return
            except Exception as error:  # noqa: BLE001 - a compiler problem must not stop rollouts
                fused_decode.log_compile_failure(logger, "the decode step's sampling", error)
                _RECORD.give_up()
        record_step(*args)

    def replay(self) -> None:
        if self.graph is None:
            self.step()
        else:
            self.graph.replay()

    def compacted(self, index: torch.Tensor) -> _DecodeState:
        """Continue the rows ``index`` (a device tensor) of this state in a state of ``len(index)`` rows over the
        first rows of the same KV cache: their cache rows, tokens, positions, masks, finished flags and outputs so
        far move there; the smaller state's step (captured once, kept for later rollouts) then decodes only them."""
        batch = index.numel()
        smaller = self.smaller.get(batch)
        if smaller is None:
            smaller = _DecodeState(self.model, self.backend.first_rows(batch), batch, self.params, self.eos,
                                   self.pad_id, self.tokens.device, self.graph is not None,
                                   capture_at=int(self.cache_position))  # fmt: skip
            smaller.twiddled, smaller.lanes = self.twiddled, self.lanes
            self.smaller[batch] = smaller
        self.backend.gather_rows(index)
        for name in ("tokens", "positions", "finished", "out", "logprobs", "entropy", "mask"):
            getattr(smaller, name).copy_(getattr(self, name).index_select(0, index))
        for name in ("cache_position", "step_index"):
            getattr(smaller, name).copy_(getattr(self, name))
        return smaller

    def _capture(self) -> None:
        # Warm up (kernel choices, cuBLAS handles), then record one step. The warm-up writes into the cache; every
        # rollout resets it before prefill.
        _on_side_stream(self.step)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()


def record_step(
    logits: torch.Tensor, uniform: torch.Tensor | None, params: SamplingParams, pad_id: int, eos: torch.Tensor,
    tokens: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor, step_index: torch.Tensor,
    finished: torch.Tensor, out: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor,
) -> None:  # fmt: skip
    """A decode step's work after its logits, in place on the step's buffers: the draw (`draw_with_stats` of the
    step's `uniform_draws`), padding for rows already finished, the EOS flags, the outputs at ``step_index``, and the
    next step's tokens and positions."""
    next_tokens, logprob, row_entropy = draw_with_stats(logits, uniform, params)
    next_tokens = torch.where(finished, torch.full_like(next_tokens, pad_id), next_tokens)
    finished |= _is_eos(next_tokens, eos)
    out.index_copy_(1, step_index, next_tokens[:, None])
    logprobs.index_copy_(1, step_index, logprob[:, None])
    entropy.index_copy_(1, step_index, row_entropy[:, None])
    tokens.copy_(next_tokens)
    positions.add_(1)
    cache_position.add_(1)
    step_index.add_(1)


class _CompiledRecord:
    """`record_step` through ``torch.compile``, made on first use and shared by every decode state (its graphs are
    keyed by shapes and sampling settings). Steps of a compiled `FusedDecoder` use it; eagerly the draw's reductions
    over the vocabulary take one program per row each (the H100 profile of 2026-12-06, 7B at batch 1: 33 µs for the
    log-softmax alone) and the bookkeeping a launch per buffer."""

    def __init__(self) -> None:
        self._compiled: Callable[..., None] | None = None
        self._failed = False

    @property
    def compiled(self) -> Callable[..., None] | None:
        """The compiled `record_step`; None where `fused_decode.COMPILE_ENDS` is off or compiling failed."""
        if self._failed or not fused_decode.COMPILE_ENDS:
            return None
        if self._compiled is None:
            self._compiled = torch.compile(record_step, fullgraph=True, options=dict(fused_decode.COMPILE_OPTIONS))
        return self._compiled

    def give_up(self) -> None:
        """Compiling failed: every later step records eagerly (the caller has logged why)."""
        self._compiled, self._failed = None, True


_RECORD = _CompiledRecord()


def _on_side_stream(run: Callable[[], T]) -> T:
    """``run()`` on a side stream, ordered after and before the current stream's work: how a CUDA graph's warm-up
    runs, so that lazily created state (cuBLAS handles, workspaces) exists before capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = run()
    torch.cuda.current_stream().wait_stream(stream)
    return result


class _PrefillGraph:
    """One prefill shape captured as a CUDA graph over fixed input buffers. Its graph shares a memory pool with the
    generator's other prefill graphs: their temporaries never live across calls, and `replay` copies the logits out
    before any other prefill can run."""

    def __init__(self, backend, inputs: tuple[torch.Tensor, ...], pool) -> None:
        self.inputs = [tensor.clone() for tensor in inputs]
        self.graph = torch.cuda.CUDAGraph()
        # Capture records without running: the cache keeps what the eager prefill just wrote.
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = backend.prefill(*self.inputs)

    def replay(self, *inputs: torch.Tensor) -> torch.Tensor:
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        return self.logits.clone()


PREFILL_GRAPH_TOKENS = 2048
"""`StaticCacheGenerator(capture_prefill=...)` captures prefills of at most this many tokens (prefilled rows x prompt
length). Measured on the H200 (7B, NVFP4 + LoRA r32 + AQN, 2026-12-03): a 256-token prefill call took 105-108 ms
eagerly for 21 ms of kernels (host launch work), 39-41 ms captured; at 2,048 tokens (8 distinct prompts) 132 ms
eagerly, 125 ms captured, for 106 ms of kernels. Beyond that the kernels dominate, while a graph keeps its temporaries
(at 2,048 tokens a 7B layer's MLP activations alone are ~230 MB) for as long as it lives."""
PREFILL_LENGTH_BUCKET = 64
"""Prompt lengths of captured prefills are rounded up to this multiple, so that shapes repeat across rollouts."""


COMPACT_MIN_ROWS = 32
"""`StaticCacheGenerator(compact_finished=None)` compacts steps of at least this many rows. Measured on the H200 (7B,
NVFP4 + LoRA + AQN, 1,024 new tokens with ~0.4 % of the vocabulary ending rows, 2026-12-02): at 32 rows 5.31 ms per
step with compaction, 8.11 without; at 8 rows 4.63 with, 4.46 without (and 7.6 s more of first-call captures)."""


def _is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Which ``tokens`` are in ``eos``. Not `torch.isin`: above a few test elements it sorts with `unique`, which
    synchronises with the host and so breaks CUDA-graph capture (seen with ~600 EOS ids; torch 2.11)."""
    return (tokens[:, None] == eos[None, :]).any(dim=1)


def _mask_values(dtype: torch.dtype):
    if dtype == torch.bool:
        return True, False
    return 0.0, torch.finfo(dtype).min


class Samples(NamedTuple):
    """What `StaticCacheGenerator.sample` returns, one list per prompt (EOS included, padding removed)."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    """Log-probability of each sampled token under the sampling distribution (vLLM's "processed" log-probs)."""
    entropies: list[list[float]]
    """Entropy (nats) of the sampling distribution at each completion token."""


class StaticCacheGenerator:
    """Batched sampling with a static KV cache and, on CUDA, a CUDA-graphed decode step.

    Args:
        model: a causal LM (NVFP4 or 16-bit, PEFT-wrapped or not).
        cuda_graph: capture the decode step (default: on CUDA).
        batch_bucket / length_bucket: batch and cache lengths are rounded up to multiples of these, so that a
            captured step is reused across rollouts.
        check_every: decode steps between "are all rows finished?" checks (each is one host synchronisation).
        engine: ``"fused"`` decodes with `FusedDecoder` over the model's tensors (Llama, Mistral, Qwen2, Qwen3;
            LoRA and AQN norms read in place); ``"model"`` calls the model's forward on a transformers
            `StaticCache` ("sdpa" or "eager" attention); ``"auto"`` (default) takes "fused" where it applies and
            logs why not otherwise.
        compile: run the fused step's layers, the embedding, rotary and final norm around them and the sampling through
            ``torch.compile`` (default: on CUDA).
        decode_attention: the fused step's decode attention: ``"auto"`` (default: ``"split_kv"`` on Hopper GPUs,
            where it was measured, else ``"sdpa"``), ``"sdpa"`` or ``"split_kv"`` (a Triton kernel that reads the
            cache only up to the current position; see `FusedDecoder`).
        compact_finished: when at most half of the rows are still decoding (checked every ``check_every`` steps,
            with at least ``2 * check_every`` steps left), move them to a smaller step (a power of two of rows,
            over the first rows of the same KV cache; each size captured once and kept) so finished rows stop
            costing. ``None`` (default) compacts steps of at least `COMPACT_MIN_ROWS` rows, where it pays;
            ``True`` any step, ``False`` none. Fused engine only (the model engine logs and decodes without it,
            when asked). Greedy outputs are the same with or without; sampled ones are draws of the same
            distribution (fewer rows draw from the generator).
        share_prefill: prefill each distinct prompt once and copy its KV cache to the rows that repeat it (GRPO's
            ``num_generations`` completions of a prompt); every row then draws its own first token. Fused engine
            only (the model engine prefills every row). Default on.
        capture_prefill: replay prefills of at most `PREFILL_GRAPH_TOKENS` tokens (distinct prompts x prompt
            length) as CUDA graphs, one per shape, captured after its first eager run; prompt lengths are then
            rounded up to multiples of `PREFILL_LENGTH_BUCKET` (more left padding) so that shapes repeat. Such
            prefills are bound by host launch work, not by the GPU. Default: with ``cuda_graph``, fused engine.
        twiddled_decode: hold the NVFP4 codes in a kernel-friendly order (`trl_qerl.nvfp4.twiddle`; the lane order
            with `LANE_ORDER`, else the twiddled bit order) while decode steps run: permuted in place (no copy)
            before each rollout's decode loop and restored after it, also on an error, so that the CUDA kernels
            decode them with fewer instructions. Fused engine on CUDA, at most `LANE_ORDER_MAX_ROWS` rows
            (`TWIDDLE_MAX_ROWS` in the twiddled order). ``None`` (default): on where that holds and the model
            computes in bf16 (the order saves nothing in fp16); ``True`` also for fp16; ``False`` never. If a product
            of the step is not served by a kernel that reads the order, the generator logs once and keeps the
            standard order from then on.
    """

    def __init__(
        self,
        model,
        cuda_graph: bool | None = None,
        batch_bucket: int = 1,
        length_bucket: int = 256,
        check_every: int = 16,
        engine: str = "auto",
        compile: bool | None = None,
        decode_attention: str = "auto",
        compact_finished: bool | None = None,
        share_prefill: bool = True,
        capture_prefill: bool | None = None,
        twiddled_decode: bool | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"Unknown engine={engine!r}; use one of {ENGINES}.")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"Unknown decode_attention={decode_attention!r}; use one of {DECODE_ATTENTION}.")
        self.decode_attention = decode_attention
        self.model = model
        device = next(model.parameters()).device
        self.cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        self.compile = device.type == "cuda" if compile is None else compile
        self.batch_bucket, self.length_bucket, self.check_every = batch_bucket, length_bucket, check_every
        self.engine = self._choose_engine(engine)
        self.compact_finished = compact_finished if self.engine == "fused" else False
        if compact_finished and not self.compact_finished:
            logger.warning("compact_finished needs the fused decode step; this model decodes through its forward, "
                           "where finished rows keep decoding until all have finished")  # fmt: skip
        self.share_prefill = share_prefill and self.engine == "fused"
        wanted = self.cuda_graph if capture_prefill is None else capture_prefill
        self.capture_prefill = wanted and self.cuda_graph and self.engine == "fused"
        if capture_prefill and not self.capture_prefill:
            logger.warning("capture_prefill needs CUDA graphs and the fused decode step; prefilling eagerly")
        self._prefill_pool = None
        self.twiddled_decode = twiddled_decode
        self._twiddle_off: str | None = None
        """Why the codes stay in the standard order from now on (``twiddled_decode=True`` cannot apply to this model,
        or a product of the step is not served by the decode or tiled kernel)."""
        self._lane_order_noted = False
        self._states: dict[tuple, _DecodeState] = {}
        self.captures = 0
        """Number of decode-step captures (one per shape bucket and sampling setting) in this process."""
        self.compactions = 0
        """Number of times rows still decoding moved to a smaller step (``compact_finished``)."""
        self.prefilled_rows = 0
        """Rows the last rollout's prefill computed (fewer than its batch where prompts repeat, `share_prefill`)."""
        self.prefill_captures = 0
        """Number of prefill shapes captured as CUDA graphs (`capture_prefill`) in this process."""

    def _choose_engine(self, engine: str) -> str:
        if engine in ("auto", "fused"):
            try:
                read_decoder(self.model)
                return "fused"
            except UnsupportedDecoder as reason:
                if engine == "fused":
                    raise
                logger.info("fused decode step unavailable (%s); decoding through the model's forward", reason)
        self._check_model_forward_attention()
        return "model"

    def _attention_implementation(self) -> str:
        return getattr(self.model.config, "_attn_implementation", "sdpa") or "sdpa"

    def _check_model_forward_attention(self) -> None:
        implementation = self._attention_implementation()
        if implementation not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"StaticCacheGenerator decodes this model through its forward, which needs 'sdpa' or 'eager' "
                f"attention; the model uses {implementation!r}."
            )

    def _backend(self, batch: int, cache_len: int, device):
        if self.engine == "fused":
            # (a sliding window shorter than the cache is refused there, with the reason: the static-cache forward
            # cannot take it either, its sliding layers keep a cache of the window's length)
            return FusedDecoder(read_decoder(self.model), batch, cache_len, device, compile=self.compile,
                                decode_attention=self.decode_attention)  # fmt: skip
        mask_dtype = torch.bool if self._attention_implementation() == "sdpa" else self.model.dtype
        return _ModelForward(self.model, batch, cache_len, mask_dtype)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
    ) -> list[list[int]]:
        """Completion token ids per prompt: stops at the first EOS (included) or after ``max_new_tokens``."""
        return self.sample(prompts, params, eos_token_ids, pad_token_id).completion_ids

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
    ) -> Samples:
        """`generate`, with each completion token's log-probability and the entropy of the distribution it was drawn
        from (temperature and filters applied), computed inside the decode step from logits it has anyway."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, and no empty prompt.")
        try:
            return self._sample(prompts, params, eos_token_ids, pad_token_id)
        except twiddle.TwiddledCodesError as error:  # (the codes are back in the standard order: the window restores)
            logger.warning("decode steps keep the NVFP4 codes in the standard order from now on (slower): %s", error)
            self._twiddle_off, self._states = str(error), {}
            return self._sample(prompts, params, eos_token_ids, pad_token_id)

    def _sample(self, prompts, params: SamplingParams, eos_token_ids, pad_token_id: int) -> Samples:
        model = self.model
        device = next(model.parameters()).device
        rows = len(prompts)
        batch = _bucket(rows, self.batch_bucket)
        groups = _prompt_groups(prompts, batch) if self.share_prefill else None
        prompt_len = max(len(p) for p in prompts)
        prefilled = len(groups[0]) if groups else batch
        bucketed = _bucket(prompt_len, PREFILL_LENGTH_BUCKET)
        capture = self.capture_prefill and prefilled * bucketed <= PREFILL_GRAPH_TOKENS
        if capture:
            prompt_len = bucketed  # captured shapes repeat across rollouts
        cache_len = _bucket(prompt_len + params.max_new_tokens, self.length_bucket)

        input_ids = torch.full((batch, prompt_len), pad_token_id, dtype=torch.long)
        padding = torch.zeros(batch, cache_len, dtype=torch.bool)  # True where a row has a real prompt token
        for row, prompt in enumerate(prompts):
            input_ids[row, prompt_len - len(prompt) :] = torch.tensor(prompt)
            padding[row, prompt_len - len(prompt) : prompt_len] = True
        padding[rows:, prompt_len - 1] = True  # bucket-filling rows attend to something; their output is dropped
        input_ids, padding = input_ids.to(device), padding.to(device)
        lengths = padding.sum(dim=1)

        was_training = model.training
        model.eval()
        try:
            state = self._state(batch, cache_len, params, eos_token_ids, pad_token_id, device)
            state.backend.reset()
            first, first_logprob, first_entropy = self._prefill(state, input_ids, padding, prompt_len, groups, capture)
            state.tokens.copy_(first)
            state.positions.copy_(lengths)
            state.cache_position.fill_(prompt_len)
            state.step_index.fill_(1)
            state.finished.copy_(_is_eos(first, state.eos))
            state.out.fill_(pad_token_id)
            state.out[:, 0] = first
            state.logprobs[:, 0], state.entropy[:, 0] = first_logprob, first_entropy
            state.mask.copy_(torch.where(padding, state.visible, state.hidden)[:, None, None, :])
            with self._twiddled(state, params.max_new_tokens):
                decoded = self._decode(state, rows, params)
            generated, logprobs, entropy = (tensor.tolist() for tensor in decoded)
        finally:
            if was_training:
                model.train()
        completions = _trim(generated, set(eos_token_ids))
        lengths = [len(ids) for ids in completions]
        return Samples(
            completions,
            [row[:n] for row, n in zip(logprobs, lengths)],
            [row[:n] for row, n in zip(entropy, lengths)],
        )

    def _decode(self, state: _DecodeState, rows: int, params: SamplingParams) -> list[torch.Tensor]:
        """Replay the decode step until every prompt's row has finished or ``max_new_tokens`` are out; returns the
        ``rows`` prompts' tokens, log-probs and entropies ``[rows, max_new_tokens]``, moving the rows still
        decoding to smaller steps on the way if ``compact_finished``."""
        steps = params.max_new_tokens
        active, row_ids = state, torch.arange(state.batch, device=state.tokens.device)  # prompt of each row
        real = row_ids < rows  # the rest fill the batch bucket
        outputs = None
        for index in range(1, steps):
            if index % self.check_every == 0:
                live = real & ~active.finished
                count = int(live.sum())
                if count == 0:
                    break
                smaller = _power_of_two_at_least(count)
                if (
                    self._compacts(active.batch)
                    and smaller <= active.batch // 2
                    and steps - index >= 2 * self.check_every
                ):
                    outputs = _collect(active, row_ids, real, outputs, rows)
                    active, row_ids, real = self._compact(active, live, smaller, row_ids)
            active.replay()
        return _collect(active, row_ids, real, outputs, rows)

    def _compacts(self, batch: int) -> bool:
        if self.compact_finished is None:
            return batch >= COMPACT_MIN_ROWS
        return self.compact_finished

    def _compact(self, active: _DecodeState, live: torch.Tensor, smaller: int, row_ids: torch.Tensor):
        """Move the ``live`` rows of ``active`` to its state of ``smaller`` rows; the rows beyond them repeat a live
        row, marked finished (they write padding, and ``real`` drops them)."""
        index = live.nonzero().flatten()
        count = index.numel()
        index = torch.cat([index, index[:1].expand(smaller - count)])
        known = len(active.smaller)
        compacted = active.compacted(index)
        self.captures += int(self.cuda_graph) * (len(active.smaller) - known)
        self.compactions += 1
        real = torch.arange(smaller, device=index.device) < count
        compacted.finished |= ~real
        return compacted, row_ids.index_select(0, index), real

    def _prefill(self, state: _DecodeState, input_ids, padding, prompt_len, groups=None,
                 capture: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Fill the cache with the prompts and draw every row's first token. ``groups`` (`_prompt_groups`): prefill
        only the rows ``groups[0]`` (one per distinct prompt) in the first rows of the cache, then copy each row's
        prompt there (``groups[1]``). ``capture``: replay the prefill from a CUDA graph of its shape."""
        cache_len = padding.shape[1]
        causal = torch.ones(prompt_len, cache_len, dtype=torch.bool, device=padding.device).tril()
        visible = causal[None, None] & padding[:, None, None, :]
        mask = torch.where(visible, state.visible, state.hidden).to(state.mask.dtype)
        positions = (padding[:, :prompt_len].long().cumsum(dim=1) - 1).clamp_(min=0)
        cache_position = torch.arange(prompt_len, device=input_ids.device)
        if groups is None:
            logits = self._prefill_rows(state, state.backend, capture, input_ids, mask, positions, cache_position)
            self.prefilled_rows = input_ids.shape[0]
        else:
            sources, owners = (torch.tensor(rows, device=input_ids.device) for rows in groups)
            backend = state.backend.first_rows(sources.numel())
            inputs = (input_ids[sources], mask[sources], positions[sources], cache_position)
            logits = self._prefill_rows(state, backend, capture, *inputs)
            state.backend.gather_rows(owners)
            logits = logits.index_select(0, owners)
            self.prefilled_rows = sources.numel()
        return sample_with_stats(logits, state.params)

    def _prefill_rows(self, state: _DecodeState, backend, capture: bool, *inputs: torch.Tensor) -> torch.Tensor:
        """``backend.prefill(*inputs)``, with ``capture`` replayed from a CUDA graph of its shape: the first prefill
        of a shape runs eagerly (choosing kernels), then is captured; a capture that fails logs once and leaves that
        shape eager."""
        if not capture:
            return backend.prefill(*inputs)
        shape = tuple(inputs[0].shape)
        if shape in state.prefills:
            graph = state.prefills[shape]
            return graph.replay(*inputs) if graph is not None else backend.prefill(*inputs)
        logits = _on_side_stream(lambda: backend.prefill(*inputs))  # also the capture's warm-up
        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        try:
            state.prefills[shape] = _PrefillGraph(backend, inputs, self._prefill_pool)
            self.prefill_captures += 1
        except Exception as error:  # noqa: BLE001 - a capture problem must not stop rollouts
            logger.warning("capturing the prefill of %s rows x %s tokens failed (%s: %s); it stays eager",
                           shape[0], shape[1], type(error).__name__, str(error)[:200])  # fmt: skip
            state.prefills[shape] = None
        return logits

    def _state(self, batch, cache_len, params, eos_token_ids, pad_id, device) -> _DecodeState:
        key = (batch, cache_len, params, tuple(eos_token_ids), pad_id)
        if key in self._states and self._states[key].storage != storage_fingerprint(self.model):
            logger.info("the model's parameters moved in memory since the decode step was captured; capturing again")
            self._states = {}
        if key not in self._states:
            eos = torch.tensor(list(eos_token_ids), device=device)
            self._states = {}  # keep one set of buffers (and one KV cache) alive at a time
            backend = self._backend(batch, cache_len, device)
            twiddled, lanes = self._window_order(batch)
            with self._twiddled_window(twiddled, lanes):  # (the capture's warm-up chooses kernels for that order)
                state = _DecodeState(self.model, backend, batch, params, eos, pad_id, device, self.cuda_graph)
            state.twiddled, state.lanes = twiddled, lanes
            self._states[key] = state
            self.captures += int(self.cuda_graph)
        return self._states[key]

    def nvfp4_codes(self) -> list[torch.Tensor]:
        """`nvfp4_codes` of the generator's model."""
        return nvfp4_codes(self.model)

    def _window_order(self, batch: int) -> tuple[bool, bool]:
        """Whether decode steps of ``batch`` rows read permuted codes (``twiddled_decode``), and whether in the lane
        order (`_lane_order`, else the twiddled one); logs once where it was asked for and cannot apply."""
        if self.twiddled_decode is False or self._twiddle_off is not None:
            return False, False
        device = next(self.model.parameters()).device
        dtype = self.model.get_input_embeddings().weight.dtype
        codes = self.nvfp4_codes()
        blocked = (
            "the model has no NVFP4 layers" if not codes
            else "needs contiguous NVFP4 codes (they are rewritten in place)"
            if not all(packed.is_contiguous() for packed in codes)
            else "needs CUDA" if device.type != "cuda"
            else "needs the fused decode step" if self.engine != "fused"
            else None
        )  # fmt: skip
        if blocked is not None:
            if self.twiddled_decode:
                logger.warning("twiddled_decode=True %s; the codes stay in the standard order", blocked)
                self._twiddle_off = blocked
            return False, False
        lanes = self._lane_order()
        if batch > (LANE_ORDER_MAX_ROWS if lanes else TWIDDLE_MAX_ROWS):  # (this batch only)
            return False, False
        twiddled = self.twiddled_decode is True or dtype == torch.bfloat16
        return twiddled, twiddled and lanes

    def _lane_order(self) -> bool:
        """Whether the decode window holds the lane order: `LANE_ORDER` on a Hopper GPU (the wgmma kernel, which the
        order is for, needs compute capability 9.0; elsewhere its gain is unmeasured) where every code row is whole
        16-byte chunks (K a multiple of 32, as in every Qwen and Llama shape). Otherwise the twiddled order, which
        needs whole words only (said once)."""
        if not LANE_ORDER:
            return False
        reason = (
            f"the NVFP4 codes' rows are not whole {twiddle.CHUNK_BYTES}-byte chunks (K a multiple of 32)"
            if not all(packed.shape[-1] % twiddle.CHUNK_BYTES == 0 for packed in self.nvfp4_codes())
            else "the wgmma kernel it serves needs a Hopper GPU (compute capability 9.0)"
            if not self._hopper()
            else None
        )  # fmt: skip
        if reason is not None and not self._lane_order_noted:
            self._lane_order_noted = True
            logger.info("%s; decode windows hold the twiddled order (up to %d rows) instead of the lane order "
                        "(LANE_ORDER)", reason, TWIDDLE_MAX_ROWS)  # fmt: skip
        return reason is None

    def _hopper(self) -> bool:
        return cuda_wgmma.runs_on(next(self.model.parameters()).device)

    @contextlib.contextmanager
    def _twiddled_window(self, twiddled: bool, lanes: bool = False) -> Iterator[None]:
        if not twiddled:
            yield
            return
        with twiddle.twiddled_codes(self.nvfp4_codes(), lanes=lanes):
            yield

    def _twiddled(self, state: _DecodeState, new_tokens: int = 2) -> contextlib.AbstractContextManager:
        """The decode loop's window: the codes in the order ``state`` was captured for (twiddled, or the lane order)
        where the loop decodes (``new_tokens`` > 1: the prefill draws the first)."""
        return self._twiddled_window(state.twiddled and new_tokens > 1, state.lanes)


def nvfp4_codes(model) -> list[torch.Tensor]:
    """The NVFP4 code tensors of ``model`` (``weight_packed`` of every `NVFP4A16Linear`), in module order: what the
    decode window permutes."""
    return [module.weight_packed for module in model.modules() if isinstance(module, NVFP4A16Linear)]


def _prompt_groups(prompts: Sequence[Sequence[int]], batch: int) -> tuple[list[int], list[int]] | None:
    """Where some prompts repeat: (the first row of each distinct prompt, the distinct prompt's index of each of the
    ``batch`` rows; rows past the prompts fill the batch bucket and take the first), else None."""
    index: dict[tuple[int, ...], int] = {}
    sources, owners = [], []
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(sources)
            sources.append(row)
        owners.append(index[key])
    if len(sources) == len(prompts):
        return None
    return sources, owners + [0] * (batch - len(prompts))


def _power_of_two_at_least(value: int) -> int:
    return 1 << (value - 1).bit_length()


def _collect(state: _DecodeState, row_ids, real, outputs, rows: int) -> list[torch.Tensor]:
    """The outputs so far ``[rows, max_new_tokens]`` (tokens, log-probs, entropies): the first state's first
    ``rows`` rows are the prompts in order; a smaller state's real rows are written to the prompts they decode."""
    tensors = (state.out, state.logprobs, state.entropy)
    if outputs is None:
        return [tensor[:rows].clone() for tensor in tensors]
    prompts = row_ids[real]
    for output, tensor in zip(outputs, tensors):
        output.index_copy_(0, prompts, tensor[real])
    return outputs


def _trim(rows: list[list[int]], eos: set[int]) -> list[list[int]]:
    """Cut each row after its first EOS (kept)."""
    trimmed = []
    for ids in rows:
        for index, token in enumerate(ids):
            if token in eos:
                ids = ids[: index + 1]
                break
        trimmed.append(ids)
    return trimmed


# -- the trainer's backend --------------------------------------------------------------------------------------


class FastRollout:
    """Static-cache, CUDA-graph decoding (`StaticCacheGenerator`), falling back to TRL's generate (logged) for
    options it does not support or if capture fails."""

    name = "fast"

    def __init__(
        self,
        cuda_graph: bool | None = None,
        engine: str = "auto",
        compile: bool | None = None,
        twiddled_decode: bool | None = None,
    ) -> None:
        self.cuda_graph, self.engine, self.compile = cuda_graph, engine, compile
        self.twiddled_decode = twiddled_decode
        self.generator = None
        self.fallback = TransformersRollout()
        self.disabled_reason: str | None = None
        self.sampling_entropy: float | None = None

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        reason = self.disabled_reason or _unsupported(trainer, images, self.engine)
        if reason:
            if reason != self.disabled_reason:
                logger.warning("fast rollouts unavailable (%s); using transformers generate", reason)
                self.disabled_reason = reason
            return self._fall_back(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        params = sampling_params(trainer.args)
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        try:
            if self.generator is None or self.generator.model is not model:
                self.generator = StaticCacheGenerator(
                    model, cuda_graph=self.cuda_graph, engine=self.engine, compile=self.compile,
                    twiddled_decode=self.twiddled_decode,
                )  # fmt: skip
            samples = self.generator.sample(prompt_ids, params, trainer.eos_token_ids, trainer._tokenizer.pad_token_id)
        except Exception as error:  # noqa: BLE001 - capture problems must not stop training
            self.disabled_reason = f"{type(error).__name__}: {error}"
            logger.warning("fast rollouts failed (%s); falling back to transformers generate", self.disabled_reason)
            return self._fall_back(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        values = [value for row in samples.entropies for value in row]
        self.sampling_entropy = sum(values) / len(values) if values else None
        return samples.completion_ids, samples.logprobs

    def _fall_back(self, trainer, *args):
        completions, logprobs = self.fallback.generate(trainer, *args)
        self.sampling_entropy = self.fallback.sampling_entropy
        if logprobs is None and trainer.use_vllm:
            # importance sampling is on: TRL reads NaN sampling log-probs as "not scored" (ratio 1, no correction)
            logprobs = [[float("nan")] * len(ids) for ids in completions]
        return completions, logprobs


def _unsupported(trainer, images, engine: str = "auto") -> str | None:
    args = trainer.args
    if images is not None and any(image is not None for image in images):
        return "multimodal prompts"
    if args.generation_kwargs:
        return f"generation_kwargs {sorted(args.generation_kwargs)}"
    if args.repetition_penalty != 1.0:
        return "repetition_penalty"
    if getattr(trainer, "tools", None):
        return "tool calling"
    attention = getattr(trainer.model.config, "_attn_implementation", None) or "sdpa"
    if attention not in SUPPORTED_ATTENTION and (engine == "model" or not _fused_step_applies(trainer.model)):
        return f"attn_implementation={attention!r} (the static-cache step supports {list(SUPPORTED_ATTENTION)})"
    return None


def _fused_step_applies(model) -> bool:
    try:
        read_decoder(model)
    except UnsupportedDecoder:
        return False
    return True
