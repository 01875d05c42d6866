"""The builtin engine: batched, KV-cached sampling with any Hugging Face causal LM.

A hand-written decode loop rather than `model.generate`: it records per-token behaviour log-probs
and versions, swaps weights between decode steps, drops finished rows from the batch, and is
faster than `generate` at small sizes (less per-step overhead; see tools/bench_engine.py). With a
prefix cache, a request that extends an earlier sequence (an episode's next turn) prefills only
the tokens added since.

Batch layout, with prefix KV (rows right-aligned, `.` padding, `c` cached, `f` fed at step 0):

    row 0 (cached 4 of 7)   . . c c c c | f f f     P = 6 cached columns,
    row 1 (no cache, 3)     . . . . . . | f f f     S = 3 fed columns: the longest uncached tail;
    row 2 (cached 6 of 8)   . c c c c c | c f f  <- a row whose uncached tail is shorter than S
                                                   feeds some cached tokens again
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import cast

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from asyncrl.device import resolve_device
from asyncrl.engines.base import Generation
from asyncrl.engines.config import TorchEngineConfig
from asyncrl.engines.prefix_cache import CachedPrefix, PrefixCache
from asyncrl.engines.routing import Routing, moe_shape, routing_hooks
from asyncrl.engines.sampling import SamplingParams, sampling_logprobs, sequence_logprobs
from asyncrl.engines.staging import StagedWeights
from asyncrl.lora import synced, wrap
from asyncrl.metrics.breakdown import phase
from asyncrl.model_config import LoraConfig


class TorchEngine:
    """`RolloutEngine` over a PreTrainedModel; one `generate` at a time (calls are serialised).

    The model may be shared (the trainer evaluates its live weights through one): `generate`
    runs it in eval mode and restores the mode it found.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 256,
        seed: int = 0,
        version: int = 0,
        prefix_cache_tokens: int = 0,
        prefix_cache_stale: bool = False,
        capture_routing: bool = False,
    ) -> None:
        if capture_routing and moe_shape(model) is None:
            raise ValueError(
                "rollout.capture_routing needs a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, "
                f"Mixtral); {type(model).__name__} has no top-k router"
            )
        if capture_routing and prefix_cache_tokens:
            # Cached prompt tokens are not fed again, so their routing would be unknown.
            raise ValueError("rollout.capture_routing needs rollout.engine.prefix_cache_tokens=0")
        self.capture_routing = capture_routing
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.before_step: Callable[[int], None] | None = None
        """Called on the generating thread before each forward step (0 = prefill), before staged
        weights are looked at; tests use it to make an in-flight swap land on a chosen step."""
        device = next(model.parameters()).device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._generate_lock = threading.Lock()
        self._prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._prefix_stale = prefix_cache_stale
        # Unless stale prefixes are allowed, a swap drops every entry the new weights did not
        # compute.
        drop = None if self._prefixes is None or prefix_cache_stale else self._prefixes.drop_older
        self._weights = StagedWeights(model, version, drop)
        self._scorer: tuple[int, torch.nn.Module] | None = None
        """(version, copy of the model in another dtype) for `rescore`."""

    @classmethod
    def from_config(
        cls,
        cfg: TorchEngineConfig,
        *,
        model_path: str,
        lora: LoraConfig | None = None,
        capture_routing: bool = False,
    ) -> TorchEngine:
        """With `lora`, the base carries the trainer's adapter layout, unmerged (`asyncrl.lora`):
        weight updates then cover the adapter only."""
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.dtype))
        if lora is not None:
            model = wrap(model, lora)
        # transformers decorates `to` with functools.wraps, which mypy cannot bind to `model`.
        model.to(resolve_device(cfg.device))  # type: ignore[arg-type]
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            model,
            eos_token_ids=eos_ids,
            max_batch_size=cfg.max_batch_size,
            seed=cfg.seed,
            prefix_cache_tokens=cfg.prefix_cache_tokens,
            prefix_cache_stale=cfg.prefix_cache_stale,
            capture_routing=capture_routing,
        )

    @property
    def version(self) -> int:
        return self._weights.version

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in synced(self.model)}

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self._weights.stage(tensors, version)

    def relabel(self, version: int) -> None:
        """Name the weights held `version` without changing them (SGLang's
        /update_weight_version, for `asyncrl serve`: switching a LoRA server's adapter changes
        no base weight). ValueError for an older version or while weights are staged."""
        self._weights.relabel(version)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, min_new_tokens: int = 0
    ) -> list[Generation]:
        """`min_new_tokens` (SGLang's, for `asyncrl serve`): the stop tokens' logits are -inf
        for the first that many steps, so their log-probs are of the masked distribution."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        stop = self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        stop_ids = torch.tensor(stop, dtype=torch.long, device=self._generator.device)
        # Similar lengths share a micro-batch: less left padding.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Generation] = {}
        with self._generate_lock:
            self._weights.set_busy(True)
            training = self.model.training
            self.model.eval()
            hooks = routing_hooks(self.model) if self.capture_routing else contextlib.nullcontext()
            try:
                with hooks as routing:
                    for start in range(0, len(order), self.max_batch_size):
                        chunk = order[start : start + self.max_batch_size]
                        batch = [prompts[i] for i in chunk]
                        generations = self._generate_batch(
                            batch, params, stop_ids, min_new_tokens, routing
                        )
                        results.update(zip(chunk, generations, strict=True))
            finally:
                self.model.train(training)
                self._weights.set_busy(False)
        return [results[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def score(self, seqs: list[list[int]], params: SamplingParams) -> list[torch.Tensor]:
        """Per sequence, the `sampling_logprobs` of the next token after each of positions
        0..n-2 ([n-1, V], one unpadded forward each), under the current weights."""
        with self._scoring():
            self.model.eval()
            device = self._generator.device
            out = []
            for seq in seqs:
                logits = self.model(input_ids=torch.tensor([seq], device=device)).logits
                out.append(sampling_logprobs(logits[0, :-1], params).cpu())
            return out

    def rescore(
        self, sequences: list[tuple[list[int], int]], params: SamplingParams, dtype: str
    ) -> tuple[int, list[np.ndarray]]:
        """`Rescoring`: one full forward per sequence, as the trainer computes. With `dtype`
        other than the engine's, the weights are a copy cast to it (made once per version):
        the engine's own rounded weights, so the audit measures the compute path alone."""
        with self._scoring():
            version = self._weights.version
            model = self._scoring_model(getattr(torch, dtype))
            model.eval()
            device = self._generator.device
            out = []
            with torch.inference_mode():
                for ids, n_prompt in sequences:
                    logp = sequence_logprobs(model, torch.tensor([ids], device=device), params)
                    out.append(logp[0, n_prompt - 1 :].float().cpu().numpy())
        return version, out

    @contextlib.contextmanager
    def _scoring(self) -> Iterator[None]:
        """Forwards outside generation (`score`, `rescore`): under the generate lock, with no
        weight swap under them; the model's train/eval mode restored."""
        with self._generate_lock:
            self._weights.set_busy(True)
            training = self.model.training
            try:
                yield
            finally:
                self.model.train(training)
                self._weights.set_busy(False)

    def _scoring_model(self, dtype: torch.dtype) -> torch.nn.Module:
        if next(self.model.parameters()).dtype == dtype:
            return self.model
        if self._scorer is None or self._scorer[0] != self._weights.version:
            scorer: torch.nn.Module = copy.deepcopy(self.model)
            self._scorer = (self._weights.version, scorer.to(dtype))
        return self._scorer[1]

    def _step_version(self, step: int) -> int:
        if self.before_step is not None:
            self.before_step(step)
        return self._weights.current()

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: torch.Tensor,
        min_new_tokens: int,
        routing: Routing | None,
    ) -> list[Generation]:
        """With `routing` (hooks on the routers), each fed token's experts are kept: the
        prompt's from the prefill, then one response token's per decode step."""
        device = self._generator.device
        version = self._step_version(0)
        cached = [self._match_prefix(p, version) for p in prompts]
        lengths_in = [len(p) for p in prompts]
        # S, the columns fed at step 0: the longest uncached tail among the rows with a cache hit.
        # A row without one and longer than that has its head prefilled first, on its own.
        tails = [n - c.length for n, c in zip(lengths_in, cached, strict=True) if c is not None]
        fed = max(tails) if tails else max(lengths_in)
        heads = [
            r
            for r, (n, c) in enumerate(zip(lengths_in, cached, strict=True))
            if c is None and n > fed
        ]
        if heads:
            with phase("prefill"):
                prefilled = self._prefill(
                    [prompts[r][: lengths_in[r] - fed] for r in heads], version
                )
            for r, kv in zip(heads, prefilled, strict=True):
                cached[r] = kv
        used = [
            max(0, n - fed) if c is not None else 0 for n, c in zip(lengths_in, cached, strict=True)
        ]
        rows, prefix, steps = len(prompts), max(used), params.max_new_tokens
        width = prefix + fed
        input_ids, _ = self._left_padded([p[max(0, len(p) - fed) :] for p in prompts], fed)
        # Mask over prompt + every response slot; row r's response token t sits at width + t.
        mask = torch.zeros(rows, width + steps, dtype=torch.bool, device=device)
        mask[:, :width] = _columns(lengths_in, width, device)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)[:, prefix:]
        # Without padding (e.g. equal-length prompts) attention is plain causal: no mask to build.
        padded = not bool(mask[:, :width].all())
        cache = DynamicCache(config=self.model.config)
        if prefix:
            self._fill_cache(cache, cached, used, prefix)
        # Oldest weights behind each row's keys, for the prefix it leaves in the cache.
        oldest = [
            min(version, c.version) if c is not None and u else version
            for c, u in zip(cached, used, strict=True)
        ]
        # The heads' keys were prefilled above, not taken from the cache.
        head_rows = set(heads)
        from_cache = [0 if r in head_rows else u for r, u in enumerate(used)]

        routes: list[torch.Tensor] = []
        response_routes: torch.Tensor | None = None
        tokens = torch.zeros(rows, steps, dtype=torch.long, device=device)
        logprobs = torch.zeros(rows, steps, dtype=torch.float32, device=device)
        versions = torch.zeros(rows, steps, dtype=torch.int32, device=device)
        lengths = torch.full((rows,), steps, dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)  # batch row -> original row
        for t in range(steps):
            # The first step feeds the prompts (prefill), the others one token each.
            with phase("decode" if t else "prefill"):
                if t:
                    version = self._step_version(t)
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=mask[:, : width + t] if padded else None,
                    position_ids=positions,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                if routing is not None:
                    seen = routing.stacked(len(active))  # [active rows, fed columns, layers, k]
                    if not t:
                        routes = [seen[r, seen.shape[1] - len(p) :] for r, p in enumerate(prompts)]
                        response_routes = seen.new_zeros(rows, steps, *seen.shape[2:])
                    else:
                        assert response_routes is not None
                        response_routes[active, t - 1] = seen[:, 0]
                logits = out.logits[:, -1]
                if t < min_new_tokens:
                    logits = logits.index_fill(-1, stop_ids, float("-inf"))
                logp = sampling_logprobs(logits, params)
                token = torch.multinomial(logp.exp(), 1, generator=self._generator)
                tokens[active, t] = token[:, 0]
                logprobs[active, t] = logp.gather(-1, token)[:, 0]
                versions[active, t] = version
                stop = torch.isin(token[:, 0], stop_ids)
                lengths[active[stop]] = t + 1
                stopped[active[stop]] = True
                done = stop if t < steps - 1 else torch.ones_like(stop)
                if done.any():
                    if self._prefixes is not None:
                        self._keep_prefixes(cache, done, active, width, t, prompts, tokens, oldest)
                    keep = ~done
                    if not keep.any():
                        break
                    # Finished rows leave the batch, cache included, so they cost nothing further.
                    kept = keep.nonzero()[:, 0]
                    cache.batch_select_indices(kept)
                    active, token, mask = active[kept], token[kept], mask[kept]
                    positions = positions[kept]
                mask[:, width + t] = True
                input_ids = token
                positions = positions[:, -1:] + 1

        with phase("decode"):  # the device's last tokens are waited for here
            tokens_np = tokens.cpu().numpy().astype(np.int32)
            logprobs_np = logprobs.cpu().numpy()
            versions_np = versions.cpu().numpy()
        return [
            Generation(
                token_ids=tokens_np[r, :n].copy(),
                logprobs=logprobs_np[r, :n].copy(),
                versions=versions_np[r, :n].copy(),
                finish="stop" if stop else "length",
                cached_tokens=from_cache[r],
                routed_experts=(
                    None
                    if response_routes is None
                    else _routes(routes[r], response_routes[r, : n - 1])
                ),
            )
            for r, (n, stop) in enumerate(zip(lengths.tolist(), stopped.tolist(), strict=True))
        ]

    def _match_prefix(self, prompt: list[int], version: int) -> CachedPrefix | None:
        if self._prefixes is None:
            return None
        return self._prefixes.match(prompt, 0 if self._prefix_stale else version)

    def _left_padded(self, seqs: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`seqs` right-aligned in `width` columns (id 0 before them), and where they are."""
        device = self._generator.device
        mask = _columns([len(seq) for seq in seqs], width, device)
        ids = torch.zeros(mask.shape, dtype=torch.long, device=device)
        # Row-major order of the mask's True cells is the order of the concatenated tokens.
        ids[mask] = torch.tensor(list(itertools.chain.from_iterable(seqs)), device=device)
        return ids, mask

    def _prefill(self, heads: list[list[int]], version: int) -> list[CachedPrefix]:
        """KV of `heads` from one forward pass."""
        width = max(map(len, heads))
        ids, mask = self._left_padded(heads, width)
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv = _token_major(cache, torch.arange(len(heads)), width)
        return [CachedPrefix(kv[r, width - len(h) :].clone(), version) for r, h in enumerate(heads)]

    def _fill_cache(
        self, cache: DynamicCache, cached: list[CachedPrefix | None], used: list[int], prefix: int
    ) -> None:
        """Put each row's first `used` tokens of cached KV into the `prefix` columns before the
        fed ones, right-aligned like the rows."""
        src = torch.cat(
            [c.kv[:u] for c, u in zip(cached, used, strict=True) if c is not None and u]
        )
        _, layers, _, heads, dim = src.shape
        buf = src.new_zeros(len(used), prefix, layers, 2, heads, dim)
        buf[_columns(used, prefix, src.device)] = src
        for layer in range(layers):
            # [rows, columns, heads, dim] -> the cache's [rows, heads, columns, dim]
            keys = buf[:, :, layer, 0].transpose(1, 2).contiguous()
            values = buf[:, :, layer, 1].transpose(1, 2).contiguous()
            cache.update(keys, values, layer)

    def _keep_prefixes(
        self,
        cache: DynamicCache,
        leaving: torch.Tensor,
        active: torch.Tensor,
        width: int,
        t: int,
        prompts: list[list[int]],
        tokens: torch.Tensor,
        oldest: list[int],
    ) -> None:
        """Store the KV of the batch rows `leaving` after step t: their prompt and the response
        tokens fed so far (all but the one sampled at t, which was never fed)."""
        assert self._prefixes is not None
        rows = leaving.nonzero()[:, 0]
        kv = _token_major(cache, rows, width + t)
        response = tokens[active[rows], :t].tolist()
        for i, r in enumerate(active[rows].tolist()):
            entry = CachedPrefix(kv[i, width - len(prompts[r]) :].clone(), oldest[r])
            self._prefixes.put(prompts[r] + response[i], entry)


def _routes(prompt: torch.Tensor, response: torch.Tensor) -> np.ndarray:
    """One row per fed token: the prompt's, then every response token's but the last."""
    return torch.cat([prompt, response]).cpu().numpy().astype(np.uint16)


def _columns(used: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] mask of each row's last `used` columns."""
    counts = torch.tensor(used, device=device)
    return torch.arange(width, device=device) >= (width - counts)[:, None]


def _token_major(cache: DynamicCache, rows: torch.Tensor, end: int) -> torch.Tensor:
    """The cache's first `end` columns of batch rows `rows`, as
    [rows, columns, layers, 2, kv_heads, head_dim]."""
    # After a forward pass every layer holds its keys and values.
    kv = [cast("tuple[torch.Tensor, torch.Tensor]", (lay.keys, lay.values)) for lay in cache.layers]  # type: ignore[union-attr]
    per_layer = [
        torch.stack((keys[rows, :, :end], values[rows, :, :end]), dim=1) for keys, values in kv
    ]  # each [rows, 2, heads, columns, dim]
    return torch.stack(per_layer, dim=1).permute(0, 4, 1, 2, 3, 5)
