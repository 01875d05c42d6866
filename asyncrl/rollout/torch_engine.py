"""The builtin engine: batched, KV-cached sampling with any Hugging Face causal LM.

A hand-written decode loop rather than `model.generate`: it records per-token behaviour log-probs
and versions, swaps weights between decode steps, drops finished rows from the batch, and is
faster than `generate` at small sizes (less per-step overhead; see tools/bench_engine.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from asyncrl.rollout.config import TorchEngineConfig
from asyncrl.rollout.engine import Generation
from asyncrl.rollout.sampling import SamplingParams, sampling_logprobs


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
    ) -> None:
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.before_step: Callable[[int], None] | None = None
        """Called on the generating thread before each forward step (0 = prefill), before staged
        weights are looked at; tests use it to make an in-flight swap land on a chosen step."""
        device = next(model.parameters()).device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._version = version
        # Every name a state dict may use, tied aliases included; updates must cover the params.
        self._targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._required = {name for name, _ in model.named_parameters()}
        self._generate_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _pending and _busy
        self._pending: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._busy = False

    @classmethod
    def from_config(
        cls, cfg: TorchEngineConfig, *, model_path: str, device: str = "cpu"
    ) -> TorchEngine:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.dtype))
        # transformers decorates `to` with functools.wraps, which mypy cannot bind to `model`.
        model.to(device)  # type: ignore[arg-type]
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            model,
            eos_token_ids=eos_ids,
            max_batch_size=cfg.max_batch_size,
            seed=cfg.seed,
        )

    @property
    def version(self) -> int:
        return self._version

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        missing = self._required - tensors.keys()
        unknown = tensors.keys() - self._targets.keys()
        if missing or unknown:
            raise ValueError(
                f"weights for version {version}: missing {sorted(missing)[:5]}, "
                f"unknown {sorted(unknown)[:5]}"
            )
        for name, tensor in tensors.items():
            if tensor.shape != self._targets[name].shape:
                raise ValueError(
                    f"weights for version {version}: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(self._targets[name].shape)}"
                )
        with self._lock:
            newest = self._pending[0] if self._pending is not None else self._version
            if version <= newest:
                raise ValueError(f"version {version} is not newer than {newest}")
            self._pending = (version, tensors)
            if not self._busy:
                self._apply_pending()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        stop = self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        stop_ids = torch.tensor(stop, dtype=torch.long, device=self._generator.device)
        # Similar lengths share a micro-batch: less left padding.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Generation] = {}
        with self._generate_lock:
            self._set_busy(True)
            training = self.model.training
            self.model.eval()
            try:
                for start in range(0, len(order), self.max_batch_size):
                    chunk = order[start : start + self.max_batch_size]
                    batch = [prompts[i] for i in chunk]
                    generations = self._generate_batch(batch, params, stop_ids)
                    results.update(zip(chunk, generations, strict=True))
            finally:
                self.model.train(training)
                self._set_busy(False)
        return [results[i] for i in range(len(prompts))]

    def _set_busy(self, busy: bool) -> None:
        with self._lock:
            self._busy = busy
            if not busy:
                self._apply_pending()

    def _apply_pending(self) -> None:
        """Copy staged weights into the model; caller holds `_lock`."""
        if self._pending is None:
            return
        version, tensors = self._pending
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._targets[name].copy_(tensor)
        self._version = version
        self._pending = None

    def _step_version(self, step: int) -> int:
        if self.before_step is not None:
            self.before_step(step)
        with self._lock:
            self._apply_pending()
            return self._version

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, stop_ids: torch.Tensor
    ) -> list[Generation]:
        device = self._generator.device
        rows, width, steps = len(prompts), max(map(len, prompts)), params.max_new_tokens
        input_ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        # Mask over prompt + every response slot; row r's response token t sits at width + t.
        mask = torch.zeros(rows, width + steps, dtype=torch.bool, device=device)
        for r, prompt in enumerate(prompts):
            input_ids[r, width - len(prompt) :] = torch.tensor(prompt, device=device)
            mask[r, width - len(prompt) : width] = True
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        # Without padding (e.g. equal-length prompts) attention is plain causal: no mask to build.
        padded = not bool(mask[:, :width].all())

        tokens = torch.zeros(rows, steps, dtype=torch.long, device=device)
        logprobs = torch.zeros(rows, steps, dtype=torch.float32, device=device)
        versions = torch.zeros(rows, steps, dtype=torch.int32, device=device)
        lengths = torch.full((rows,), steps, dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)  # batch row -> original row
        cache = DynamicCache(config=self.model.config)
        for t in range(steps):
            version = self._step_version(t)
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask[:, : width + t] if padded else None,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logp = sampling_logprobs(out.logits[:, -1], params)
            token = torch.multinomial(logp.exp(), 1, generator=self._generator)
            tokens[active, t] = token[:, 0]
            logprobs[active, t] = logp.gather(-1, token)[:, 0]
            versions[active, t] = version
            done = torch.isin(token[:, 0], stop_ids)
            if done.any():
                lengths[active[done]] = t + 1
                stopped[active[done]] = True
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

        tokens_np = tokens.cpu().numpy().astype(np.int32)
        logprobs_np = logprobs.cpu().numpy()
        versions_np = versions.cpu().numpy()
        return [
            Generation(
                token_ids=tokens_np[r, :n].copy(),
                logprobs=logprobs_np[r, :n].copy(),
                versions=versions_np[r, :n].copy(),
                finish="stop" if stop else "length",
            )
            for r, (n, stop) in enumerate(zip(lengths.tolist(), stopped.tolist(), strict=True))
        ]
