"""Mixture-of-experts models: the builtin engine records each fed token's experts, they travel
on the wire (validated), and the trainer replays them (R3) — at lag 0 its log-probs then match
the engine's and the routing agrees by construction; without replay a routing that differs
from the trainer's own shows in the agreement figures and changes nothing else."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.algo.config import AlgoConfig
from asyncrl.algo.mismatch import RoutingAgreement, same_sets
from asyncrl.api.native import Model, parse_generate
from asyncrl.engines.config import SamplingParams
from asyncrl.engines.routing import MoeShape, moe_shape, moe_shape_of_config, routing_hooks
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.mismatch_report import render
from asyncrl.protocol import (
    Limits,
    Sample,
    TrajectoryGroup,
    ValidationError,
    decode_group,
    encode_group,
)
from asyncrl.serve.server import make_server
from asyncrl.sglang.client import RequestFailure
from asyncrl.sglang.config import SglangEngineConfig
from asyncrl.sglang.engine import SglangEngine, parse_routed_experts
from asyncrl.tiny_model import new_tiny_model, new_tiny_moe
from asyncrl.trainer.batch import collate, group_rows
from asyncrl.trainer.step import token_logprobs, train_step
from asyncrl.web.threaded import ApiError

from sample_groups import group_of

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 3, 13, 9, 14], [1, 8, 8, 13, 1, 2, 14]]
SHAPE = Limits(num_experts=8, moe_layers=2, moe_top_k=2)


def generate(model: torch.nn.Module, prompts: list[list[int]]) -> TrajectoryGroup:
    """One group per call: every prompt's response as a sample (prompt = the first prompt's
    length, so each test uses prompts of one length where it builds a group)."""
    engine = TorchEngine(model, eos_token_ids=[2], capture_routing=True, seed=3)
    gens = engine.generate(prompts, PARAMS)
    samples = [
        Sample(
            response_ids=g.token_ids,
            logprobs=g.logprobs,
            versions=g.versions,
            reward=float(i % 2),
            finish=g.finish,
            routed_experts=g.routed_experts,
        )
        for i, g in enumerate(gens)
    ]
    return group_of(samples, prompts[0], run="moe")


def test_engine_records_one_row_of_experts_per_fed_token() -> None:
    model = new_tiny_moe(0)
    assert moe_shape(model) == moe_shape_of_config(model.config)
    engine = TorchEngine(model, eos_token_ids=[2], capture_routing=True)
    for prompt, gen in zip(PROMPTS, engine.generate(PROMPTS, PARAMS), strict=True):
        routed = gen.routed_experts
        assert routed is not None and routed.dtype == np.uint16
        # Prompt tokens and every response token but the last (never fed): [tokens, layers, k].
        assert routed.shape == (len(prompt) + len(gen.token_ids) - 1, 2, 2)
        assert routed.max() < 8
        assert (routed[..., 0] != routed[..., 1]).all()  # top-2 picks two experts


def test_capture_needs_a_moe_model_and_no_prefix_cache() -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        TorchEngine(new_tiny_model(0), eos_token_ids=[2], capture_routing=True)
    with pytest.raises(ValueError, match="prefix_cache_tokens=0"):
        TorchEngine(
            new_tiny_moe(0), eos_token_ids=[2], capture_routing=True, prefix_cache_tokens=64
        )


def test_routing_round_trips_and_is_validated_on_read() -> None:
    group = generate(new_tiny_moe(0), [PROMPTS[0]] * 2)
    back = decode_group(encode_group(group), SHAPE)
    for s, b in zip(group.samples, back.samples, strict=True):
        assert b.routed_experts is not None and s.routed_experts is not None
        assert np.array_equal(b.routed_experts, s.routed_experts)
    # An entry without routing (an older writer, a dense model) still decodes.
    for s in group.samples:
        s.routed_experts = None
    assert all(s.routed_experts is None for s in decode_group(encode_group(group)).samples)

    def reason(routed: np.ndarray, limits: Limits = SHAPE) -> str:
        bad = generate(new_tiny_moe(0), [PROMPTS[0]] * 2)
        bad.samples[1].routed_experts = routed
        with pytest.raises(ValidationError) as info:
            decode_group(encode_group(bad), limits)
        return info.value.reason

    rows = len(PROMPTS[0]) + len(group.samples[1].response_ids) - 1
    assert reason(np.zeros((rows - 1, 2, 2), np.uint16)) == "routing_shape"
    assert reason(np.full((rows, 2, 2), 8, np.uint16)) == "routing_out_of_range"
    assert reason(np.zeros((rows, 2, 3), np.uint16)) == "routing_shape"  # not the model's top-k
    # Without the model's shape a reader still sees samples that disagree with each other.
    assert reason(np.zeros((rows, 1, 2), np.uint16), Limits()) == "routing_shape"


def _agreement(
    model: torch.nn.Module, group: TrajectoryGroup, replay: bool
) -> tuple[float, RoutingAgreement]:
    """Max |trainer − behaviour| log-prob over the response tokens, and the agreement table."""
    rows = group_rows([group], AlgoConfig(filter_zero_variance=False), PARAMS.max_new_tokens)
    mb = collate(rows)
    agreement = RoutingAgreement.empty(2)
    with torch.no_grad():
        logp = token_logprobs(model, mb, PARAMS, replay=replay, agreement=agreement)
    gap = ((logp - mb.behav_logp).abs() * mb.mask).max()
    return float(gap), agreement


def test_replay_at_lag_0_matches_the_engine_and_agrees_by_construction() -> None:
    model = new_tiny_moe(0)
    group = generate(model, [PROMPTS[0]] * 4)
    gap, agreement = _agreement(model, group, replay=True)
    assert gap < 1e-5
    assert agreement.mean() == 1.0 and agreement.worst_layer() == 1.0
    assert agreement.tokens == sum(len(s.routed_experts) for s in group.samples)  # type: ignore[arg-type]


def test_replay_really_routes_as_recorded() -> None:
    """Recorded experts the trainer's router would not pick: replay uses them (log-probs move,
    agreement stays 1), its own routing does not (agreement drops, log-probs stay)."""
    model = new_tiny_moe(0)
    group = generate(model, [PROMPTS[0]] * 4)
    for s in group.samples:
        assert s.routed_experts is not None
        s.routed_experts = ((s.routed_experts.astype(np.int64) + 3) % 8).astype(np.uint16)
    gap_own, own = _agreement(model, group, replay=False)
    gap_replay, replayed = _agreement(model, group, replay=True)
    assert gap_own < 1e-5  # the trainer routed itself: the engine's log-probs
    assert own.mean() is not None and own.mean() < 0.5
    assert replayed.mean() == 1.0
    # The first layer's router sees the same input either way: its own picks are unchanged.
    assert replayed.counts[0, 2] == own.counts[0, 2]
    assert gap_replay > 1e-3


def test_train_step_reports_agreement_and_trains_the_router(random_moe: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_moe)
    group = generate(model, [PROMPTS[0]] * 4)
    gate = model.model.layers[0].mlp.gate.weight
    before = gate.detach().clone()
    algo = AlgoConfig(routing_replay=True, filter_zero_variance=False)
    stats = train_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        group_rows([group], algo, PARAMS.max_new_tokens),
        algo=algo,
        sampling=PARAMS,
        micro_batch_tokens=64,
        grad_clip=1.0,
        current_version=0,
    )
    assert stats.routing is not None and stats.routing.mean() == 1.0
    assert stats.logprob_abs_diff_lag0 is not None and stats.logprob_abs_diff_lag0 < 1e-5
    # Replayed gate weights come from the router's logits: the router still learns.
    assert not torch.equal(before, gate.detach())


def test_mismatch_report_has_a_routing_section() -> None:
    line = {"step": 1, "trained": {}, "audit": {}}
    lines = [
        {
            **line,
            "routing": {
                "replay": False,
                "tokens": 10,
                "agreement": [0.9, 1.0],
                "router_agreement": [0.9, 1.0],
            },
        },
        {
            **line,
            "step": 2,
            "routing": {
                "replay": False,
                "tokens": 30,
                "agreement": [0.5, 1.0],
                "router_agreement": [0.5, 1.0],
            },
        },
    ]
    out = render(lines)
    assert "routing agreement (rollout vs trainer top-k sets), replay off, 40 tokens" in out
    assert "      0   0.600000   0.600000" in out  # (10 × 0.9 + 30 × 0.5) / 40


@pytest.fixture(scope="module")
def served_moe(random_moe: Path) -> Iterator[str]:
    """`asyncrl serve --enable-return-routed-experts` on the random tiny MoE, in this process."""
    server = make_server(str(random_moe), routed_experts=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _sglang(url: str, model: Path, capture: bool = True) -> SglangEngine:
    cfg = SglangEngineConfig.model_validate({"urls": [url], "retries": 0})
    return SglangEngine.from_config(cfg, model_path=str(model), capture_routing=capture)


def test_sglang_engine_gets_the_servers_routing(served_moe: str, random_moe: Path) -> None:
    engine = _sglang(served_moe, random_moe)
    try:
        gens = engine.generate(PROMPTS, PARAMS)
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(random_moe)
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        routed = gen.routed_experts
        assert routed is not None and routed.shape == (len(prompt) + len(gen.token_ids) - 1, 2, 2)
        # The server's routing is the one its model computes: a full forward routes alike.
        ids = torch.tensor([prompt + gen.token_ids.tolist()])
        with torch.no_grad(), routing_hooks(model) as own:
            model(input_ids=ids)
        mine = own.stacked(1)[0, : len(routed)].numpy()
        assert same_sets(torch.from_numpy(mine), torch.from_numpy(routed.astype(np.int64))).all()


def test_a_server_without_the_flag_refuses_and_bad_replies_are_malformed() -> None:
    body = {"input_ids": PROMPTS[0], "return_routed_experts": True}
    with pytest.raises(ApiError, match="--enable-return-routed-experts") as refused:
        parse_generate(body, Model(None, (2,), 15, None))  # a server without the flag
    assert refused.value.param == "return_routed_experts"
    assert parse_generate(body, Model(None, (2,), 15, None, routed_experts=True)).jobs[0].routed
    moe = MoeShape(layers=2, top_k=2, num_experts=8)

    def fails(meta: dict[str, object]) -> str:
        with pytest.raises(RequestFailure) as info:
            parse_routed_experts(meta, moe, rows=3)
        return info.value.detail

    ok = np.arange(12, dtype="<i4") % 8
    assert parse_routed_experts(
        {"routed_experts": base64.b64encode(ok.tobytes()).decode()}, moe, rows=3
    ).shape == (3, 2, 2)
    assert "enable-return-routed-experts" in fails({})
    assert "not base64" in fails({"routed_experts": "%%%"})
    assert "expected 3 tokens" in fails(
        {"routed_experts": base64.b64encode(ok[:8].tobytes()).decode()}
    )
    assert "outside" in fails({"routed_experts": base64.b64encode((ok + 8).tobytes()).decode()})
