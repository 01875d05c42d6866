"""Token-exact capture of an agent's chat calls: one episode's calls become samples whose
generated tokens are the ids the engine sampled, never ids re-derived from text.

An agent talks chat messages; the engine samples token ids. A call's prompt is either the
template's rendering of its messages (the first call of a sample), or — when its messages
continue the previous call's messages and the reply the gateway returned — the previous prompt,
the exact ids generated for that reply, and the ids of only the new turns (tool results, user
turns, the next generation prompt). The second form is what makes the sample token-exact: a
reply rendered back through the template is not what was sampled (Qwen2.5 re-serializes
`<tool_call>` JSON, Qwen3 drops earlier `<think>` blocks, and any BPE tokenizes a word
differently in context), so a conversation re-rendered at each call would train on tokens the
model never produced. The new turns' ids are loss-masked observation tokens with log-prob 0 and
the version of the token before them, as `asyncrl.episodes.record` writes an environment's
observations.

**The ids of only the new turns.** The template renders the conversation with the reply
replaced by a placeholder assistant turn whose content is a marker string `M` and which makes
no tool calls, followed by the new turns and the generation prompt; what follows `M` in that
text is the end of an assistant turn, the new turns and the generation prompt, as the template
writes them after a reply. Nothing before `M` is used, so a template that renders earlier turns
differently once more turns follow (Qwen3 strips their `<think>` blocks and gives only a final
assistant turn an empty one) changes nothing. The end of turn is then lined up with the sampled
ids: when the reply ended on a stop token (finish `stop`) whose text opens that tail (after
whitespace at most), the model wrote it already and it is not written twice; otherwise (the
token limit or a stop string cut the turn, or the model stopped on a token the template does
not write) the template's end of turn stays in the observation, loss-masked. What remains is
tokenized on its own.

Worked example (Qwen2.5 style, a tool call; `⟨x⟩` is one special token, `·` a token boundary).
Call 1 renders `⟨im_start⟩system…⟨im_end⟩\\n⟨im_start⟩user\\nAdd 2 and 3⟨im_end⟩\\n
⟨im_start⟩assistant\\n` = prompt ids P; the engine samples
`<tool_call>·{"·name":·"add",·…}·</tool_call>·⟨im_end⟩` = G (its own spacing and merges). The
client gets `tool_calls=[add(a=2, b=3)]` and sends call 2 with that reply and
`{"role": "tool", "content": "5"}`. Rendered with the placeholder, the text after `M` is
`⟨im_end⟩\\n⟨im_start⟩user\\n<tool_response>\\n5\\n</tool_response>⟨im_end⟩\\n
⟨im_start⟩assistant\\n`; G ended on `⟨im_end⟩`, which opens that text, so the observation is
the rest, tokenized: O = `\\n·⟨im_start⟩·user·\\n·<tool_response>·…`. Call 2's prompt is
P + G + O, and the sample is prompt P, response G + O + G2 with loss mask 1…1 0…0 1…1. The
template itself would have written the reply as `<tool_call>\\n{"name": "add", "arguments":
{"a": 2, "b": 3}}\\n</tool_call>`: tokens the model never sampled, which no id here comes from.

**Why this is right.** Every id the model produced comes from a `CallRecord`, untouched; the
only ids made from text are the new turns', which the model did not produce and the trainer
masks. Those are what the template writes after an assistant turn for exactly these turns, so
the model reads tool results and user turns as a fresh rendering would show them (checked: a
conversation whose replies were sampled as the template writes them decodes to the template's
own rendering, `tools/compare_transcript.py`); what it assumes is that the template's writing
of the new turns does not depend on the reply's content or calls, true of the Qwen, Llama 3 and
ChatML families. And the sample is the prompt plus everything after it, so the tokens trained on
are the tokens each call was conditioned on.

**Breaks.** A call whose messages do not continue (an earlier message edited or dropped, as
compaction does; the returned reply changed or missing; other tools; other template options;
a template whose rendering has no place for the marker; a call planned before the previous one
was recorded) starts a new `Segment` of the same episode from a fresh rendering, counted by
`BreakCause` in `Transcript.breaks`: each segment is trained as its own sample, so no sample
ever holds a prompt the engine was not given. The reply is compared leniently (content without
a `<think>` block, tool calls by name and parsed arguments, no ids or extra fields): clients
drop reasoning and re-serialize arguments, and the sampled ids stand for the reply either way.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.reasons import BreakCause

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]

MARK = "\x00asyncrl-reply\x00"
"""The placeholder reply's content: no template writes it, no message holds it by chance."""

_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


class RenderError(ValueError):
    """The chat template refused the messages (it raised, e.g. Llama 3.1 on two tool calls in
    one turn): the request's fault, a 400 for an HTTP caller."""


class ChatTemplate:
    """A HF tokenizer's chat template, tools included; text is tokenized with no special tokens
    added (the template writes its own, as `apply_chat_template(tokenize=True)` does)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        # Text of the tokens that end a turn when sampled: added (special or not) tokens only,
        # since an ordinary token's text is not a unit the template writes.
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        # A fast tokenizer's own encoder: the same ids as calling the tokenizer, at a third of
        # the cost (a call renders and encodes once or twice).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [_for_template(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as exc:  # the template's own checks, or messages of the wrong shape
            raise RenderError(f"the chat template refused the messages: {exc}") from exc
        return str(text)

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The ids of the conversation as the template writes it; `RenderError` when the
        template refuses it."""
        text = self.text(
            messages, tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text)

    def added_text(self, token_id: int) -> str | None:
        """The text of an added token (an end of turn such as `<|im_end|>`), None for others."""
        return self._added.get(token_id)


@dataclass(frozen=True)
class CallRecord:
    """What the engine did for one call."""

    prompt_ids: list[int]
    output_ids: np.ndarray
    """int32, as sampled (a stop token it ended on included)."""
    logprobs: np.ndarray
    """float32, the behaviour log-prob of each output id."""
    versions: np.ndarray
    """int32, the policy version that sampled each output id."""
    finish: str
    """`stop` (a stop token or string ended it) or `length`."""
    message: Message
    """The assistant message returned to the client."""


@dataclass(frozen=True)
class Plan:
    """The prompt of the next call, and how it relates to the session's sample so far."""

    prompt_ids: list[int]
    continues: bool
    """It extends the open segment: previous prompt + generated ids + `observation`."""
    cause: BreakCause | None
    """Why it does not continue; None when it does, or on a session's first call."""
    observation: list[int] = field(default_factory=list, repr=False)
    """The ids of the new turns (with the generation prompt) when it continues."""
    messages: tuple[Message, ...] = field(default=(), repr=False)
    tools_key: str = field(default="", repr=False)
    options_key: str = field(default="", repr=False)
    basis: tuple[int, int] = field(default=(0, 0), repr=False)
    """(segment, calls) of the transcript it was planned on."""


@dataclass(frozen=True)
class Segment:
    """One trainable sample of an episode: a prompt and the response tokens after it."""

    prompt_ids: list[int]
    ids: np.ndarray
    """int32: generated ids and, between calls, the new turns' ids."""
    logprobs: np.ndarray
    """float32; 0 on observation ids."""
    versions: np.ndarray
    """int32; an observation id has the version of the id before it."""
    loss_mask: np.ndarray
    """uint8: 1 on generated ids, 0 on observation ids."""
    spans: tuple[tuple[int, int], ...]
    """(start, end) in `ids` of each call's generated ids, in call order."""
    finish: str
    """The last call's finish."""
    cause: BreakCause | None
    """Why the segment began (None: the session's first call)."""

    @property
    def calls(self) -> int:
        return len(self.spans)

    def rebase(self, n: int) -> Segment:
        """The same tokens over a prompt of only the first `n` prompt ids (e.g. the part a
        group's published prompt shares): the rest of the prompt opens the response as
        observation tokens, loss-masked, with log-prob 0 and the first generated id's version
        (no id comes before them), as a first observation is in `asyncrl.episodes.record`."""
        if not 0 <= n <= len(self.prompt_ids):
            raise ValueError(f"rebase at {n}: the prompt has {len(self.prompt_ids)} ids")
        moved = self.prompt_ids[n:]
        k = len(moved)
        first = int(self.versions[0]) if len(self.versions) else 0
        return replace(
            self,
            prompt_ids=self.prompt_ids[:n],
            ids=np.concatenate([np.asarray(moved, np.int32), self.ids]),
            logprobs=np.concatenate([np.zeros(k, np.float32), self.logprobs]),
            versions=np.concatenate([np.full(k, first, np.int32), self.versions]),
            loss_mask=np.concatenate([np.zeros(k, np.uint8), self.loss_mask]),
            spans=tuple((a + k, b + k) for a, b in self.spans),
        )


@dataclass
class _Open:
    """The segment being built and what the next call must continue."""

    prompt_ids: list[int]
    cause: BreakCause | None
    serial: int
    context: list[int] = field(default_factory=list)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    length: int = 0
    history: list[Any] = field(default_factory=list)
    """The canonical form of the last call's messages."""
    reply: Any = None
    """The lenient canonical form of the reply returned."""
    tools_key: str = ""
    options_key: str = ""
    last_id: int | None = None
    finish: str = "length"
    last_version: int | None = None

    def add(self, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, gen: bool) -> None:
        mask = np.full(len(ids), 1 if gen else 0, np.uint8)
        self.parts.append((ids, logprobs, versions, mask))
        if gen:
            self.spans.append((self.length, self.length + len(ids)))
        self.length += len(ids)
        if len(versions):
            self.last_version = int(versions[-1])

    def segment(self) -> Segment:
        def cat(i: int, dtype: type) -> np.ndarray:
            return np.concatenate([p[i] for p in self.parts]).astype(dtype)

        return Segment(
            prompt_ids=list(self.prompt_ids),
            ids=cat(0, np.int32),
            logprobs=cat(1, np.float32),
            versions=cat(2, np.int32),
            loss_mask=cat(3, np.uint8),
            spans=tuple(self.spans),
            finish=self.finish,
            cause=self.cause,
        )


class Transcript:
    """One episode's calls → samples (`Segment`s), never retokenizing generated ids.

    `plan` gives the prompt ids of a call from its messages; the caller generates from exactly
    those ids and hands what the engine did back with `record`. A plan that was never recorded
    (the call failed) leaves the transcript as it was. Calls that do not continue open a new
    segment, counted by cause in `breaks`."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.breaks: Counter[BreakCause] = Counter()
        self._closed: list[Segment] = []
        self._open: _Open | None = None
        self._serial = 0

    def plan(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> Plan:
        """The prompt of a call with these messages, tools and template options (see the
        module docstring); `RenderError` when the template refuses them. Changes nothing."""
        msgs = tuple(messages)
        tools_key = _key(list(tools or ()))
        options_key = _key(template_kwargs)
        cur = self._open
        basis = self._basis()
        cause: BreakCause | None = None
        if cur is not None:
            cause = _cause(cur, msgs, tools_key, options_key)
            if cause is None:
                obs = self._observation(cur, msgs, tools, template_kwargs)
                if obs is not None:
                    return Plan(
                        cur.context + obs, True, None, obs, msgs, tools_key, options_key, basis
                    )
                cause = BreakCause.TEMPLATE
        prompt = self.template.render(msgs, tools, **template_kwargs)
        return Plan(prompt, False, cause, [], msgs, tools_key, options_key, basis)

    def record(self, plan: Plan, call: CallRecord) -> None:
        """Add a call generated from `plan.prompt_ids` to the session's sample."""
        ids = np.asarray(call.output_ids, np.int32)
        logprobs = np.asarray(call.logprobs, np.float32)
        versions = np.asarray(call.versions, np.int32)
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"{len(ids)} output ids, {len(logprobs)} log-probs, {len(versions)} versions"
            )
        cur = self._open
        if plan.basis != self._basis():
            # Planned before the session's last call was recorded (parallel calls): its prompt
            # holds none of that call, so it is a sample of its own, the prompt whole.
            cause: BreakCause | None = BreakCause.CONCURRENT
        else:
            cause = plan.cause
        if plan.continues and cause is None:
            assert cur is not None  # a plan continues only an open segment
            n = len(plan.observation)
            before = cur.last_version
            version = before if before is not None else int(versions[0]) if len(versions) else 0
            cur.add(
                np.asarray(plan.observation, np.int32),
                np.zeros(n, np.float32),
                np.full(n, version, np.int32),
                gen=False,
            )
        else:
            if cur is not None:
                self._closed.append(cur.segment())
            self._serial += 1
            cur = self._open = _Open(list(plan.prompt_ids), cause, self._serial)
            if cause is not None:
                self.breaks[cause] += 1
        cur.add(ids, logprobs, versions, gen=True)
        cur.context = [*plan.prompt_ids, *ids.tolist()]
        cur.history = [_canonical(m) for m in plan.messages]
        cur.reply = _lenient(call.message)
        cur.tools_key, cur.options_key = plan.tools_key, plan.options_key
        cur.last_id = int(ids[-1]) if len(ids) else None
        cur.finish = call.finish

    def _basis(self) -> tuple[int, int]:
        """What a plan is made on: the open segment and how many calls it holds."""
        cur = self._open
        return (0, 0) if cur is None else (cur.serial, len(cur.spans))

    def samples(self) -> list[Segment]:
        """Every segment so far, in order (the open one included)."""
        return [*self._closed, *([self._open.segment()] if self._open is not None else [])]

    def _observation(
        self,
        cur: _Open,
        msgs: tuple[Message, ...],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> list[int] | None:
        """The ids after the previous reply's sampled ids (see the module docstring); None when
        the template leaves no single place for the marker."""
        n = len(cur.history)
        placeholder = {"role": "assistant", "content": MARK}
        try:
            text = self.template.text(
                [*msgs[:n], placeholder, *msgs[n + 1 :]], tools, **template_kwargs
            )
        except RenderError:  # e.g. a template that pairs each tool result with its call
            return None
        if text.count(MARK) != 1:
            return None
        after = text.partition(MARK)[2]
        end = self.template.added_text(cur.last_id) if cur.last_id is not None else None
        if cur.finish == "stop" and end:
            head, sep, rest = after.partition(end)
            if sep and not head.strip():
                after = rest
        return self.template.encode(after)


def _cause(
    cur: _Open, msgs: tuple[Message, ...], tools_key: str, options_key: str
) -> BreakCause | None:
    """Why `msgs` (with these tools and options) do not continue the open segment, or None."""
    if tools_key != cur.tools_key:
        return BreakCause.TOOLS_CHANGED
    if options_key != cur.options_key:
        return BreakCause.OPTIONS_CHANGED
    n = len(cur.history)
    if len(msgs) <= n or [_canonical(m) for m in msgs[:n]] != cur.history:
        return BreakCause.HISTORY_EDITED
    if _lenient(msgs[n]) != cur.reply:
        return BreakCause.REPLY_EDITED
    return None


def _for_template(message: Message) -> dict[str, Any]:
    """A message as chat templates expect it: content a string (text parts joined, None empty),
    no other keys set to None and no empty tool calls (Llama 3 tests `'tool_calls' in
    message`), arguments as objects, not the JSON strings of the OpenAI API (Qwen2.5 writes
    them with `tojson`)."""
    out = {k: v for k, v in message.items() if v is not None and k != "tool_calls"}
    out["content"] = _text(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or ():
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            fn = dict(call["function"])
            fn["arguments"] = _arguments(fn.get("arguments"))
            call = {**call, "function": fn}
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else "" for p in content)
    return str(content)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _calls(message: Message, ids: bool) -> list[Any]:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        entry = [fn.get("name"), _key(_arguments(fn.get("arguments")))]
        out.append([*entry, call.get("id")] if ids and isinstance(call, Mapping) else entry)
    return out


def _canonical(message: Message) -> Any:
    """What of a message can change its rendering, in a comparable form."""
    return _key(
        {
            "role": message.get("role"),
            "content": _text(message.get("content")),
            "tool_calls": _calls(message, ids=True),
            "tool_call_id": message.get("tool_call_id"),
            "name": message.get("name"),
            "reasoning_content": message.get("reasoning_content"),
        }
    )


def _lenient(message: Message) -> Any:
    """The reply as a client may send it back: without its `<think>` block or reasoning, tool
    calls by name and arguments."""
    return _key(
        {
            "role": message.get("role"),
            "content": _THINK.sub("", _text(message.get("content"))).strip(),
            "tool_calls": _calls(message, ids=False),
        }
    )
