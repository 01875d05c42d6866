"""The token-exact comparator: random multi-turn tool conversations through
`asyncrl.gateway.transcript.Transcript`, per template family, against a fake engine whose
sampled ids are arbitrary, checked call by call.

Each conversation: a system prompt (or none), a user turn, then up to 6 calls. The fake engine
"samples" a reply — a final answer, tool calls with text around them, a `<think>` block where
the family thinks — as ids the tokenizer would not produce from that text (the text is encoded
in random pieces, so BPE merges across the cuts are missed), or as arbitrary ids; it ends on
the family's end of turn, on another stop token, or is cut by the token limit. The reply the
client gets is parsed from the decoded text (the Hermes parser `asyncrl.environments.tools`
has, or Llama 3.1's JSON form), and the client sends it back as clients do (reasoning dropped,
arguments re-serialized, content None), then tool results or a user turn. At random, before a
call, the client breaks the conversation: an earlier message edited, the history compacted,
the reply changed or dropped, other tools, other template options, or two calls planned from
the same state (parallel calls).

Checked for every call, in every segment: the segment's ids at the call's span are the sampled
ids (token for token, with their log-probs and versions); the call's prompt — what the engine
was given — is the segment's prompt plus its ids before the span, so no sample holds a prompt
the engine did not see; observation ids have log-prob 0, mask 0 and the version before them.
Per conversation: the segments begin exactly at the breaks made, with their causes, and an
unbroken conversation is one sample. Where every reply so far was written as the template
writes it (a "canonical" sample, ended on the end of turn), the stitched prompt decodes to the
template's own rendering of the conversation: the ids of the new turns are the template's.

    python tools/compare_transcript.py --conversations 5000
    python tools/compare_transcript.py --plan-cost
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from chat_families import FAMILIES, TOOLS, WORDS, Family, family

from asyncrl.environments.tools import ToolCall, parse_tool_calls
from asyncrl.gateway.transcript import CallRecord, ChatTemplate, Plan, Transcript
from asyncrl.reasons import BreakCause

EDITS = ("edit", "compact", "reply", "drop_reply", "tools", "options", "concurrent")
RESULTS = (
    "42",
    "",
    "température 21°C, 東京 ☀",
    '{"temp": 21, "city": "Paris"}',
    "error: unknown city",
    "<tool_call>not a call</tool_call>",
    "line one\nline two\n",
)


@dataclass
class Stats:
    """What the comparator saw for one family."""

    family: str
    conversations: int = 0
    calls: int = 0
    generated: int = 0
    """Tokens sampled."""
    differing: int = 0
    """Generated tokens in a segment that are not the sampled ones (must be 0)."""
    bad_prompts: int = 0
    """Calls whose prompt is not their segment's prefix (must be 0)."""
    bad_observations: int = 0
    """Observation tokens with a log-prob, mask or version they must not have (must be 0)."""
    missed_breaks: int = 0
    """Conversations whose segments do not begin exactly at the breaks made (must be 0)."""
    unbroken: int = 0
    unbroken_one_sample: int = 0
    oracle_checked: int = 0
    oracle_failed: int = 0
    """Canonical prompts that do not decode to the template's rendering (must be 0)."""
    drifted: int = 0
    """Calls whose sampled ids differ from the tokenizer's encoding of their text."""
    continued: int = 0
    rerendered_differ: int = 0
    """Continuing calls whose prompt, rendered afresh from the messages, is not the stitched
    one: where a gateway that re-renders would train on tokens the model did not sample."""
    breaks: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.differing == self.bad_prompts == self.bad_observations == 0
            and self.missed_breaks == self.oracle_failed == 0
            and self.unbroken == self.unbroken_one_sample
        )


@dataclass
class _Reply:
    ids: list[int]
    finish: str
    message: dict[str, Any]
    canonical: bool


class FakeEngine:
    """Samples replies of a family as arbitrary ids (see the module docstring)."""

    def __init__(self, fam: Family, rng: random.Random) -> None:
        self.fam = fam
        self.rng = rng
        tok = fam.tokenizer
        self.template = ChatTemplate(tok)
        self.end = tok.convert_tokens_to_ids(fam.end)
        self.other_end = None if fam.other_end is None else tok.convert_tokens_to_ids(fam.other_end)
        added = set(tok.added_tokens_decoder)
        self.ordinary = [i for i in range(len(tok)) if i not in added]

    def words(self, lo: int = 1, hi: int = 8) -> str:
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))
        return self._fit(text)

    def _fit(self, text: str) -> str:
        alphabet = self.fam.alphabet
        return text if alphabet is None else "".join(c for c in text if c in alphabet)

    def result(self) -> str:
        r = self.rng.random()
        text = self.rng.choice(RESULTS) if r < 0.5 else str(self.rng.randint(-9999, 9999))
        return self._fit(text) if r < 0.9 else self.words()

    def _arguments(self, name: str) -> dict[str, Any]:
        rng = self.rng
        if name == "add":
            return {
                "a": rng.randint(-999, 999),
                "b": round(rng.uniform(-100, 100), rng.randint(0, 3)),
            }
        if name == "search":
            return {"query": self.words()}
        return {"city": rng.choice(["Paris", "Tokyo", "Berlin"]), "units": "celsius"}

    def _call_text(self, name: str, args: dict[str, Any], canonical: bool) -> str:
        rng = self.rng
        seps = (", ", ": ") if canonical else rng.choice([(",", ":"), (", ", ": "), (" ,", " : ")])
        if self.fam.call_style == "json":
            return (
                '{"name": "' + name + '", "parameters": ' + json.dumps(args, separators=seps) + "}"
            )
        body = json.dumps({"name": name, "arguments": args}, separators=seps, ensure_ascii=False)
        if canonical:
            nl = "" if self.fam.name == "tiny" else "\n"
            return f"<tool_call>{nl}{body}{nl}</tool_call>"
        before, after = rng.choice(["", "\n", " "]), rng.choice(["", "\n"])
        return f"<tool_call>{before}{body}{after}</tool_call>"

    def reply(self, tools: list[dict[str, Any]], version: int) -> tuple[_Reply, CallRecord]:
        rng, fam = self.rng, self.fam
        canonical = rng.random() < 0.4
        names = [t["function"]["name"] for t in tools]
        n_calls = rng.choice([0, 1, 1, 2, 3])
        n_calls = min(n_calls, fam.max_calls)
        calls = [(n, self._arguments(n)) for n in (rng.choice(names) for _ in range(n_calls))]
        content = "" if calls and (fam.call_style == "json" or rng.random() < 0.4) else self.words()
        pieces = [self._call_text(n, a, canonical) for n, a in calls]
        if canonical:
            sep = "" if fam.name == "tiny" else "\n"
            text = content + "".join(
                (sep if (content or i) else "") + p for i, p in enumerate(pieces)
            )
        else:
            think = (
                f"<think>\n{self.words()}\n</think>\n\n"
                if fam.thinks and rng.random() < 0.5
                else ""
            )
            text = think + content + "".join(rng.choice(["\n", "", " "]) + p for p in pieces)
        text = self._fit(text)
        if not canonical and rng.random() < 0.1:
            ids = [rng.choice(self.ordinary) for _ in range(rng.randint(1, 12))]
        else:
            ids = self._drift(text)
        finish = "stop"
        r = rng.random()
        if r < 0.75 or canonical:
            ids.append(self.end)
        elif r < 0.85 and self.other_end is not None:
            ids.append(self.other_end)
        elif len(ids) > 1:
            ids = ids[: rng.randint(1, len(ids) - 1)]
            finish = "length"
        versions = np.full(len(ids), version, np.int32)
        if rng.random() < 0.2:  # the weights changed mid-reply
            versions[rng.randint(0, len(ids)) :] += 1
        logprobs = -np.asarray([rng.random() * 5 for _ in ids], np.float32)
        message = self._message(ids)
        out = np.asarray(ids, np.int32)
        return _Reply(ids, finish, message, canonical), CallRecord(
            [], out, logprobs, versions, finish, message
        )

    def _drift(self, text: str) -> list[int]:
        """Ids of `text` encoded in random pieces: merges across the cuts are missed."""
        cuts = (
            sorted(self.rng.sample(range(1, len(text)), min(len(text) - 1, 4)))
            if len(text) > 1
            else []
        )
        bounds = [0, *cuts, len(text)]
        out: list[int] = []
        for a, b in itertools.pairwise(bounds):
            out += self.template.encode(text[a:b])
        return out

    def _message(self, ids: list[int]) -> dict[str, Any]:
        """The assistant message a gateway returns for these ids."""
        text = self.fam.tokenizer.decode(ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant"}
        calls: list[tuple[str, dict[str, Any]]] = []
        if self.fam.call_style == "json":
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls = [(obj["name"], obj.get("parameters") or {})]
                text = ""
        else:
            calls = [
                (c.name, c.arguments) for c in parse_tool_calls(text) if isinstance(c, ToolCall)
            ]
            text = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
        think = re.match(r"\s*<think>(.*?)</think>", text, re.DOTALL)
        if think and self.rng.random() < 0.5:
            message["reasoning_content"] = think.group(1).strip()
            text = text[think.end() :]
        message["content"] = text.strip()
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{self.rng.randrange(10**6)}",
                    "type": "function",
                    "function": {"name": n, "arguments": json.dumps(a)},
                }
                for n, a in calls
            ]
        return message


def _thinks(message: dict[str, Any]) -> bool:
    return bool(message.get("reasoning_content")) or "</think>" in (message.get("content") or "")


def _echo(message: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The reply as a client sends it back: a field dropped or re-spelled, nothing that changes
    what it says."""
    out = dict(message)
    r = rng.random()
    if r < 0.2:
        out.pop("reasoning_content", None)
    elif r < 0.4 and out.get("tool_calls"):
        out["tool_calls"] = [
            {
                **c,
                "function": {
                    **c["function"],
                    "arguments": json.dumps(
                        json.loads(c["function"]["arguments"]), separators=(",", ":")
                    ),
                },
            }
            for c in out["tool_calls"]
        ]
    elif r < 0.6:
        out["content"] = out["content"] or None
        out["refusal"] = None
    return out


@dataclass
class _Call:
    plan: Plan
    record: CallRecord


class Conversation:
    """One random conversation through a Transcript, with the breaks it made."""

    def __init__(
        self, fam: Family, rng: random.Random, edit_rate: float, rerender: bool = False
    ) -> None:
        self.fam, self.rng, self.edit_rate, self.rerender = fam, rng, edit_rate, rerender
        self.engine = FakeEngine(fam, rng)
        self.transcript = Transcript(self.engine.template)
        self.calls: list[_Call] = []
        self.expected: list[BreakCause] = []
        self.oracle_checked = self.oracle_failed = self.drifted = 0
        self.continued = self.rerendered_differ = 0
        self.tools = self._tools()
        self.options: dict[str, Any] = self._options()
        self.messages: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            self.messages.append({"role": "system", "content": self.engine.words()})
        self.messages.append({"role": "user", "content": self.engine.words(3, 12)})
        self.version = rng.randint(0, 5)
        self.canonical = True  # every reply in the current prompt as the template writes it
        self.history = 0  # how many messages the last plan had

    def _tools(self) -> list[dict[str, Any]]:
        return self.rng.sample(list(TOOLS), self.rng.randint(1, len(TOOLS)))

    def _options(self) -> dict[str, Any]:
        r = self.rng.random()
        if self.fam.name == "qwen3":
            return {} if r < 0.5 else {"enable_thinking": r < 0.75}
        if self.fam.name == "llama3":
            return {} if r < 0.5 else {"date_string": f"{self.rng.randint(1, 28)} Jan 2025"}
        return {} if r < 0.5 else {"flavour": self.rng.randint(0, 9)}

    def run(self) -> None:
        for turn in range(self.rng.randint(1, 6)):
            edit = self.rng.choice(EDITS) if turn and self.rng.random() < self.edit_rate else None
            if edit == "concurrent":
                first, canonical = self._plan(), self.canonical
                self._call(first)
                self.canonical = canonical  # the second call's prompt holds no first reply
                second = self._plan_again(first)
                self.expected.append(BreakCause.CONCURRENT)
                self._call(second)
            else:
                if edit is not None:
                    self.expected.append(self._edit(edit))
                self._call(self._plan())
            self._next_turns()

    def _plan(self) -> Plan:
        plan = self.transcript.plan(self.messages, self.tools, **self.options)
        if not plan.continues:
            # A fresh rendering is the template's, but Qwen3 drops an earlier turn's <think>
            # once a user turn follows it, which the prompt, kept as sampled, will not.
            self.canonical = not any(_thinks(m) for m in self.messages)
        elif self.rerender:
            self.continued += 1
            rendered = self.engine.template.render(self.messages, self.tools, **self.options)
            self.rerendered_differ += rendered != plan.prompt_ids
        self._oracle(plan)
        return plan

    def _plan_again(self, first: Plan) -> Plan:
        """A second call planned from the state the first was planned on (parallel calls)."""
        msgs = list(first.messages)
        self.messages = msgs
        return first  # the same plan, recorded after the first: its basis is gone

    def _oracle(self, plan: Plan) -> None:
        if not self.canonical or self.options.get("enable_thinking") is False:
            return
        self.oracle_checked += 1
        text = self.engine.template.text(self.messages, self.tools, **self.options)
        if self.fam.tokenizer.decode(plan.prompt_ids, skip_special_tokens=False) != text:
            self.oracle_failed += 1

    def _call(self, plan: Plan) -> None:
        reply, record = self.engine.reply(self.tools, self.version)
        if self.engine.template.encode(self.fam.tokenizer.decode(reply.ids)) != reply.ids:
            self.drifted += 1
        record = CallRecord(
            plan.prompt_ids,
            record.output_ids,
            record.logprobs,
            record.versions,
            record.finish,
            record.message,
        )
        self.transcript.record(plan, record)
        self.calls.append(_Call(plan, record))
        self.canonical = self.canonical and reply.canonical and reply.finish == "stop"
        self.history = len(plan.messages)
        self.messages = [*plan.messages, _echo(reply.message, self.rng)]
        self.version += self.rng.randint(0, 1)

    def _next_turns(self) -> None:
        last = self.messages[-1]
        if last.get("tool_calls"):
            for call in last["tool_calls"]:
                self.messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": self.engine.result()}
                )
        else:
            self.messages.append({"role": "user", "content": self.engine.words(2, 10)})

    def _edit(self, kind: str) -> BreakCause:
        rng, msgs, n = self.rng, self.messages, self.history
        if kind == "edit":
            editable = [i for i in range(n) if msgs[i]["role"] != "assistant"]
            i = rng.choice(editable)
            msgs[i] = {**msgs[i], "content": (msgs[i].get("content") or "") + " edited"}
            return BreakCause.HISTORY_EDITED
        if kind == "compact":
            keep = 1 if msgs[0]["role"] == "system" else 0
            summary = {"role": "user", "content": "summary: " + self.engine.words()}
            tail = [m for m in msgs[n + 1 :] if m["role"] != "tool"] or [
                {"role": "user", "content": self.engine.words()}
            ]
            self.messages = [*msgs[:keep], summary, *tail]
            return BreakCause.HISTORY_EDITED
        if kind == "reply":
            reply = dict(msgs[n])
            reply["content"] = (reply.get("content") or "") + " rewritten"
            msgs[n] = reply
            return BreakCause.REPLY_EDITED
        if kind == "drop_reply":
            self.messages = [*msgs[:n], {"role": "user", "content": self.engine.words()}]
            return BreakCause.REPLY_EDITED
        if kind == "tools":
            while (tools := self._tools()) == self.tools:
                pass
            self.tools = tools
            return BreakCause.TOOLS_CHANGED
        while (options := self._options()) == self.options:
            pass
        self.options = options
        return BreakCause.OPTIONS_CHANGED


def check(conv: Conversation, stats: Stats) -> None:
    """Add what `conv` shows to `stats` (see the module docstring)."""
    segments = conv.transcript.samples()
    calls = iter(conv.calls)
    for seg in segments:
        prev_version: int | None = None
        for k in range(len(seg.ids)):
            moved = prev_version is not None and seg.versions[k] != prev_version
            if seg.loss_mask[k] == 0 and (seg.logprobs[k] != 0 or moved):
                stats.bad_observations += 1
            prev_version = int(seg.versions[k])
        for start, end in seg.spans:
            call = next(calls)
            sampled = call.record.output_ids
            got = seg.ids[start:end]
            stats.generated += len(sampled)
            if len(got) != len(sampled):
                stats.differing += max(len(got), len(sampled))
            else:
                stats.differing += int((got != sampled).sum())
                same = np.array_equal(
                    seg.logprobs[start:end], call.record.logprobs
                ) and np.array_equal(seg.versions[start:end], call.record.versions)
                stats.differing += 0 if same and seg.loss_mask[start:end].all() else len(sampled)
            if call.plan.prompt_ids != [*seg.prompt_ids, *seg.ids[:start].tolist()]:
                stats.bad_prompts += 1
    stats.calls += len(conv.calls)
    causes = [s.cause for s in segments]
    if causes != [None, *conv.expected] or conv.transcript.breaks != Counter(conv.expected):
        stats.missed_breaks += 1
    if not conv.expected:
        stats.unbroken += 1
        stats.unbroken_one_sample += len(segments) == 1
    stats.breaks.update(conv.expected)
    stats.oracle_checked += conv.oracle_checked
    stats.oracle_failed += conv.oracle_failed
    stats.drifted += conv.drifted
    stats.continued += conv.continued
    stats.rerendered_differ += conv.rerendered_differ
    stats.conversations += 1


def compare(
    name: str,
    conversations: int,
    seed: int = 0,
    edit_rate: float = 0.15,
    rerender: bool = False,
) -> Stats:
    """`rerender`: also render each continuing call's messages afresh, to count how often that
    prompt differs from the stitched one."""
    fam = family(name)
    stats = Stats(name)
    t0 = time.perf_counter()
    for i in range(conversations):
        conv = Conversation(fam, random.Random(f"{seed}/{name}/{i}"), edit_rate, rerender)
        conv.run()
        check(conv, stats)
    stats.seconds = time.perf_counter() - t0
    return stats


def plan_cost(name: str = "qwen2.5", turns: int = 64) -> list[tuple[int, int, float, float]]:
    """(turn, prompt ids, median CPU ms of `plan`, CPU ms of a fresh render and encode of the
    same messages) along one long conversation of user turns and 30-word replies."""
    fam = family(name)
    template = ChatTemplate(fam.tokenizer)
    tr = Transcript(template)
    end = fam.tokenizer.convert_tokens_to_ids(fam.end)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "please add numbers " * 20}]
    tools = list(TOOLS)
    out = []
    for turn in range(turns + 1):
        if turn in (2, turns // 4, turns // 2, turns):
            times = []
            for _ in range(15):
                t0 = time.process_time()
                tr.plan(messages, tools)
                times.append(time.process_time() - t0)
            t0 = time.process_time()
            template.render(messages, tools)
            fresh = time.process_time() - t0
            plan = tr.plan(messages, tools)
            out.append((turn, len(plan.prompt_ids), np.median(times) * 1e3, fresh * 1e3))
        plan = tr.plan(messages, tools)
        text = "the sum is " * 30
        ids = np.asarray([*template.encode(text), end], np.int32)
        reply = {"role": "assistant", "content": text.strip()}
        zeros = np.zeros(len(ids), np.float32)
        tr.record(
            plan, CallRecord(plan.prompt_ids, ids, zeros, zeros.astype(np.int32), "stop", reply)
        )
        messages = [*messages, reply, {"role": "user", "content": "and again " * 10}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument(
        "--plan-cost", action="store_true", help="the CPU of `plan` along a long conversation"
    )
    args = parser.parse_args()
    if args.plan_cost:
        print("| turn | prompt ids | plan, CPU ms (median of 15) | fresh render + encode, CPU ms |")
        print("|---|---|---|---|")
        for turn, n, plan_ms, fresh_ms in plan_cost():
            print(f"| {turn} | {n} | {plan_ms:.2f} | {fresh_ms:.2f} |")
        return
    print(
        "| family | conversations | calls | generated tokens | differing | bad prompts | "
        "breaks made = split | unbroken as one sample | canonical prompts = template | "
        "calls with drifted ids | continued prompts a re-render changes | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name in args.families:
        s = compare(name, args.conversations, args.seed, rerender=True)
        ok &= s.ok
        print(
            f"| {name} | {s.conversations} | {s.calls} | {s.generated} | {s.differing} | "
            f"{s.bad_prompts} | {sum(s.breaks.values())} ({s.missed_breaks} missed) | "
            f"{s.unbroken_one_sample}/{s.unbroken} | {s.oracle_checked - s.oracle_failed}/"
            f"{s.oracle_checked} | {s.drifted}/{s.calls} | {s.rerendered_differ}/{s.continued} | "
            f"{s.seconds:.1f} |"
        )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
