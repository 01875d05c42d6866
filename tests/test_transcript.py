"""Token-exact capture (`asyncrl.gateway.transcript`): hand-worked stitches per template family,
every break cause, and the comparator's random conversations (tools/compare_transcript.py)."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
from chat_families import FAMILIES, TINY_CHARS, TOOLS, family
from compare_transcript import Conversation, Stats, check, compare
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.environments.tools import ToolCall, parse_tool_calls
from asyncrl.gateway.transcript import CallRecord, ChatTemplate, Plan, RenderError, Transcript
from asyncrl.reasons import BreakCause
from asyncrl.tiny_model import (
    SPECIAL_TOKENS,
    VOCAB,
    build_tokenizer,
    save_random_tiny_model,
)

QUESTION = [{"role": "user", "content": "Add 2 and 3"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "5"}


def _transcript(name: str) -> tuple[Transcript, Any]:
    tok = family(name).tokenizer
    return Transcript(ChatTemplate(tok)), tok


def _pieces(tok: Any, *texts: str) -> list[int]:
    """Ids of `texts` encoded one by one: not what the tokenizer makes of their join."""
    return [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"]]


def _call(
    plan: Plan, ids: list[int], message: dict[str, Any], version: int = 3, finish: str = "stop"
) -> CallRecord:
    n = len(ids)
    return CallRecord(
        plan.prompt_ids,
        np.asarray(ids, np.int32),
        np.linspace(-1, -0.1, n).astype(np.float32),
        np.full(n, version, np.int32),
        finish,
        message,
    )


def test_the_worked_example_keeps_the_sampled_tool_call() -> None:
    """The module docstring's example, Qwen2.5 style: the model's own spelling of its call, in
    pieces that BPE would merge differently, stays in the sample; only the new turn is added."""
    tr, tok = _transcript("qwen2.5")
    first = tr.plan(QUESTION, TOOLS)
    assert (first.continues, first.cause) == (False, None)
    assert tok.decode(first.prompt_ids).endswith("Add 2 and 3<|im_end|>\n<|im_start|>assistant\n")
    sampled = _pieces(
        tok, '<tool_call>{"na', 'me":"add","argum', 'ents":{"a":2,"b":3}}</tool_call>'
    )
    sampled.append(tok.convert_tokens_to_ids("<|im_end|>"))
    assert tok(tok.decode(sampled), add_special_tokens=False)["input_ids"] != sampled  # drift
    tr.record(first, _call(first, sampled, CALL, version=3))

    second = tr.plan([*QUESTION, CALL, RESULT], TOOLS)
    assert (second.continues, second.cause) == (True, None)
    assert second.prompt_ids[: len(first.prompt_ids) + len(sampled)] == first.prompt_ids + sampled
    assert tok.decode(second.observation) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    answer = [*_pieces(tok, "The sum is 5."), tok.convert_tokens_to_ids("<|im_end|>")]
    tr.record(second, _call(second, answer, {"role": "assistant", "content": "The sum is 5."}, 4))

    [seg] = tr.samples()
    n, m, k = len(sampled), len(second.observation), len(answer)
    assert seg.prompt_ids == first.prompt_ids and seg.cause is None and seg.calls == 2
    assert seg.ids.tolist() == sampled + second.observation + answer
    assert seg.loss_mask.tolist() == [1] * n + [0] * m + [1] * k
    assert seg.versions.tolist() == [3] * n + [3] * m + [4] * k  # observation: the version before
    assert (seg.logprobs[n : n + m] == 0).all() and (seg.logprobs[:n] < 0).all()
    assert seg.spans == ((0, n), (n + m, n + m + k))
    assert not tr.breaks
    # The template itself writes the call back otherwise: ids the model never sampled.
    rerendered = ChatTemplate(tok).render([*QUESTION, CALL, RESULT], TOOLS)
    assert rerendered[: len(second.prompt_ids)] != second.prompt_ids


QWEN3_CALL = (
    '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}'
    "\n</tool_call>"
)


@pytest.mark.parametrize(
    ("name", "sampled"),
    [
        # Qwen3 renders an earlier turn's <think> away once a user turn follows; kept here.
        ("qwen3", QWEN3_CALL),
        ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
        ("tiny", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'),
    ],
)
def test_each_family_stitches_after_its_end_of_turn(name: str, sampled: str) -> None:
    tr, tok = _transcript(name)
    fam = family(name)
    tools = list(TOOLS)
    first = tr.plan(QUESTION, tools)
    ids = [*_pieces(tok, sampled[:7], sampled[7:]), tok.convert_tokens_to_ids(fam.end)]
    tr.record(first, _call(first, ids, CALL))
    follow = {"role": "user", "content": "Thanks"}
    second = tr.plan([*QUESTION, CALL, RESULT, follow], tools)
    assert second.continues
    assert second.prompt_ids[len(first.prompt_ids) : len(first.prompt_ids) + len(ids)] == ids
    obs = tok.decode(second.observation)
    assert not obs.startswith(fam.end)  # sampled already, not written twice
    rendered = ChatTemplate(tok).text([*QUESTION, CALL, RESULT, follow], tools)
    assert rendered.endswith(obs)  # the new turns as the template writes them
    # Qwen3's template drops the earlier <think> once a user turn follows; the sample keeps it.
    if name == "qwen3":
        assert "add them" not in rendered and "add them" in tok.decode(second.prompt_ids)


def test_a_turn_cut_by_the_token_limit_gets_the_templates_end_of_turn() -> None:
    tr, tok = _transcript("qwen2.5")
    first = tr.plan(QUESTION)
    cut = _pieces(tok, "The sum is")
    tr.record(
        first, _call(first, cut, {"role": "assistant", "content": "The sum is"}, finish="length")
    )
    second = tr.plan([*QUESTION, {"role": "assistant", "content": "The sum is"}, RESULT])
    assert tok.decode(second.observation).startswith("<|im_end|>\n<|im_start|>user\n")
    # Ended on a stop token the template does not write: its end of turn follows too.
    tr2, _ = _transcript("qwen2.5")
    first = tr2.plan(QUESTION)
    other = [*cut, tok.convert_tokens_to_ids("<|endoftext|>")]
    tr2.record(first, _call(first, other, {"role": "assistant", "content": "The sum is"}))
    second = tr2.plan([*QUESTION, {"role": "assistant", "content": "The sum is"}, RESULT])
    assert tok.decode(second.observation).startswith("<|im_end|>\n")


def _two_calls(name: str = "qwen2.5") -> tuple[Transcript, list[dict[str, Any]]]:
    tr, tok = _transcript(name)
    plan = tr.plan(QUESTION, TOOLS)
    ids = [*_pieces(tok, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')]
    tr.record(plan, _call(plan, [*ids, tok.convert_tokens_to_ids("<|im_end|>")], CALL))
    return tr, [*QUESTION, CALL, RESULT]


def _dump(call: dict[str, Any], **kw: Any) -> dict[str, Any]:
    args = json.dumps(json.loads(call["function"]["arguments"]), **kw)
    return {**call, "id": "other", "function": {**call["function"], "arguments": args}}


@pytest.mark.parametrize(
    "echo",
    [
        {**CALL, "content": None, "refusal": None},
        {**CALL, "tool_calls": [_dump(c, separators=(",", ":")) for c in CALL["tool_calls"]]},
        {**CALL, "content": "<think>\nhm\n</think>\n\n"},  # the reply returned with its thinking
    ],
)
def test_a_reply_sent_back_respelled_still_continues(echo: dict[str, Any]) -> None:
    tr, _ = _two_calls()
    plan = tr.plan([*QUESTION, echo, RESULT], TOOLS)
    assert (plan.continues, plan.cause) == (True, None)


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda m, t, o: ([{**m[0], "content": "Add 2 and 4"}, *m[1:]], t, o), "history_edited"),
        (lambda m, t, o: ([{"role": "user", "content": "summary"}, m[2]], t, o), "history_edited"),
        (lambda m, t, o: ([m[0], {**m[1], "content": "hm"}, m[2]], t, o), "reply_edited"),
        (lambda m, t, o: ([m[0], m[2]], t, o), "reply_edited"),
        (lambda m, t, o: (m, t[:1], o), "tools_changed"),
        (lambda m, t, o: (m, t, {"enable_thinking": False}), "options_changed"),
    ],
)
def test_every_break_starts_a_new_segment_by_cause(change: Any, cause: str) -> None:
    tr, msgs = _two_calls()
    msgs, tools, options = change(msgs, list(TOOLS), {})
    plan = tr.plan(msgs, tools, **options)
    assert (plan.continues, plan.cause) == (False, BreakCause(cause))
    assert plan.prompt_ids == ChatTemplate(family("qwen2.5").tokenizer).render(
        msgs, tools, **options
    )
    assert not tr.breaks  # counted when the call is recorded, not when planned
    tr.record(plan, _call(plan, [5, 6], {"role": "assistant", "content": "x"}))
    first, second = tr.samples()
    assert tr.breaks == {BreakCause(cause): 1}
    assert second.cause == cause and second.prompt_ids == plan.prompt_ids
    assert first.calls == second.calls == 1


def test_parallel_calls_and_failed_calls() -> None:
    tr, msgs = _two_calls()
    a, b = tr.plan(msgs, TOOLS), tr.plan(msgs, TOOLS)
    assert a == b and a.continues  # planning changes nothing: a call that fails leaves no trace
    tr.record(a, _call(a, [7], {"role": "assistant", "content": "a"}))
    tr.record(b, _call(b, [8], {"role": "assistant", "content": "b"}))
    first, second = tr.samples()
    assert tr.breaks == {BreakCause.CONCURRENT: 1}
    assert first.ids[-1] == 7 and second.ids.tolist() == [8]
    assert second.prompt_ids == b.prompt_ids  # the prompt the engine had, whole


def test_a_template_with_no_place_for_the_new_turns_breaks() -> None:
    tok = build_tokenizer((*SPECIAL_TOKENS, *"abc?"), chat=True)
    # Drops the content of every assistant turn but the last: nowhere to put the marker.
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "{{ m.content }}{% endif %}<eos>{% endfor %}"
    )
    tr = Transcript(ChatTemplate(tok))
    q = [{"role": "user", "content": "a?"}]
    plan = tr.plan(q)
    tr.record(plan, _call(plan, [4, 2], {"role": "assistant", "content": "b"}))
    again = tr.plan([*q, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    assert (again.continues, again.cause) == (False, BreakCause.TEMPLATE)


def test_record_refuses_arrays_that_disagree() -> None:
    tr, _ = _transcript("tiny")
    plan = tr.plan(QUESTION)
    bad = CallRecord(
        plan.prompt_ids,
        np.array([4, 5], np.int32),
        np.zeros(1, np.float32),
        np.zeros(2, np.int32),
        "stop",
        {"role": "assistant", "content": ""},
    )
    with pytest.raises(ValueError, match="2 output ids, 1 log-probs"):
        tr.record(plan, bad)


def test_the_tiny_models_chat_template_is_opt_in() -> None:
    plain = build_tokenizer()
    assert len(plain) == len(VOCAB) and not plain.chat_template
    chat = build_tokenizer(chat=True)
    assert (
        chat("12+3=", add_special_tokens=False)["input_ids"]
        == plain("12+3=", add_special_tokens=False)["input_ids"]
    )
    chars = build_tokenizer((*SPECIAL_TOKENS, *TINY_CHARS), chat=True)
    text = ChatTemplate(chars).text([*QUESTION, CALL])
    assert parse_tool_calls(chars.decode(chars(text, add_special_tokens=False)["input_ids"])) == [
        ToolCall("add", {"a": 2, "b": 3})
    ]


def test_save_random_tiny_model_with_chat(tmp_path: Any) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = save_random_tiny_model(tmp_path / "m", chars="abc", chat=True)
    tok = AutoTokenizer.from_pretrained(out)
    # (transformers' Qwen2 tokenizer adds an <|endoftext|> past the vocabulary, chat or not)
    assert AutoConfig.from_pretrained(out).vocab_size == tok.vocab_size == 3 + 3 + 6
    assert tok.chat_template and tok.convert_tokens_to_ids("<tool_call>") == 10


@pytest.mark.parametrize("name", FAMILIES)
def test_the_comparator_finds_every_sampled_token_and_every_break(name: str) -> None:
    """Random conversations (tools/compare_transcript.py; docs/benchmarks.md runs 10,000 per
    family): zero generated tokens differ from the sampled ones, every call's prompt is its
    segment's prefix, every break made is a segment of its cause, an unbroken conversation is
    one sample, canonical prompts decode to the template's own rendering."""
    stats = compare(name, 250, seed=1)
    assert stats.ok, stats
    assert stats.differing == stats.bad_prompts == stats.missed_breaks == 0
    assert stats.unbroken == stats.unbroken_one_sample > 100
    made = set(stats.breaks)
    assert made == set(BreakCause) - {BreakCause.TEMPLATE}, made
    assert stats.oracle_checked > 100 and stats.drifted > 100  # the drift is real


def test_the_comparator_catches_a_retokenizing_transcript(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparator's checks can fail: a transcript that re-derives ids from text (as a
    re-rendering gateway does) is caught on the first conversations."""
    stats = Stats("qwen2.5")
    fam = family("qwen2.5")
    original = Transcript.record

    def retokenize(self: Transcript, plan: Plan, call: CallRecord) -> None:
        text = fam.tokenizer.decode(call.output_ids.tolist())
        ids = np.asarray(self.template.encode(text), np.int32)
        n = len(ids)
        original(
            self,
            plan,
            CallRecord(
                call.prompt_ids,
                ids,
                np.zeros(n, np.float32),
                np.zeros(n, np.int32),
                call.finish,
                call.message,
            ),
        )

    monkeypatch.setattr(Transcript, "record", retokenize)
    for i in range(20):
        conv = Conversation(fam, random.Random(i), 0.0)
        conv.run()
        check(conv, stats)
    assert stats.differing > 0 and not stats.ok


TEXT = st.text(alphabet=TINY_CHARS, max_size=12)


@pytest.mark.parametrize("name", ["tiny", "qwen3"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_any_ids_any_order_of_calls(name: str, data: st.DataObject) -> None:
    """Arbitrary sampled ids (special tokens anywhere, empty replies, cut or stopped), calls
    that fail, edits, tool changes and parallel calls, in any order: every sampled id stays
    where it was recorded, every prompt is its segment's prefix, every break is a segment.
    With BPE, arbitrary ids include bytes that decode to no character."""
    tok = family(name).tokenizer
    tr = Transcript(ChatTemplate(tok))
    messages: list[dict[str, Any]] = [{"role": "user", "content": data.draw(TEXT)}]
    tools = list(TOOLS)
    recorded: list[tuple[Plan, CallRecord]] = []
    causes: list[BreakCause | None] = []
    version = 0
    for step in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["continue", "edit", "tools", "failed", "parallel"]))
        if step and op == "edit":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "x"}
        elif step and op == "tools":
            tools = tools[:1] if len(tools) > 1 else list(TOOLS)
        plan = tr.plan(messages, tools)
        assert tr.plan(messages, tools) == plan  # planning is pure
        expected = (
            None if not step else {"edit": "history_edited", "tools": "tools_changed"}.get(op)
        )
        assert plan.cause == expected and plan.continues == (step > 0 and expected is None)
        plans = [plan, plan] if op == "parallel" else [plan]
        for k, p in enumerate(plans):
            ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=16))
            finish = data.draw(st.sampled_from(["stop", "length"]))
            version += data.draw(st.integers(0, 1))
            reply = {"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}
            call = _call(p, ids, reply, version, finish)
            tr.record(p, call)
            recorded.append((p, call))
            causes.append(BreakCause.CONCURRENT if k else p.cause)
        messages = [*plan.messages, reply, {"role": "user", "content": data.draw(TEXT)}]
    segments = tr.samples()
    calls = iter(recorded)
    for seg in segments:
        for start, end in seg.spans:
            plan, call = next(calls)
            assert seg.ids[start:end].tolist() == call.output_ids.tolist()
            assert seg.versions[start:end].tolist() == call.versions.tolist()
            assert seg.loss_mask[start:end].all()
            assert plan.prompt_ids == [*seg.prompt_ids, *seg.ids[:start].tolist()]
        assert (seg.logprobs[seg.loss_mask == 0] == 0).all()
        assert (np.diff(seg.versions) >= 0).all()
    assert next(calls, None) is None
    breaks = [c for c in causes[1:] if c is not None]
    assert [s.cause for s in segments] == [None, *breaks]
    assert tr.breaks == Counter(breaks)


def _streamed(message: dict[str, Any]) -> dict[str, Any]:
    """The reply as a client assembles it from a stream: content deltas joined (None when there
    were none), each call's arguments from its fragments, as the `openai` SDK's accumulator
    does."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": None}]
    text = message.get("content") or ""
    deltas += [{"content": text[i : i + 3]} for i in range(0, len(text), 3)]
    for index, call in enumerate(message.get("tool_calls") or ()):
        args = call["function"]["arguments"]
        head = {"index": index, "id": call["id"], "type": "function"}
        deltas.append({"tool_calls": [head | {"function": {"name": call["function"]["name"]}}]})
        for i in range(0, len(args), 4):
            deltas.append(
                {"tool_calls": [{"index": index, "function": {"arguments": args[i : i + 4]}}]}
            )
    out: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": []}
    for delta in deltas:
        if delta.get("content"):
            out["content"] = (out["content"] or "") + delta["content"]
        for part in delta.get("tool_calls", ()):
            if part["index"] == len(out["tool_calls"]):
                out["tool_calls"].append(
                    {
                        "id": part["id"],
                        "type": "function",
                        "function": {"name": "", "arguments": ""},
                    }
                )
            fn = out["tool_calls"][part["index"]]["function"]
            fn["name"] += part["function"].get("name", "")
            fn["arguments"] += part["function"].get("arguments", "")
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_a_streamed_reply_records_and_plans_like_a_whole_one(name: str) -> None:
    """The same sampled tool call returned whole or streamed: the client's two versions of the
    reply give the same next prompt and the same sample."""
    fam = family(name)
    samples = []
    seed = next(
        i
        for i in range(100)
        if Conversation(fam, random.Random(i), 0.0)
        .engine.reply(list(TOOLS), 0)[1]
        .message.get("tool_calls")
    )
    for stream in (False, True):
        conv = Conversation(fam, random.Random(seed), 0.0)
        tr = conv.transcript
        plan = tr.plan(QUESTION, TOOLS)
        record = conv.engine.reply(list(TOOLS), 0)[1]
        message = dict(record.message)
        tr.record(
            plan,
            CallRecord(
                plan.prompt_ids,
                record.output_ids,
                record.logprobs,
                record.versions,
                record.finish,
                message,
            ),
        )
        echo = _streamed(message) if stream else message
        assert [c["function"] for c in echo["tool_calls"]] == [
            c["function"] for c in message["tool_calls"]
        ]
        results = [{**RESULT, "tool_call_id": c["id"]} for c in message["tool_calls"]]
        nxt = tr.plan([*QUESTION, echo, *results], TOOLS)
        assert nxt.continues
        tr.record(nxt, _call(nxt, [5], {"role": "assistant", "content": ""}))
        samples.append((nxt.prompt_ids, [s.ids.tolist() for s in tr.samples()]))
    assert samples[0] == samples[1]


def test_rebase_moves_the_prompts_tail_into_the_response_masked() -> None:
    tr, _ = _two_calls()
    plan = tr.plan([*QUESTION, CALL, RESULT], TOOLS)
    tr.record(plan, _call(plan, [9, 9], {"role": "assistant", "content": "x"}, version=5))
    [seg] = tr.samples()
    n = len(seg.prompt_ids)
    moved = seg.rebase(2)
    assert moved.prompt_ids == seg.prompt_ids[:2]
    assert [*moved.prompt_ids, *moved.ids.tolist()] == [*seg.prompt_ids, *seg.ids.tolist()]
    assert moved.loss_mask.tolist() == [0] * (n - 2) + seg.loss_mask.tolist()
    assert moved.versions.tolist() == [3] * (n - 2) + seg.versions.tolist()
    assert (moved.logprobs[: n - 2] == 0).all()
    assert [moved.ids[a:b].tolist() for a, b in moved.spans] == [
        seg.ids[a:b].tolist() for a, b in seg.spans
    ]
    same = seg.rebase(n)
    assert same.prompt_ids == seg.prompt_ids and same.ids.tolist() == seg.ids.tolist()
    with pytest.raises(ValueError, match="rebase at"):
        seg.rebase(n + 1)


def test_messages_the_template_refuses_are_one_error() -> None:
    tr, _ = _transcript("llama3")
    two = {**CALL, "tool_calls": CALL["tool_calls"] * 2}  # Llama 3.1 takes one call per turn
    with pytest.raises(RenderError, match="only supports single tool-calls"):
        tr.plan([*QUESTION, two, RESULT], TOOLS)
    assert tr.samples() == [] and not tr.breaks


@pytest.mark.parametrize("name", FAMILIES)
def test_the_fast_encoder_gives_the_tokenizers_ids(name: str) -> None:
    tok = family(name).tokenizer
    template = ChatTemplate(tok)
    text = template.text([*QUESTION, CALL, RESULT, {"role": "user", "content": "Thanks"}], TOOLS)
    assert template.encode(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert template.render([*QUESTION], TOOLS) == tok.apply_chat_template(
        [*QUESTION], tools=list(TOOLS), add_generation_prompt=True, tokenize=True, return_dict=False
    )
