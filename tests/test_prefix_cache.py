from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from asyncrl.engines.base import Generation
from asyncrl.engines.prefix_cache import CachedPrefix, PrefixCache
from asyncrl.engines.sampling import SamplingParams, sampling_logprobs
from asyncrl.tiny_model import save_random_tiny_model

from engine_helpers import PROMPTS, load_model, make_engine, perturbed, reference_logprobs

PARAMS = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _prefix(length: int, version: int = 0) -> CachedPrefix:
    return CachedPrefix(torch.full((length, 1, 2, 2, 4), float(length)), version)


def test_match_returns_longest_proper_prefix() -> None:
    cache = PrefixCache(max_tokens=100)
    cache.put([1, 2], _prefix(2))
    cache.put([1, 2, 3, 4], _prefix(4))
    cache.put([1, 9, 9], _prefix(3))
    assert cache.tokens == 9 and len(cache) == 3
    for _ in range(2):  # a hit leaves the entry for the next request with that prefix
        hit = cache.match([1, 2, 3, 4, 5], min_version=0)
        assert hit is not None and hit.length == 4
    assert cache.match([1, 2, 3, 7], min_version=0).length == 2  # type: ignore[union-attr]
    assert cache.match([1, 3], min_version=0) is None
    # The whole sequence is no hit: one token must be left to feed.
    assert cache.match([1, 9, 9], min_version=0) is None
    cache.put([1, 2], _prefix(2, version=3))  # the same tokens again replace the entry
    assert cache.tokens == 9 and cache.match([1, 2, 0], min_version=0).version == 3  # type: ignore[union-attr]


def test_budget_evicts_least_recently_used_and_versions_filter() -> None:
    cache = PrefixCache(max_tokens=7)
    cache.put([1, 2, 3], _prefix(3, version=0))
    cache.put([4, 5], _prefix(2, version=1))
    assert cache.match([1, 2, 3, 0], min_version=0) is not None  # now the most recent
    cache.put([6, 7, 8], _prefix(3, version=2))  # 8 tokens > 7: [4, 5] goes
    assert cache.tokens == 6 and cache.match([4, 5, 0], min_version=0) is None
    assert cache.match([1, 2, 3, 0], min_version=1) is None  # too old for the caller
    cache.put([1] * 8, _prefix(8))  # larger than the whole budget: not stored
    assert cache.tokens == 6
    cache.drop_older(2)
    assert cache.match([1, 2, 3, 0], min_version=0) is None
    assert cache.match([6, 7, 8, 0], min_version=2) is not None
    assert cache.tokens == 3
    with pytest.raises(ValueError, match="3 tokens but KV for 2"):
        cache.put([1, 2, 3], _prefix(2))


def _next_turn(
    prompts: list[list[int]], gens: list[Generation], observations: list[list[int]]
) -> list[list[int]]:
    return [
        p + g.token_ids.tolist() + o for p, g, o in zip(prompts, gens, observations, strict=True)
    ]


def _fed(prompts: list[list[int]], gens: list[Generation]) -> int:
    """Tokens of KV a cache keeps after `gens`: prompt and response, less the unfed last token."""
    return sum(len(p) + len(g.token_ids) - 1 for p, g in zip(prompts, gens, strict=True))


@pytest.mark.parametrize(
    "observations",
    [
        [[1, 5, 6, 13]] * len(PROMPTS),  # equal tails: every cached token is used
        [[1, 5], [1, 5, 6, 13, 7, 7], [1], [1, 8, 8], [1, 3, 13]],  # some cached tokens refed
    ],
)
def test_next_turn_reuses_prefix_and_stays_exact(
    model_dir: Path, observations: list[list[int]]
) -> None:
    engine = make_engine(model_dir, prefix_cache_tokens=1000, seed=5)
    plain = make_engine(model_dir, seed=5)
    reference_model = load_model(model_dir)
    first = engine.generate(PROMPTS, PARAMS)
    assert all(g.cached_tokens == 0 for g in first)
    second_prompts = _next_turn(PROMPTS, first, observations)
    # Fresh prompts in the same batch have nothing cached; the long one has its head prefilled
    # on its own, then joins the batch like a hit.
    batch = [*second_prompts, [1, 4, 4, 13], [1] + [6] * 14]
    second = engine.generate(batch, PARAMS)
    reused = sum(g.cached_tokens for g in second)
    if len({len(o) for o in observations}) == 1:
        assert reused == _fed(PROMPTS, first)
    else:
        assert 0 < reused < _fed(PROMPTS, first)
    # Each row reports its own share: a hit at most its previous turn's keys, a fresh row none.
    kept = [len(p) + len(g.token_ids) - 1 for p, g in zip(PROMPTS, first, strict=True)]
    for held, gen in zip(kept, second, strict=False):
        assert 0 <= gen.cached_tokens <= held
    assert second[-2].cached_tokens == second[-1].cached_tokens == 0
    for prompt, gen in zip(batch, second, strict=True):
        expected = reference_logprobs(reference_model, prompt, gen.token_ids, PARAMS)
        np.testing.assert_allclose(gen.logprobs, expected, rtol=0, atol=1e-5)
    # Same seed, same draws as an engine that prefills everything.
    plain.generate(PROMPTS, PARAMS)
    for a, b in zip(second, plain.generate(batch, PARAMS), strict=True):
        assert np.array_equal(a.token_ids, b.token_ids)


def test_weight_swap_between_turns_drops_old_keys(model_dir: Path) -> None:
    engine = make_engine(model_dir, prefix_cache_tokens=1000)
    new_weights = perturbed(load_model(model_dir), seed=1)
    new_model = load_model(model_dir)
    new_model.load_state_dict(new_weights, strict=False)
    first = engine.generate(PROMPTS, PARAMS)
    engine.stage_weights({k: v.clone() for k, v in new_weights.items()}, version=1)
    second_prompts = _next_turn(PROMPTS, first, [[1, 5]] * len(PROMPTS))
    second = engine.generate(second_prompts, PARAMS)
    assert all(g.cached_tokens == 0 for g in second)
    for prompt, gen in zip(second_prompts, second, strict=True):
        expected = reference_logprobs(new_model, prompt, gen.token_ids, PARAMS)
        np.testing.assert_allclose(gen.logprobs, expected, rtol=0, atol=1e-5)


def test_stale_reuse_attends_to_old_keys(model_dir: Path) -> None:
    engine = make_engine(model_dir, prefix_cache_tokens=1000, prefix_cache_stale=True)
    old_model, new_model = load_model(model_dir), load_model(model_dir)
    new_weights = perturbed(old_model, seed=1)
    new_model.load_state_dict(new_weights, strict=False)
    first = engine.generate(PROMPTS, PARAMS)
    engine.stage_weights({k: v.clone() for k, v in new_weights.items()}, version=1)
    second_prompts = _next_turn(PROMPTS, first, [[1, 5]] * len(PROMPTS))
    second = engine.generate(second_prompts, PARAMS)
    assert sum(g.cached_tokens for g in second) == _fed(PROMPTS, first)
    for prompt, gen, prev in zip(PROMPTS, second, first, strict=True):
        assert (gen.versions == 1).all()
        head = prompt + prev.token_ids[:-1].tolist()
        tail = second_prompts[PROMPTS.index(prompt)][len(head) :] + gen.token_ids[:-1].tolist()
        with torch.no_grad():
            cache = DynamicCache(config=old_model.config)
            old_model(input_ids=torch.tensor([head]), cache=cache, use_cache=True)
            logits = new_model(input_ids=torch.tensor([tail]), cache=cache, use_cache=True).logits
        logp = sampling_logprobs(logits[0, -len(gen.token_ids) :], PARAMS)
        mixed = logp.gather(-1, torch.from_numpy(gen.token_ids).long()[:, None])[:, 0]
        np.testing.assert_allclose(gen.logprobs, mixed.numpy(), rtol=0, atol=1e-5)


def test_keys_from_a_swap_mid_sequence_count_as_old(model_dir: Path) -> None:
    engine = make_engine(model_dir, prefix_cache_tokens=1000)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=())
    new_weights = perturbed(load_model(model_dir), seed=1)

    def swap(step: int) -> None:
        if step == 2:
            engine.stage_weights({k: v.clone() for k, v in new_weights.items()}, version=1)

    engine.before_step = swap
    first = engine.generate(PROMPTS, params)
    engine.before_step = None
    assert engine.version == 1 and all(g.versions[-1] == 1 for g in first)
    # Their prompts' keys came from version 0: not reused under version 1.
    second = engine.generate(_next_turn(PROMPTS, first, [[1]] * len(PROMPTS)), params)
    assert all(g.cached_tokens == 0 for g in second)
