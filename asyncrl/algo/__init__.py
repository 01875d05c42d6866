"""RL math as pure tensor functions: advantages, policy losses, off-policy correction.

The name tuples live here rather than in the torch modules so that config validation can
import them without importing torch; `losses` and `correction` re-export them.
"""

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-sum-horizon",
)
KL_KINDS = ("k1", "abs", "k2", "k3")
LOSS_NAMES = ("ppo", "gspo")
IS_LEVELS = ("token", "sequence")
