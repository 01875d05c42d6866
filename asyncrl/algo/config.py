"""Configuration of the RL objective: advantages, loss, off-policy correction, staleness, KL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Section


class AlgoConfig(Section):
    loss: Literal["ppo", "gspo"] = "ppo"
    """Policy loss: `ppo` (token-level clipped, decoupled PPO) or `gspo` (sequence-level ratio)."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Group advantage: `grpo` (std-normalised), `drgrpo` (mean-centred only), `rloo`."""
    max_staleness: int = Field(default=4, ge=0)
    """η, the bound where work starts: admission keeps at most (η + 1) × groups_per_step prompt
    groups released but not yet trained, and a rollout worker starts a prompt only with weights
    at most η versions older than the trainer's when it released it. Under `stale_policy: drop`
    it also bounds a group's staleness (trainer version − its oldest token's) at train time."""
    stale_policy: Literal["train", "drop"] = "train"
    """What happens to a group that ends up staler than η: `train` it (episodes in flight go on
    with new weights, every token is corrected by its behaviour log-prob, tokens older than
    `max_token_lag` leave the loss; nothing is dropped for staleness, so long episodes are
    trained), or `drop` it (the trainer drops finished groups staler than η and rollout workers
    give up groups in flight that fell behind: cheaper per group, biased toward short episodes,
    as `length_bias_ks` shows)."""
    max_token_lag: int | None = Field(default=None, ge=0)
    """Tokens more than this many versions older than the trainer's weights leave the loss
    (the group stays: its rewards still set its siblings' advantages, its newer turns are
    trained); null: 2 × η (0 in sync mode, where every token is current)."""
    clip_low: float = Field(default=0.2, ge=0)
    """Lower clip ε of the ratio (1 − clip_low). GSPO wants ~3e-4."""
    clip_high: float = Field(default=0.2, ge=0)
    """Upper clip ε of the ratio (1 + clip_high); above clip_low is DAPO's clip-higher."""
    dual_clip: float | None = Field(default=3.0, gt=1)
    """Dual-clip bound c for negative advantages (PPO only); null disables it."""
    aggregation: Literal[
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum-horizon",
    ] = "token-mean"
    """How the token loss matrix L (mask m) becomes a scalar, as verl's `loss_agg_mode`:
    `token-mean` Σ mL / Σ m; `seq-mean-token-mean` mean over responses of their token mean;
    `seq-mean-token-sum` mean over responses of their token sum; `seq-mean-token-sum-norm`
    verl's Dr.GRPO, Σ mL / T, summed over all responses and divided by the horizon T only (so it
    grows with the batch); `seq-mean-token-sum-horizon` the batch-size-free Dr.GRPO,
    Σ mL / (T × responses) (SkyRL's seq_mean_token_sum_norm, TRL's dr_grpo; not in verl). T is
    `loss_scale_factor`. Responses without a trained token do not count. GSPO always uses
    seq-mean-token-mean."""
    loss_scale_factor: int | None = Field(default=None, ge=1)
    """T of the `seq-mean-token-sum-norm` and `seq-mean-token-sum-horizon` aggregations (verl's
    `actor.loss_scale_factor`); null: the step's longest response, the width verl's default
    `loss_mask.shape[-1]` has. verl's rollouts pad responses to `data.max_response_length`, so
    set rollout.sampling.max_new_tokens here to reproduce a verl run's constant T."""
    correction: Literal["truncate", "mask", "none"] = "truncate"
    """Behaviour-policy correction, from r = π_prox/π_behav: truncated IS weights min(r,
    weight_cap) (verl's rollout_is with rollout_is_threshold); masking, which drops the tokens
    (or, at sequence level, whole responses) whose r is outside [mask_low, mask_high] from the
    loss and its normalisers (verl's rollout_rs=token_k1 / seq_sum_k1 with threshold
    "1/mask_high_1/mask_low", as verl bounds −log r); or none (plain PPO against π_prox)."""
    correction_level: Literal["token", "sequence"] = "token"
    """Whether r is per token or, for the whole response, the product of its token ratios."""
    weight_cap: float = 2.0
    """Truncation cap of the behaviour importance weights (must be ≥ 1)."""
    mask_low: float = 0.5
    """Masking mode: tokens whose ratio is below this are dropped (must be ≤ 1)."""
    mask_high: float = 2.0
    """Masking mode: tokens whose ratio is above this are dropped (must be ≥ 1)."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (no learning signal; DAPO dynamic sampling)."""
    overlong_buffer: int = Field(default=0, ge=0)
    """DAPO soft overlong penalty: last this many tokens before max_new_tokens are penalised
    linearly (0 disables)."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Penalty at max_new_tokens for the soft overlong punishment."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Coefficient of the KL to the frozen initial policy (0 disables; no reference is kept)."""
    kl_kind: Literal["k1", "abs", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Apply the KL as a loss term (verl's use_kl_loss, aggregated like the policy loss);
    `reward` (verl's use_kl_in_reward) is not implemented yet and is refused when kl_coef > 0."""
    eps: float = 1e-6
    """ε in the GRPO std normalisation."""
    routing_replay: bool = False
    """Rollout Routing Replay (R3) for mixture-of-experts models: the trainer's forward routes
    every token the rollout recorded (`rollout.capture_routing`) to the engine's experts, with
    gate weights recomputed from its own router logits over them. Off: the trainer routes
    itself (the agreement figures then measure how often it differs)."""

    def token_lag_limit(self, eta: int) -> int:
        """The `max_token_lag` in force under the staleness bound `eta` (0 in sync mode)."""
        return 2 * eta if self.max_token_lag is None else self.max_token_lag

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        # The bounds `correction.py` enforces, checked here so a run fails at start, not at
        # its first step: an on-policy token (r = 1) keeps weight 1 and is never dropped.
        if self.weight_cap < 1:
            raise ValueError("algo.weight_cap must be ≥ 1 (an on-policy token keeps weight 1)")
        if not 0 <= self.mask_low <= 1 <= self.mask_high:
            raise ValueError("algo.mask_low must be in [0, 1] and algo.mask_high ≥ 1")
        if self.kl_coef > 0 and self.kl_in == "reward":
            raise ValueError("algo.kl_in=reward is not implemented; use algo.kl_in=loss")
        return self
