"""Data parallelism changes nothing: `train_step` on 2 gloo ranks, each holding half of the
groups, gives the weights one process gets on the whole batch (DESIGN §6: global normalisers,
gradients summed over ranks), whether the ranks replicate the model (`ddp`) or shard it with
FSDP2 (`fsdp`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.algo.config import AlgoConfig
from asyncrl.trainer.batch import group_rows
from asyncrl.trainer.packing import pack_microbatches

import trainer_step_proc as proc

HELPER = Path(__file__).with_name("trainer_step_proc.py")
REPO = HELPER.parent.parent


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_rank_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp(f"dist-{request.param}")
    store = out / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), str(rank), "2", str(store), str(out), request.param],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=240)
            logs.append(stdout.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return {
        name: [torch.load(out / f"{name}-rank{r}.pt", weights_only=True) for r in range(2)]
        for name in [*proc.CASES, "adamw"]
    }


def micro_batches_per_rank(micro_batch_tokens: int) -> list[int]:
    groups = proc.make_groups()
    half = len(groups) // 2
    counts = []
    for share in (groups[:half], groups[half:]):
        rows = group_rows(share, AlgoConfig(), proc.SAMPLING.max_new_tokens)
        counts.append(len(pack_microbatches([r.length for r in rows], micro_batch_tokens)[0]))
    return counts


@pytest.mark.parametrize("name", list(proc.CASES))
def test_two_ranks_equal_one_rank(name: str, two_rank_results: dict[str, list[dict]]) -> None:
    torch.set_num_threads(1)
    single = proc.run_case(name, proc.make_groups(), None)
    ranks = two_rank_results[name]
    initial = proc.new_tiny_model(seed=0).state_dict()

    moved = max(float((single["params"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-4, "the step did not change the weights: the comparison would be vacuous"
    assert {n for n, _ in proc.new_tiny_model().named_parameters()} <= set(ranks[0]["params"])
    for rank in ranks:
        # An FSDP rank other than 0 holds shards only: its figures are compared, not weights.
        for key, value in rank["params"].items():
            torch.testing.assert_close(value, single["params"][key], rtol=0, atol=1e-6, msg=key)
        assert rank["tokens"] == single["tokens"]
        assert rank["lag0_tokens"] == single["lag0_tokens"] > 0
        assert rank["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
        assert rank["loss"] == pytest.approx(single["loss"], abs=1e-6)
        assert rank["diff"] == pytest.approx(single["diff"], rel=1e-5)
        # The mismatch table covers every trained token at its lag, summed over the ranks.
        for table in ("mismatch_by_prob", "mismatch_by_position"):
            torch.testing.assert_close(rank[table], single[table], rtol=1e-5, atol=1e-6)
            assert rank[table][..., 0].sum() == single["tokens"]
    # The groups mix tokens of the current version and of the one before: lags 0 and 1 only.
    per_lag = single["mismatch_by_prob"][..., 0].sum(-1)
    assert per_lag[0] > 0 and per_lag[1] > 0 and per_lag[2:].sum() == 0
    # Lag is a whole response's: lag 0 holds exactly the tokens of the lag-0 figure.
    assert per_lag[0] == single["lag0_tokens"]

    micro_batch_tokens = proc.CASES[name][1]
    counts = micro_batches_per_rank(micro_batch_tokens)
    if micro_batch_tokens < 100:
        assert counts[0] > counts[1], f"ranks should run different micro-batch counts: {counts}"


def test_the_trainers_fused_adamw_gives_the_for_loop_weights(
    two_rank_results: dict[str, list[dict]],
) -> None:
    """The trainer's AdamW kernel (fused on CPU: no temporaries the size of a parameter) takes
    the weights where torch's for-loop one does, over three steps on two ranks, replicated or
    FSDP2-sharded (DTensor parameters), to float32 rounding."""
    initial = proc.new_tiny_model(seed=0).state_dict()
    compared = 0
    for rank in two_rank_results["adamw"]:
        assert rank["trainer_flags"] == {"fused": True}
        assert rank["for_loop_flags"] == {"foreach": False}
        loop, fused = rank["for_loop"], rank["trainer"]
        assert loop.keys() == fused.keys()
        if not loop:
            continue  # an FSDP rank other than 0 holds shards only
        moved = max(float((loop[k] - initial[k]).abs().max()) for k in loop)
        assert moved > 1e-3, "AdamW did not move the weights: the comparison would be vacuous"
        for key, value in fused.items():
            torch.testing.assert_close(value, loop[key], rtol=0, atol=1e-6, msg=key)
        compared += 1
    assert compared


def test_the_chunked_head_trains_the_whole_logits_weights(
    two_rank_results: dict[str, list[dict]],
) -> None:
    """On two ranks, replicated or FSDP2-sharded, the head in chunks (a tied embedding, a
    reference model) takes the step the whole logits take, to float32 rounding."""
    compared = 0
    for whole, chunked in zip(
        two_rank_results["kl-loss-small-mb"],
        two_rank_results["chunked-head-kl-small-mb"],
        strict=True,
    ):
        assert whole["params"].keys() == chunked["params"].keys()
        for key, value in chunked["params"].items():
            torch.testing.assert_close(value, whole["params"][key], rtol=0, atol=1e-6, msg=key)
            compared += 1
        assert chunked["loss"] == pytest.approx(whole["loss"], abs=1e-6)
        assert chunked["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert compared


SMALL_MB_CASES = [n for n in proc.CASES if n.endswith("-small-mb")]


@pytest.mark.parametrize("name", SMALL_MB_CASES)
def test_micro_batches_change_nothing(name: str) -> None:
    """One process, the whole batch in one micro-batch or split over several (padded to
    different widths): the same update. With `test_two_ranks_equal_one_rank`, single process ==
    micro-batched == 2 ranks for every aggregation and correction of the cases."""
    torch.set_num_threads(1)
    groups = proc.make_groups()
    split = proc.run_case(name, groups, None)
    whole = proc.run_case(name, groups, None, micro_batch_tokens=100_000)
    rows = group_rows(groups, AlgoConfig(), proc.SAMPLING.max_new_tokens)
    lengths = [r.length for r in rows]
    assert len(pack_microbatches(lengths, proc.CASES[name][1])[0]) > 3
    assert len(pack_microbatches(lengths, 100_000)[0]) == 1
    for key, value in whole["params"].items():
        torch.testing.assert_close(split["params"][key], value, rtol=0, atol=1e-6, msg=key)
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    if "mask" in name:  # masking dropped some tokens and kept others: not a vacuous case
        assert 0.1 < whole["weight_mean"] < 0.9


def _step_loss(rows: list, algo: AlgoConfig, micro_batch_tokens: int) -> float:
    model = proc.new_tiny_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return proc.step(model, optimizer, rows, algo, micro_batch_tokens).loss


@pytest.mark.parametrize("micro_batch_tokens", [100_000, 24])
def test_seq_mean_token_sum_norm_is_verls_sum_over_rows(micro_batch_tokens: int) -> None:
    """verl's `agg_loss(..., "seq-mean-token-sum-norm")` = Σ mL / T, T = `loss_scale_factor` or
    the response width. With π_prox = sg(logp) the ratio is 1 and, without correction, each
    trained token's loss is -A, so the step's loss is -Σ_rows A_i n_i / T (n_i trained tokens),
    T the longest response; not divided by the number of rows (the old definition was). The
    batch-size-free `seq-mean-token-sum-horizon` divides by the rows as well."""
    torch.set_num_threads(1)
    groups = proc.make_groups()
    algo = AlgoConfig(aggregation="seq-mean-token-sum-norm", correction="none")
    rows = group_rows(groups, algo, proc.SAMPLING.max_new_tokens)
    horizon = max(r.length - r.n_prompt for r in rows)
    trained = [r for r in rows if r.loss_mask.any()]
    total = -sum(r.advantage * float(r.loss_mask.sum()) for r in trained)
    assert len(trained) > 1 and abs(total) > 1e-3

    loss = _step_loss(rows, algo, micro_batch_tokens)
    assert loss == pytest.approx(total / horizon, rel=1e-5)
    scaled = algo.model_copy(update={"loss_scale_factor": 64})
    assert _step_loss(rows, scaled, micro_batch_tokens) == pytest.approx(total / 64, rel=1e-5)
    per_row = algo.model_copy(update={"aggregation": "seq-mean-token-sum-horizon"})
    expected = total / (horizon * len(trained))
    assert _step_loss(rows, per_row, micro_batch_tokens) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_masking_removes_rejected_tokens_from_the_loss_and_its_normalisers(
    aggregation: str,
) -> None:
    """verl's rejection sampling (`rollout_rs`) replaces the response mask: a rejected token
    leaves the loss and its normalisers. So a masking step equals a step without correction on
    rows whose loss mask already lacks the tokens masking rejects."""
    import dataclasses

    from asyncrl.algo.correction import behaviour_mask_weights
    from asyncrl.trainer.batch import collate
    from asyncrl.trainer.step import token_logprobs

    torch.set_num_threads(1)
    algo = AlgoConfig(correction="mask", aggregation=aggregation)
    rows = group_rows(proc.make_groups(), algo, proc.SAMPLING.max_new_tokens)
    model = proc.new_tiny_model(seed=0).train()
    with torch.no_grad():
        mb = collate(rows)
        prox = token_logprobs(model, mb, proc.SAMPLING)
    keep = behaviour_mask_weights(prox, mb.behav_logp, mb.mask, lo=algo.mask_low, hi=algo.mask_high)
    pre_masked = [
        dataclasses.replace(r, loss_mask=keep[i, r.n_prompt - 1 : r.length - 1].numpy())
        for i, r in enumerate(rows)
    ]
    dropped = float(mb.mask.sum() - keep.sum()) / float(mb.mask.sum())
    assert 0.1 < dropped < 0.9
    assert any(not r.loss_mask.any() for r in pre_masked if r.advantage)  # a whole row goes too

    results = []
    no_correction = algo.model_copy(update={"correction": "none"})
    for batch, step_algo in ((rows, algo), (pre_masked, no_correction)):
        m = proc.new_tiny_model(seed=0)
        stats = proc.step(m, torch.optim.SGD(m.parameters(), lr=0.5), batch, step_algo, 24)
        results.append((stats, m.state_dict()))
    (masked, masked_params), (none, none_params) = results
    assert masked.loss == pytest.approx(none.loss, rel=1e-5)
    assert masked.grad_norm == pytest.approx(none.grad_norm, rel=1e-5)
    for key, value in none_params.items():
        torch.testing.assert_close(masked_params[key], value, rtol=0, atol=1e-6, msg=key)


def test_lag0_figures_count_only_responses_of_the_current_weights() -> None:
    """`behaviour_logprob_abs_diff_lag0` compares like with like: only responses generated
    entirely by the weights being trained. A response whose weights were swapped mid-generation
    has later tokens stamped with the new version, but their logits came from a KV cache of the
    old weights, so the trainer's recomputation differs by more than float rounding."""
    import numpy as np

    from asyncrl.engines.config import SamplingParams
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.protocol import Sample, TrajectoryGroup
    from asyncrl.trainer.step import train_step

    torch.set_num_threads(1)
    new = proc.new_tiny_model(seed=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(99,))
    prompt = [1, 5, 6, 13, 7, 8, 14]

    def generate(swap_at: int) -> list[Sample]:
        engine = TorchEngine(proc.new_tiny_model(seed=0), eos_token_ids=[2])

        def before_step(step: int) -> None:
            if step == swap_at:
                engine.stage_weights(dict(new.named_parameters()), 1)

        engine.before_step = before_step
        gens = engine.generate([prompt] * 4, sampling)
        return [
            Sample(g.token_ids, g.logprobs, g.versions, float(i % 2), g.finish)
            for i, g in enumerate(gens)
        ]

    def lag0(samples: list[Sample]) -> tuple[int, float | None]:
        group = TrajectoryGroup("r", "0-0", "p", 0, "w", 0.0, 0.0, np.array(prompt, np.int32), [])
        group.samples = samples
        algo = AlgoConfig(filter_zero_variance=False)
        rows = group_rows([group], algo, sampling.max_new_tokens)
        model = proc.new_tiny_model(seed=1)  # the trainer holds version 1 = `new`
        stats = train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            rows,
            algo=algo,
            sampling=sampling,
            micro_batch_tokens=10_000,
            grad_clip=1.0,
            current_version=1,
        )
        return stats.lag0_tokens, stats.logprob_abs_diff_lag0

    whole = generate(swap_at=0)  # every token by version 1, prefill included
    assert all((s.versions == 1).all() for s in whole)
    tokens, diff = lag0(whole)
    assert tokens == sum(len(s.response_ids) for s in whole)
    assert diff is not None and diff < 1e-5

    mixed = generate(swap_at=3)  # tokens 0-2 by version 0, the rest stamped 1
    assert all(list(s.versions[:3]) == [0, 0, 0] and (s.versions[3:] == 1).all() for s in mixed)
    assert lag0(mixed) == (0, None)


def test_rows_without_trained_tokens_cost_no_compute_and_change_nothing() -> None:
    """A group whose rewards are all equal is masked out (`filter_zero_variance`): the step
    skips its rows' forward and backward, and the update is the one without that group."""
    import dataclasses

    torch.set_num_threads(1)
    groups = proc.make_groups()
    flat = dataclasses.replace(
        groups[0], samples=[dataclasses.replace(s, reward=1.0) for s in groups[0].samples]
    )
    algo = AlgoConfig()
    results = []
    for batch in (groups, [*groups, flat]):
        rows = group_rows(batch, algo, proc.SAMPLING.max_new_tokens)
        model = proc.new_tiny_model(seed=0)
        stats = proc.step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), rows, algo)
        results.append((stats, [p.detach().clone() for p in model.parameters()]))
    (base, base_params), (with_flat, flat_params) = results
    assert with_flat.processed_tokens == base.processed_tokens
    assert with_flat.tokens == base.tokens
    for a, b in zip(base_params, flat_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_a_non_finite_step_is_skipped_and_overflowing_weights_are_caught() -> None:
    """An infinite advantage makes the loss and the gradients NaN: the optimizer does not step,
    so weights and optimizer state stay as they were. Weights that are not finite all the same
    (numerics gone wrong) are reported by `weights_finite`; the trainer then refuses to publish
    them."""
    import dataclasses

    from asyncrl.trainer.step import weights_finite

    torch.set_num_threads(1)
    algo = AlgoConfig()
    rows = group_rows(proc.make_groups(), algo, proc.SAMPLING.max_new_tokens)
    poisoned = [dataclasses.replace(rows[0], advantage=float("inf")), *rows[1:]]

    def step(batch: list, lr: float) -> tuple[bool, list[bool], dict, torch.nn.Module]:
        model = proc.new_tiny_model(seed=0)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        stats = proc.step(model, optimizer, batch, algo)
        changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
        return stats.skipped, changed, optimizer.state, model

    skipped, changed, state, model = step(poisoned, lr=1e-3)
    assert skipped and not any(changed) and not state and weights_finite(model)

    skipped, changed, state, model = step(rows, lr=1e-3)
    assert not skipped and all(changed) and state and weights_finite(model)
    with torch.no_grad():
        list(model.parameters())[-1].view(-1)[0] = float("nan")
    assert not weights_finite(model)


def test_the_step_record_takes_the_steps_figures_by_field() -> None:
    """Each `StepStats` field named as a `StepRecord` figure (or naming one in its metadata) is
    that figure of the record with no copy in the loop; the quantiles give the p50/p90/p99."""
    import dataclasses

    from asyncrl.algo.mismatch import MismatchTable
    from asyncrl.metrics.record import StepRecord
    from asyncrl.trainer.step import StepStats

    stats = StepStats(
        loss=0.25,
        grad_norm=1.5,
        tokens=1200,
        clip_fraction=0.1,
        behaviour_weight_mean=0.98,
        behaviour_weight_capped_fraction=0.01,
        logprob_abs_diff_lag0=0.003,
        lag0_tokens=40,
        weight_quantiles=(1.0, 1.2, 1.9),
        processed_tokens=5000,
        mismatch=MismatchTable.empty(),
        audit=MismatchTable.empty(),
        skipped=True,
    )
    record = dataclasses.asdict(StepRecord(step=3, **stats.figures()))
    renamed = {"logprob_abs_diff_lag0": "behaviour_logprob_abs_diff_lag0"}
    renamed |= {"skipped": "skipped_nonfinite"}
    for name in ("loss", "grad_norm", "tokens", "clip_fraction", "lag0_tokens", *renamed):
        assert record[renamed.get(name, name)] == getattr(stats, name), name
    assert record["behaviour_weight_mean"] == 0.98
    assert record["behaviour_weight_capped_fraction"] == 0.01
    quantiles = (record[f"behaviour_weight_p{q}"] for q in (50, 90, 99))
    assert tuple(quantiles) == (1.0, 1.2, 1.9)
    assert "processed_tokens" not in record and record["audit_tokens"] is None
