import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from asyncrl.engines.sampling import SamplingParams, sampling_logprobs
from asyncrl.tiny_model import EOS_ID, save_random_tiny_model
from asyncrl.weights.base import Released

from engine_helpers import PROMPTS, load_model, make_engine, perturbed, reference_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize(
    ("prompts", "params"),
    [
        (PROMPTS * 2, SamplingParams(max_new_tokens=12)),
        (PROMPTS * 2, SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=12)),
        ([[1, 4, 5, 13]] * 12, SamplingParams(max_new_tokens=12)),  # no padding at all
    ],
)
def test_behaviour_logprobs_equal_full_forward(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams
) -> None:
    engine = make_engine(model_dir, max_batch_size=5)  # several micro-batches per call
    reference_model = load_model(model_dir)
    gens = engine.generate(prompts, params)
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids.dtype == np.int32 and gen.logprobs.dtype == np.float32
        assert gen.versions.dtype == np.int32 and (gen.versions == 0).all()
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) >= 1
        assert (gen.logprobs <= 0).all()
        expected = reference_logprobs(reference_model, prompt, gen.token_ids, params)
        np.testing.assert_allclose(gen.logprobs, expected, rtol=0, atol=1e-5)
    # Rows that stop early leave the batch; the rows still running must stay exact.
    assert {g.finish for g in gens} == {"stop", "length"}


def test_same_seed_same_samples(model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=8)
    first = make_engine(model_dir, seed=3).generate(PROMPTS, params)
    second = make_engine(model_dir, seed=3).generate(PROMPTS, params)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.token_ids, b.token_ids)
        assert np.array_equal(a.logprobs, b.logprobs)


def test_in_flight_swap_between_decode_steps(model_dir: Path) -> None:
    swap_step, steps = 3, 8
    params = SamplingParams(max_new_tokens=steps, stop_token_ids=())
    engine = make_engine(model_dir)
    old_model, new_model = load_model(model_dir), load_model(model_dir)
    new_weights = perturbed(old_model, seed=1)
    new_model.load_state_dict(new_weights, strict=False)

    def stage_from_sync_thread(step: int) -> None:
        if step == swap_step:
            weights = {k: v.clone() for k, v in new_weights.items()}
            sync = threading.Thread(target=engine.stage_weights, args=(weights, 1))
            sync.start()
            sync.join()

    engine.before_step = stage_from_sync_thread
    gens = engine.generate(PROMPTS, params)
    assert engine.version == 1
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        assert gen.versions.tolist() == [0] * swap_step + [1] * (steps - swap_step)
        response = gen.token_ids
        # Before the swap: the old weights alone.
        old = reference_logprobs(old_model, prompt, response, params)
        np.testing.assert_allclose(gen.logprobs[:swap_step], old[:swap_step], atol=1e-5)
        # After: the new weights, attending to the cache the old ones filled (it is kept).
        with torch.no_grad():
            cache = DynamicCache(config=old_model.config)
            head = torch.tensor([prompt + response[: swap_step - 1].tolist()])
            old_model(input_ids=head, cache=cache, use_cache=True)
            tail = torch.from_numpy(response[swap_step - 1 : -1]).long()[None]
            logits = new_model(input_ids=tail, cache=cache, use_cache=True).logits[0]
            logp = sampling_logprobs(logits, params)
        mixed = logp.gather(-1, torch.from_numpy(response[swap_step:]).long()[:, None])[:, 0]
        np.testing.assert_allclose(gen.logprobs[swap_step:], mixed.numpy(), atol=1e-5)
        assert not np.allclose(gen.logprobs[swap_step:], old[swap_step:], atol=1e-3)


def test_newest_staged_weights_win(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    model = load_model(model_dir)
    v1, v2 = perturbed(model, seed=1), perturbed(model, seed=2)

    def stage_twice(step: int) -> None:
        if step == 2:
            engine.stage_weights(v1, 1)
            engine.stage_weights(v2, 2)  # arrives before v1 was applied: v1 is never used

    engine.before_step = stage_twice
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, stop_token_ids=()))
    assert all(g.versions.tolist() == [0, 0, 2, 2] for g in gens)
    synced = engine.state_dict_for_sync()
    assert all(torch.equal(synced[name], v2[name]) for name in v2)


def test_idle_engine_applies_weights_at_once(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    weights = perturbed(load_model(model_dir), seed=4)
    engine.stage_weights(weights, 5)
    assert engine.version == 5
    synced = engine.state_dict_for_sync()
    assert synced.keys() == weights.keys()
    assert all(torch.equal(synced[name], weights[name]) for name in weights)
    gen = engine.generate([[1, 4]], SamplingParams(max_new_tokens=3))[0]
    assert (gen.versions == 5).all()


def test_bad_weights_are_refused(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    weights = perturbed(load_model(model_dir), seed=0)
    name = next(iter(weights))
    with pytest.raises(ValueError, match="not newer"):
        engine.stage_weights(weights, 0)
    with pytest.raises(ValueError, match=f"missing \\['{name}'\\]"):
        engine.stage_weights({k: v for k, v in weights.items() if k != name}, 1)
    with pytest.raises(ValueError, match="unknown \\['bogus'\\]"):
        engine.stage_weights({**weights, "bogus": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match=f"{name} has shape"):
        engine.stage_weights({**weights, name: torch.zeros(2, 2)}, 1)
    assert engine.version == 0


def test_stop_tokens_and_finish_reasons(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(max_new_tokens=30)  # stop on the model's EOS
    gens = engine.generate([[1, 4, 5]] * 64, params)
    for gen in gens:
        tokens = gen.token_ids.tolist()
        assert EOS_ID not in tokens[:-1]
        if gen.finish == "stop":
            assert tokens[-1] == EOS_ID
        else:
            assert len(tokens) == 30 and tokens[-1] != EOS_ID
    assert {g.finish for g in gens} == {"stop", "length"}


def test_greedy_custom_stop_and_length(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=())
    free = engine.generate([[1, 7, 7]], greedy)[0]
    assert free.finish == "length" and len(free.token_ids) == 5
    assert (free.logprobs == 0).all()
    first = int(free.token_ids[0])
    stop_params = greedy.model_copy(update={"stop_token_ids": (first,)})
    stopped = engine.generate([[1, 7, 7]], stop_params)[0]
    assert stopped.finish == "stop" and stopped.token_ids.tolist() == [first]


def test_generate_restores_model_mode_and_checks_prompts(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.model.train()
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert engine.model.training
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[1], []], SamplingParams())


def test_rescore_is_the_trainer_path_on_the_engines_weights(model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=10)
    engine = make_engine(model_dir)
    reference_model = load_model(model_dir)
    gens = engine.generate(PROMPTS, params)
    version, scores = engine.rescore(
        [(p + g.token_ids.tolist(), len(p)) for p, g in zip(PROMPTS, gens, strict=True)],
        params,
        "float32",
    )
    assert version == 0
    for prompt, gen, score in zip(PROMPTS, gens, scores, strict=True):
        assert score.dtype == np.float32 and len(score) == len(gen.token_ids)
        expected = reference_logprobs(reference_model, prompt, gen.token_ids, params)
        np.testing.assert_allclose(score, expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(score, gen.logprobs, rtol=0, atol=1e-5)
    # New weights: the version the scores were computed with moves with them.
    engine.stage_weights(perturbed(reference_model, seed=1), 1)
    assert engine.rescore([(PROMPTS[0] + [5], len(PROMPTS[0]))], params, "float32")[0] == 1


def test_rescore_in_float32_of_a_bfloat16_engine_differs_from_its_behaviour(
    model_dir: Path,
) -> None:
    params = SamplingParams(max_new_tokens=10)
    engine = make_engine(model_dir, dtype="bfloat16")
    gens = engine.generate(PROMPTS, params)
    seqs = [(p + g.token_ids.tolist(), len(p)) for p, g in zip(PROMPTS, gens, strict=True)]
    _, scores = engine.rescore(seqs, params, "float32")
    diff = np.concatenate([abs(s - g.logprobs) for s, g in zip(scores, gens, strict=True)])
    assert diff.mean() > 1e-4, diff  # 10 × the float32 engine's bound above
    # The float32 copy holds the engine's own (rounded) weights; the engine keeps bfloat16.
    assert next(engine.model.parameters()).dtype == torch.bfloat16


def test_released_weights_are_kept_others_copied(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    model = load_model(model_dir)
    live = dict(engine.model.named_parameters())
    plain = perturbed(model, seed=5)
    engine.stage_weights(plain, 1)
    # Handed over by a caller that may write them again: copied, never aliased.
    assert all(live[n].data_ptr() != t.data_ptr() for n, t in plain.items() if n in live)
    before = {n: live[n].detach().clone() for n in plain if n in live}
    for t in plain.values():
        t.add_(1.0)
    assert all(torch.equal(live[n].detach(), before[n]) for n in before)
    released = Released(perturbed(model, seed=6))
    name = next(iter(released))
    released[name] = released[name].double()  # another dtype than the engine's: cast, copied
    engine.stage_weights(released, 2)
    synced = engine.state_dict_for_sync()
    kept = [n for n in released if n != name and n in live]
    assert kept and all(live[n].data_ptr() == released[n].data_ptr() for n in kept)
    assert live[name].dtype != torch.float64 and live[name].data_ptr() != released[name].data_ptr()
    assert all(torch.equal(synced[n], released[n].to(synced[n].dtype)) for n in released)
    # Generation runs on the kept tensors, as on loaded ones.
    reference = load_model(model_dir)
    reference.load_state_dict(dict(released), strict=False)
    params = SamplingParams(max_new_tokens=4)
    gen = engine.generate([PROMPTS[0]], params)[0]
    expected = reference_logprobs(reference, PROMPTS[0], gen.token_ids, params)
    np.testing.assert_allclose(gen.logprobs, expected, rtol=0, atol=1e-5)
