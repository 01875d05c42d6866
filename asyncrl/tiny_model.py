"""An offline tiny model for the quickstart: a char-level Qwen2 (or, with `moe`, a Qwen3-MoE of
8 experts, top-2) that half-knows `a+b=`.

With `chat=True` its tokenizer also carries a chat template with tools (`CHAT_TEMPLATE`), whose
turn markers are special tokens appended after the characters (ids of the characters unchanged),
so a chat-speaking tiny model needs no letters for its roles.

RL sharpens a half-learned skill; it does not teach one from nothing in a CPU-sized budget. So
the model is warmed up on the arithmetic task's train split with 40% of the answers off by 1..3
("noisy"), which leaves it usually right when greedy but often wrong when sampled, and stops as
soon as that holds. Everything is built locally: no download, a few tens of seconds on 2 cores.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from asyncrl.engines.config import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.items import PromptItem
from asyncrl.tasks.base import ArithmeticTask
from asyncrl.tasks.config import ArithmeticTaskConfig

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
VOCAB = (*SPECIAL_TOKENS, *"0123456789+=")
PAD_ID, BOS_ID, EOS_ID = range(3)
INFO_FILE = "asyncrl_model.json"

CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
"""Added but not special: decoded text keeps them, for the tool-call parser."""
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' or tools %}{{- '<|system|>' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- for tool in tools or [] %}{{- ' ' + (tool.function or tool).name }}{%- endfor %}"
    "{{- '<eos>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|assistant|>' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{%- set call = call.function or call %}"
    '{{- \'<tool_call>{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- (call.arguments if call.arguments is string else call.arguments | tojson) }}"
    "{{- '}</tool_call>' }}{%- endfor %}{{- '<eos>' }}"
    "{%- elif not (loop.first and message.role == 'system') %}"
    "{{- '<|' + message.role + '|>' + message.content + '<eos>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
"""A miniature of the Hermes/Qwen tool format: a role token opens each turn and `<eos>` (what
the model stops on) ends it; the tools go into the system turn by name only (their schemas
would pass the 128 positions), a call is `<tool_call>{"name": …, "arguments": …}</tool_call>`
as `asyncrl.environments.tools.parse_tool_calls` reads it."""

NOISE_FRACTION = 0.4
TARGET_SAMPLED, TARGET_GREEDY = 0.3, 0.5


class TinyModelInfo(TypedDict):
    """The record saved beside the model as asyncrl_model.json."""

    digits: int
    seed: int
    architecture: str
    params: int
    warmup_steps: int
    reached_target: bool
    eval_prompts: int
    sampled_accuracy: float
    greedy_accuracy: float
    build_seconds: float


def build_tokenizer(vocab: Sequence[str] = VOCAB, *, chat: bool = False) -> PreTrainedTokenizerFast:
    """One token per character of `vocab` (the special tokens first); encoding prepends <bos>,
    decoding joins characters. `chat`: `CHAT_TOKENS` and `TOOL_TOKENS` follow the vocabulary,
    and `CHAT_TEMPLATE` is its chat template."""
    if chat:
        vocab = (*vocab, *CHAT_TOKENS, *TOOL_TOKENS)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if chat:
        tok.add_special_tokens(list(CHAT_TOKENS))
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


# What the dense and the MoE tiny models share: a char vocabulary, hidden 64, 2 layers, 4 heads
# / 2 kv heads, tied embeddings.
_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)


def new_tiny_model(seed: int = 0, vocab_size: int = len(VOCAB)) -> Qwen2ForCausalLM:
    """A randomly initialised 124k-parameter Qwen2 (MLP width 256)."""
    config = Qwen2Config(vocab_size=vocab_size, intermediate_size=256, **_SHAPE)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def new_tiny_moe(seed: int = 0, vocab_size: int = len(VOCAB)) -> Qwen3MoeForCausalLM:
    """A randomly initialised 224k-parameter Qwen3-MoE: 8 experts of width 64 per layer, top-2
    with renormalised weights."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        **_SHAPE,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config)


def save_random_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    chars: str | None = None,
    *,
    moe: bool = False,
    chat: bool = False,
) -> Path:
    """An untrained tiny model and its tokenizer in `out_dir` (for tests and benchmarks); `chars`
    replaces the arithmetic characters of the vocabulary (a task with other text); `moe`: the
    Qwen3-MoE one; `chat`: the tokenizer speaks `CHAT_TEMPLATE` (see `build_tokenizer`)."""
    out = Path(out_dir)
    vocab = VOCAB if chars is None else (*SPECIAL_TOKENS, *dict.fromkeys(chars))
    tokenizer = build_tokenizer(vocab, chat=chat)
    (new_tiny_moe if moe else new_tiny_model)(seed, len(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_model(
    out_dir: str | Path,
    digits: int = 2,
    seed: int = 0,
    *,
    max_steps: int = 3000,
    moe: bool = False,
) -> TinyModelInfo:
    """Build, warm up and save the quickstart model in `out_dir`; return its info record.

    Cached: a directory that already holds a complete model is returned as is. Atomic: the
    model is built in a temporary sibling directory and renamed into place. Warm-up stops when
    held-out accuracy reaches the targets or after `max_steps` (the record says which).
    The arithmetic split uses the task's default seed, so the warm-up never sees the prompts
    an RL run evaluates on; `seed` drives initialisation and batch order.
    """
    out = Path(out_dir)
    architecture = _architecture(moe)
    if (out / INFO_FILE).exists():
        return _cached(out, digits, seed, architecture)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists but holds no complete tiny model ({INFO_FILE})")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staging = Path(tmp) / "model"
        info = _build(staging, digits, seed, max_steps, moe)
        try:
            staging.rename(out)
        except OSError:
            if not (out / INFO_FILE).exists():
                raise
            return _cached(out, digits, seed, architecture)  # another builder finished first
    return info


def _architecture(moe: bool) -> str:
    return "qwen3_moe" if moe else "qwen2"


def _cached(out: Path, digits: int, seed: int, architecture: str) -> TinyModelInfo:
    info = cast(TinyModelInfo, json.loads((out / INFO_FILE).read_text()))
    # Records written before the MoE variant existed are all Qwen2.
    have = (info["digits"], info["seed"], info.get("architecture", "qwen2"))
    if have != (digits, seed, architecture):
        raise ValueError(
            f"{out} holds a tiny model for digits={have[0]}, seed={have[1]}, "
            f"architecture={have[2]}; asked for digits={digits}, seed={seed}, "
            f"architecture={architecture}"
        )
    return info


def _build(out: Path, digits: int, seed: int, max_steps: int, moe: bool) -> TinyModelInfo:
    start = time.perf_counter()
    threads = torch.get_num_threads()
    # Matmuls this small do not pay for a second thread; on a busy 2-core machine two threads
    # measured 10x slower per step than one.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            tokenizer = build_tokenizer()
            model: PreTrainedModel = new_tiny_moe(seed) if moe else new_tiny_model(seed)
            task = ArithmeticTask(ArithmeticTaskConfig(digits=digits), tokenizer)
            engine = TorchEngine(model, eos_token_ids=[EOS_ID], seed=seed)
            # Answers have at most digits + 1 characters, then <eos>.
            scorer = _Scorer(engine, task, tokenizer, max_new_tokens=digits + 2)
            steps, reached = _warm_up(model, scorer, seed, max_steps)
            evals = list(task.eval_items())
            sampled = scorer.accuracy(evals, temperature=1.0)
            greedy = scorer.accuracy(evals, temperature=0.0)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for file in out.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; non-root containers must read it too
    info: TinyModelInfo = {
        "digits": digits,
        "seed": seed,
        "architecture": _architecture(moe),
        "params": sum(p.numel() for p in model.parameters()),
        "warmup_steps": steps,
        "reached_target": reached,
        "eval_prompts": len(evals),
        "sampled_accuracy": sampled,
        "greedy_accuracy": greedy,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    # Written last: its presence marks the directory complete.
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


@dataclass(frozen=True)
class _Scorer:
    engine: TorchEngine
    task: ArithmeticTask
    tokenizer: PreTrainedTokenizerBase
    max_new_tokens: int

    def accuracy(self, items: list[PromptItem], temperature: float) -> float:
        """Mean reward of one response per item."""
        params = SamplingParams(temperature=temperature, max_new_tokens=self.max_new_tokens)
        generations = self.engine.generate([item.prompt_ids for item in items], params)
        texts = self.tokenizer.batch_decode(
            [gen.token_ids.tolist() for gen in generations], skip_special_tokens=True
        )
        rewards = [self.task.score(item, text) for item, text in zip(items, texts, strict=True)]
        return round(float(np.mean(rewards)), 4)


def _warm_up(
    model: PreTrainedModel,
    scorer: _Scorer,
    seed: int,
    max_steps: int,
    batch_size: int = 64,
    eval_every: int = 50,
) -> tuple[int, bool]:
    """Supervised steps on noisy answers until the targets hold on 200 held-out prompts."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    probe = list(scorer.task.eval_items()[:200])
    epoch, position = 0, 0
    items = scorer.task.train_items(seed, epoch)
    model.train()  # the engine restores this mode after each evaluation
    for step in range(1, max_steps + 1):
        if position + batch_size > len(items):
            epoch, position = epoch + 1, 0
            items = scorer.task.train_items(seed, epoch)
        batch = items[position : position + batch_size]
        position += batch_size
        loss = model(**_noisy_batch(batch, scorer.tokenizer, rng)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == max_steps:
            greedy = scorer.accuracy(probe, temperature=0.0)
            if (
                greedy >= TARGET_GREEDY
                and scorer.accuracy(probe, temperature=1.0) >= TARGET_SAMPLED
            ):
                return step, True
    return max_steps, False


def _noisy_batch(
    batch: Sequence[PromptItem], tokenizer: PreTrainedTokenizerBase, rng: np.random.Generator
) -> dict[str, torch.Tensor]:
    """Inputs and labels (loss on the answer and <eos> only), right-padded."""
    rows, labels = [], []
    for item in batch:
        answer = int(item.answer)
        if rng.random() < NOISE_FRACTION:
            answer = abs(answer + int(rng.choice([-3, -2, -1, 1, 2, 3])))
        target = [*tokenizer(str(answer), add_special_tokens=False)["input_ids"], EOS_ID]
        rows.append(item.prompt_ids + target)
        labels.append([-100] * len(item.prompt_ids) + target)
    width = max(map(len, rows))
    # Right padding needs no attention mask: causal attention never looks ahead to it.
    return {
        "input_ids": torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels]),
    }
