"""SGLang 0.5.23's `/generate` (`asyncrl serve`): requests parsed into jobs, replies and SSE; the
jobs, outputs and model facts the OpenAI layer (`asyncrl.api.openai`) builds on too.

Field names and shapes follow SGLang's `GenerateReqInput` and `SamplingParams`
(`srt/managers/io_struct.py`, `srt/sampling/sampling_params.py`) and the reply its tokenizer
manager builds (`text`, `output_ids`, `meta_info`). A key the server cannot honour is refused
with a 400 naming it, unless it carries its neutral value (SGLang's frontend sends every
sampling key, `regex: null` and `frequency_penalty: 0.0` included).

Semantics kept from SGLang: `stop_token_ids` add to the model's EOS (`ignore_eos` drops EOS);
`min_new_tokens` masks the stop tokens' logits for that many steps; `n` copies each prompt, the
copies of a prompt adjacent in the reply; a stop string ends the response at the token that
completes it and is cut from the text (with what follows) unless `no_stop_trim`; a stop token
is cut from the text too; text skips special tokens unless `skip_special_tokens` is false;
log-prob entries are `[logprob, token_id, text or None]`, the first prompt token's logprob
None; `logprob_start_len` -1 means the last prompt token. `stream` sends the finished
generation as one SSE chunk per token (cumulative `text` and `output_ids`, as SGLang does
without `--incremental-streaming-output`): the builtin engine does not hand out tokens while
it decodes. `return_routed_experts` (a server started with `--enable-return-routed-experts`,
an MoE model) puts `meta_info.routed_experts` in the reply as SGLang does: base64 of int32 ids,
flat over [prompt + completion tokens − 1, MoE layers, top-k].
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from asyncrl.engines.base import Generation
from asyncrl.engines.config import SamplingParams
from asyncrl.web.threaded import ApiError, Body

GENERATE_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "rid",
    "log_metrics",
    "lora_path",
    "return_routed_experts",
}
GENERATE_NEUTRAL: dict[str, Any] = {
    "image_data": None,
    "audio_data": None,
    "video_data": None,
    "input_embeds": None,
    "lora_id": None,
    "token_ids_logprob": None,
    "session_params": None,
    "custom_logit_processor": None,
    "modalities": None,
    "data_parallel_rank": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
}
SAMPLING_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
}
SAMPLING_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "sampling_seed": None,
    "stream_interval": None,
    "spaces_between_special_tokens": True,
}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_N = 128
"""The most copies (`n`) of each prompt a request may ask for (OpenAI's bound)."""
MAX_JOBS = 1024
"""The most generations (prompts × `n`) one request may ask for: a request's jobs are held, and
those of one sampling generated as one batch, until all are done."""


def refuse_unknown(body: Body, known: set[str], neutral: dict[str, Any], where: str) -> None:
    """400 naming every key that is neither handled nor at its neutral value."""
    bad = sorted(
        key
        for key, value in body.items()
        if key not in known
        and not (key in neutral and (value is None or value == [] or value == neutral[key]))
    )
    if bad:
        raise ApiError(f"unsupported {where}: {', '.join(bad)}", bad[0])


@dataclass(frozen=True)
class Model:
    """What request parsing needs to know of the served model."""

    tokenizer: Any | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_positions: int | None
    routed_experts: bool = False
    """The engine records each token's experts (`--enable-return-routed-experts`)."""

    def encode(self, text: str, key: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(f"{key}: the model has no tokenizer; send input_ids", key)
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))

    def token_texts(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [""] * len(ids)
        return [str(t) for t in self.tokenizer.batch_decode([[i] for i in ids])]

    def check_ids(self, ids: Any, key: str) -> list[int]:
        if (
            not isinstance(ids, list)
            or not ids
            or not all(type(t) is int and 0 <= t < self.vocab_size for t in ids)
        ):
            raise ApiError(
                f"{key}: every prompt must be a non-empty list of token ids below "
                f"{self.vocab_size}",
                key,
            )
        return ids


@dataclass(frozen=True)
class Spec:
    """One request's sampling, hashable: jobs of equal specs share an engine call."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strs: tuple[str, ...] = ()
    skip_special: bool = True
    no_stop_trim: bool = False

    def engine_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_ids,
        )

    def score_params(self) -> SamplingParams:
        """Log-probs as SGLang returns them: tempered, before top-k / top-p (greedy: plain)."""
        return SamplingParams(temperature=self.temperature or 1.0)


@dataclass(frozen=True)
class Logprobs:
    """What a job asks of log-probs: prompt entries from `start`, `top` alternatives each."""

    start: int | None  # None: no prompt entries (OpenAI)
    top: int
    text: bool


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    spec: Spec
    logprobs: Logprobs | None
    rid: str
    lora: str | None = None
    """The adapter to generate with (SGLang's `lora_path`: a loaded adapter's name); None: the
    base model."""
    routed: bool = False
    """Reply with the routed experts."""

    @property
    def scores(self) -> bool:
        """Needs a scoring pass: prompt log-probs or top alternatives."""
        lp = self.logprobs
        return lp is not None and (lp.start is not None or lp.top > 0)


@dataclass
class Output:
    """A job's finished generation: tokens after stop strings, text after trimming."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: dict[str, Any]
    text: str
    cached: int = 0
    routed: Any = None
    """uint16 [prompt + tokens − 1, layers, k] routed experts of the kept tokens, or None."""
    logp: torch.Tensor | None = None
    """From the scoring pass: `sampling_logprobs` after each position of prompt + tokens."""


def typed(raw: Body, key: str, kind: type | tuple[type, ...], default: Any, alias: str) -> Any:
    value = raw.get(key)
    if value is None:
        return default
    if kind is float and type(value) is int:
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(f"{alias}: {value!r} is not of the expected type", alias)
    return value


def build_spec(raw: Body, model: Model, names: dict[str, str] | None = None) -> tuple[Spec, int]:
    """SGLang sampling params (native key names) → (Spec, n); `names` renames keys in errors."""
    names = names or {}

    def get(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        return typed(raw, key, kind, default, names.get(key, key))

    def bad(key: str, why: str) -> ApiError:
        return ApiError(f"{names.get(key, key)}: {why}", names.get(key, key))

    temperature = get("temperature", float, 1.0)
    top_p = get("top_p", float, 1.0)
    top_k = get("top_k", int, -1)
    max_new = get("max_new_tokens", int, DEFAULT_MAX_NEW_TOKENS)
    min_new = get("min_new_tokens", int, 0)
    n = get("n", int, 1)
    stop = get("stop", (str, list), [])
    stop_ids = get("stop_token_ids", list, [])
    if temperature < 0:
        raise bad("temperature", "must be >= 0")
    if not 0 < top_p <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if top_k == 0 or top_k < -1:
        raise bad("top_k", "must be -1 (disabled) or at least 1")
    if not 0 <= min_new <= max_new:
        raise bad("min_new_tokens", f"must be between 0 and max_new_tokens ({max_new})")
    if not 1 <= n <= MAX_N:
        raise bad("n", f"must be between 1 and {MAX_N}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "must be a string or a list of non-empty strings")
    if stops and model.tokenizer is None:
        raise bad("stop", "stop strings need the model's tokenizer")
    if not all(type(t) is int and 0 <= t < model.vocab_size for t in stop_ids):
        raise bad("stop_token_ids", f"must be token ids below {model.vocab_size}")
    eos = () if get("ignore_eos", bool, False) else model.eos_token_ids
    spec = Spec(
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k == -1 or top_k >= 1 << 30 else top_k,
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop_ids=tuple(dict.fromkeys([*eos, *stop_ids])),
        stop_strs=stops,
        skip_special=get("skip_special_tokens", bool, True),
        no_stop_trim=get("no_stop_trim", bool, False),
    )
    return spec, n


def check_length(
    model: Model, prompt: list[int], spec: Spec, key: str, max_key: str = "max_new_tokens"
) -> None:
    """400 for a prompt (sent as `key`) and `max_key` that do not fit the model's context,
    naming the prompt if it alone leaves no room for a token."""
    room = model.max_positions
    if room is not None and len(prompt) + spec.max_new_tokens > room:
        raise ApiError(
            f"prompt ({len(prompt)} tokens) + {max_key} ({spec.max_new_tokens}) exceed "
            f"the model's context of {room} tokens",
            key if len(prompt) >= room else max_key,
        )


def check_jobs(prompts: int, n: int, key: str) -> None:
    """400 naming the prompts' key for a request of more than `MAX_JOBS` generations."""
    if prompts * n > MAX_JOBS:
        raise ApiError(
            f"{key}: {prompts} prompts × n = {n} is over {MAX_JOBS} generations a request", key
        )


@dataclass(frozen=True)
class GenerateRequest:
    jobs: list[Job]
    single: bool
    """Reply with one object: one prompt, n = 1."""
    stream: bool


def parse_generate(body: Body, model: Model) -> GenerateRequest:
    refuse_unknown(body, GENERATE_KEYS, GENERATE_NEUTRAL, "/generate parameters")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError("send exactly one of text and input_ids", "text")
    key = "text" if text is not None else "input_ids"
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError("text: a string or a non-empty list of strings", "text")
        check_jobs(len(texts), 1, "text")  # before any is tokenized
        prompts = [model.encode(t, "text") for t in texts]
    else:
        if not isinstance(ids, list) or not ids:
            raise ApiError("input_ids: a list of token ids or a list of such lists", "input_ids")
        single = not isinstance(ids[0], list)
        prompts = [model.check_ids(p, "input_ids") for p in ([ids] if single else ids)]
    raw = body.get("sampling_params") or {}
    raws = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(raws) != len(prompts) or not all(isinstance(r, dict) for r in raws):
        raise ApiError("sampling_params: an object, or one per prompt", "sampling_params")
    specs = []
    for r in raws:
        refuse_unknown(r, SAMPLING_KEYS, SAMPLING_NEUTRAL, "sampling_params")
        specs.append(build_spec(r, model))
    n = specs[0][1]
    if any(k != n for _, k in specs):
        raise ApiError("sampling_params: n must be the same for every prompt", "n")
    check_jobs(len(prompts), n, key)
    logprobs = None
    if typed(body, "return_logprob", bool, False, "return_logprob"):
        start = typed(body, "logprob_start_len", int, -1, "logprob_start_len")
        top = typed(body, "top_logprobs_num", int, 0, "top_logprobs_num")
        if start < -1 or top < 0:
            raise ApiError("logprob_start_len >= -1 and top_logprobs_num >= 0", "logprob_start_len")
        logprobs = Logprobs(
            start,
            top,
            typed(body, "return_text_in_logprobs", bool, False, "return_text_in_logprobs"),
        )
    routed = typed(body, "return_routed_experts", bool, False, "return_routed_experts")
    if routed and not model.routed_experts:
        raise ApiError(
            "return_routed_experts: start the server with --enable-return-routed-experts "
            "(a mixture-of-experts model)",
            "return_routed_experts",
        )
    rids = body.get("rid")
    rid_list = [rids] * len(prompts) if not isinstance(rids, list) else rids
    if len(rid_list) != len(prompts):
        raise ApiError("rid: one per prompt", "rid")
    loras = body.get("lora_path")
    lora_list = loras if isinstance(loras, list) else [loras] * len(prompts)
    if len(lora_list) != len(prompts) or not all(
        x is None or isinstance(x, str) for x in lora_list
    ):
        raise ApiError("lora_path: an adapter name, or one (or null) per prompt", "lora_path")
    jobs = []
    for prompt, (spec, _), rid, lora in zip(prompts, specs, rid_list, lora_list, strict=True):
        check_length(model, prompt, spec, key)
        jobs += [Job(prompt, spec, logprobs, request_id(rid, j, n), lora, routed) for j in range(n)]
    stream = typed(body, "stream", bool, False, "stream")
    return GenerateRequest(jobs, single and n == 1, stream)


def request_id(rid: Any, j: int, n: int) -> str:
    if rid is None:
        return uuid.uuid4().hex
    return str(rid) if n == 1 else f"{rid}_{j}"


def empty_generation(version: int) -> Generation:
    """max_new_tokens 0 (SGLang's frontend caches a prefix or scores a prompt so)."""
    return Generation(
        token_ids=torch.zeros(0, dtype=torch.int32).numpy(),
        logprobs=torch.zeros(0).numpy(),
        versions=torch.full((0,), version, dtype=torch.int32).numpy(),
        finish="length",
    )


def finish(job: Job, gen: Generation | None, model: Model) -> Output:
    """A generation → Output: cut at the first stop string, text decoded and trimmed."""
    if gen is None:
        reason = {"type": "abort", "message": "aborted by pause_generation"}
        return Output([], [], [], reason, "")
    spec = job.spec
    tokens = gen.token_ids.tolist()
    logprobs, versions = gen.logprobs.tolist(), gen.versions.tolist()
    finish: dict[str, Any] = {"type": "length", "length": spec.max_new_tokens}
    if gen.finish == "stop":
        finish = {"type": "stop", "matched": tokens[-1]}
    matched: str | None = None
    if spec.stop_strs and any(s in model.decode(tokens, spec.skip_special) for s in spec.stop_strs):
        for k in range(1, len(tokens) + 1):
            text = model.decode(tokens[:k], spec.skip_special)
            hits = [s for s in spec.stop_strs if s in text]
            if hits:
                matched = min(hits, key=text.find)
                tokens, logprobs, versions = tokens[:k], logprobs[:k], versions[:k]
                finish = {"type": "stop", "matched": matched}
                break
    text = model.decode(tokens, spec.skip_special)
    if not spec.no_stop_trim and finish["type"] == "stop":
        if matched is not None:
            text = text[: text.find(matched)]
        else:
            text = model.decode(tokens[:-1], spec.skip_special)
    routed = gen.routed_experts
    if routed is not None:  # a stop string may have cut tokens: theirs go too
        routed = routed[: len(job.prompt) + len(tokens) - 1]
    return Output(tokens, logprobs, versions, finish, text, gen.cached_tokens, routed)


def top_entries(logp: torch.Tensor, k: int, model: Model, text: bool) -> list[list[Any]]:
    values, ids = logp.topk(min(k, logp.shape[-1]))
    id_list = ids.tolist()
    texts = model.token_texts(id_list) if text else [None] * len(id_list)
    return [[v, i, t] for v, i, t in zip(values.tolist(), id_list, texts, strict=True)]


def _spans(versions: list[int]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for t, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = t + 1
        else:
            spans.append({"version": str(v), "start": t, "end": t + 1})
    return spans


def item(job: Job, out: Output, model: Model, version: int) -> dict[str, Any]:
    """One reply object; `version` is the server's, for a reply without tokens."""
    spans = _spans(out.versions)
    meta: dict[str, Any] = {
        "id": job.rid,
        "finish_reason": out.finish,
        "prompt_tokens": len(job.prompt),
        "completion_tokens": len(out.tokens),
        "cached_tokens": out.cached,
        "weight_version": spans[-1]["version"] if spans else str(version),
    }
    if spans:
        meta["weight_versions"] = spans
    if job.routed and out.routed is not None:
        ids = out.routed.astype("<i4").tobytes()
        meta["routed_experts"] = base64.b64encode(ids).decode()
    lp = job.logprobs
    if lp is not None:
        texts = model.token_texts(out.tokens) if lp.text else [None] * len(out.tokens)
        meta["output_token_logprobs"] = [
            [v, t, s] for v, t, s in zip(out.logprobs, out.tokens, texts, strict=True)
        ]
        if out.logp is not None and lp.start is not None:
            meta |= _input_logprobs(job, out.logp, lp, model)
        elif lp.start is not None:  # aborted: nothing was scored
            meta |= {"input_token_logprobs": []}
        if lp.top > 0:
            n = len(job.prompt)
            meta["output_top_logprobs"] = (
                [
                    top_entries(out.logp[n - 1 + t], lp.top, model, lp.text)
                    for t in range(len(out.tokens))
                ]
                if out.logp is not None
                else []
            )
    return {"text": out.text, "output_ids": out.tokens, "meta_info": meta}


def _input_logprobs(job: Job, logp: torch.Tensor, lp: Logprobs, model: Model) -> dict[str, Any]:
    prompt = job.prompt
    assert lp.start is not None
    start = len(prompt) - 1 if lp.start == -1 else min(lp.start, len(prompt) - 1)
    ids = prompt[start:]
    texts = model.token_texts(ids) if lp.text else [None] * len(ids)
    values = [None if i == 0 else logp[i - 1, prompt[i]].item() for i in range(start, len(prompt))]
    meta: dict[str, Any] = {
        "input_token_logprobs": [[v, t, s] for v, t, s in zip(values, ids, texts, strict=True)]
    }
    if lp.top > 0:
        meta["input_top_logprobs"] = [
            None if i == 0 else top_entries(logp[i - 1], lp.top, model, lp.text)
            for i in range(start, len(prompt))
        ]
    return meta


def prefixes(out: Output, model: Model, spec: Spec) -> Iterator[tuple[Output, bool]]:
    """The stages of `out` a stream shows, one per token, the last the finished `out`: each
    shows the longest part of the final text that its tokens have produced."""
    shown = 0
    for t in range(1, len(out.tokens)):
        text = model.decode(out.tokens[:t], spec.skip_special)
        shown = max(shown, _common(text, out.text))
        yield (
            replace(
                out,
                tokens=out.tokens[:t],
                logprobs=out.logprobs[:t],
                versions=out.versions[:t],
                finish={},
                text=out.text[:shown],
            ),
            False,
        )
    yield out, True


def _common(a: str, b: str) -> int:
    """Length of the common prefix."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def stream_chunks(
    req: GenerateRequest, outs: list[Output], model: Model, version: int
) -> Iterator[dict[str, Any]]:
    for index, (job, out) in enumerate(zip(req.jobs, outs, strict=True)):
        for stage, last in prefixes(out, model, job.spec):
            chunk = item(job, stage, model, version)
            if not last:
                chunk["meta_info"]["finish_reason"] = None
            if not req.single:
                chunk["index"] = index
            yield chunk
