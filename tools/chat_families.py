"""Chat template families, offline: the templates of Qwen2.5, Qwen3 and Llama 3.1 (tools
included) over small byte-level BPE tokenizers trained here, and the tiny model's char
tokenizer with its chat template. No download: the tests and `tools/compare_transcript.py`
build them in well under a second.

The templates follow the published ones (tokenizer_config.json of Qwen2.5-7B-Instruct,
Qwen3-8B and Llama-3.1-8B-Instruct) statement by statement; where they differ:
- Qwen2.5's default system prompt is shortened and its tool preamble kept verbatim;
- Qwen3 is its tool/think template without the `content is string` guards for multimodal
  content (contents here are strings), its tool turn shared with Qwen2.5 (`loop.index0 == 0`
  for `loop.first`);
- Llama 3.1 leaves out the builtin tools (`brave_search`, `code_interpreter`) and the
  `<|python_tag|>` call form: custom tools only, as JSON in the turn (`{"name": …,
  "parameters": …}`), one call per turn (the template refuses more, as the real one does).

The BPE tokenizers are trained on a corpus of the words, JSON and numbers the comparator's
conversations are made of, so merges are real: the same text encoded whole and encoded in
pieces gives different ids, the retokenization drift a char tokenizer cannot show.
"""

# ruff: noqa: E501  (the templates keep their published lines)

from __future__ import annotations

import functools
import json
import random
import string
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from asyncrl.tiny_model import SPECIAL_TOKENS, build_tokenizer

_QWEN_TOOL_LIST = """    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
"""
_QWEN_TOOL_TURN = """    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
"""
"""Qwen3's is the same, its first test spelled `loop.first`."""

QWEN25_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
"""
    + _QWEN_TOOL_LIST
    + """{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
"""
    + _QWEN_TOOL_TURN
    + """{%- endif %}
"""
)

QWEN3_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
"""
    + _QWEN_TOOL_LIST
    + """{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content or '' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
"""
    + _QWEN_TOOL_TURN
    + """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

_LLAMA_TOOL_LIST = """    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
"""
"""The published template writes it twice: in the system turn or the first user turn."""

LLAMA3_TEMPLATE = (
    """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
"""
    + _LLAMA_TOOL_LIST
    + """{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
"""
    + _LLAMA_TOOL_LIST
    + """    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
)

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "are",
    "from",
    "or",
    "have",
    "not",
    "add",
    "sum",
    "search",
    "weather",
    "city",
    "temperature",
    "result",
    "number",
    "answer",
    "first",
    "then",
    "next",
    "call",
    "tool",
    "let",
    "me",
    "check",
    "what",
    "find",
    "compute",
    "value",
    "total",
    "price",
    "item",
    "list",
    "name",
    "query",
    "units",
    "celsius",
    "Paris",
    "London",
    "Tokyo",
    "Berlin",
    "rain",
    "sunny",
    "cloudy",
    "wind",
    "today",
    "tomorrow",
    "yes",
    "no",
    "done",
    "ok",
    "thanks",
    "please",
    "question",
    "user",
    "assistant",
    "think",
    "reasoning",
    "step",
    "plan",
    "because",
    "so",
    "however",
]

TOOLS: tuple[dict[str, Any], ...] = tuple(
    {"type": "function", "function": {"name": name, "description": doc, "parameters": params}}
    for name, doc, params in (
        (
            "add",
            "Add two numbers.",
            {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        ),
        (
            "search",
            "Search the web.",
            {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        ),
        (
            "weather",
            "The weather in a city.",
            {
                "type": "object",
                "properties": {"city": {"type": "string"}, "units": {"type": "string"}},
                "required": ["city"],
            },
        ),
    )
)

TINY_CHARS = string.ascii_letters + string.digits + " {}[]\":,.+-=_?!'<>/"
"""The characters the tiny family's conversations are written in (no newline: the char
tokenizer's pre-tokenizer leaves a run of them whole, which its vocabulary lacks)."""


@dataclass(frozen=True)
class Family:
    """A template family: its tokenizer and how its model writes a reply."""

    name: str
    tokenizer: PreTrainedTokenizerFast
    end: str
    """The end of turn the model samples."""
    other_end: str | None
    """Another stop token the model may end on, which the template does not write."""
    call_style: str
    """`hermes` (`<tool_call>{json}</tool_call>`) or `json` (Llama 3.1: the turn is the call)."""
    thinks: bool
    """Its replies may open with a `<think>` block."""
    max_calls: int
    """Tool calls per reply the template accepts."""
    alphabet: str | None = None
    """The characters its text may hold (None: any)."""


def _corpus(rng: random.Random, lines: int) -> list[str]:
    out = []
    for _ in range(lines):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        args = {"a": rng.randint(0, 999), "b": round(rng.uniform(-50, 50), 2)}
        out.append(words)
        out.append(
            json.dumps({"name": rng.choice(["add", "search", "weather"]), "arguments": args})
        )
        out.append(f"<tool_call>\n{json.dumps({'name': 'add', 'arguments': args})}\n</tool_call>")
    out.extend(json.dumps(t) for t in TOOLS)
    return out


def bpe_tokenizer(
    specials: tuple[str, ...], added: tuple[str, ...], *, bos: str | None, eos: str, pad: str
) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 800 ids trained on the comparator's kind of text, `specials` as
    special tokens and `added` as added ordinary ones (Qwen's `<tool_call>`, `<think>`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(0), 400), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        clean_up_tokenization_spaces=False,
    )


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LLAMA_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)


@functools.cache
def family(name: str) -> Family:
    """`qwen2.5`, `qwen3`, `llama3` or `tiny`."""
    if name in ("qwen2.5", "qwen3"):
        added = QWEN_ADDED + (("<think>", "</think>") if name == "qwen3" else ())
        tok = bpe_tokenizer(QWEN_SPECIALS, added, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
        tok.chat_template = QWEN3_TEMPLATE if name == "qwen3" else QWEN25_TEMPLATE
        return Family(name, tok, "<|im_end|>", "<|endoftext|>", "hermes", name == "qwen3", 3)
    if name == "llama3":
        tok = bpe_tokenizer(
            LLAMA_SPECIALS, (), bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>"
        )
        tok.chat_template = LLAMA3_TEMPLATE
        return Family(name, tok, "<|eot_id|>", "<|eom_id|>", "json", False, 1)
    if name == "tiny":
        tok = build_tokenizer((*SPECIAL_TOKENS, *TINY_CHARS), chat=True)
        return Family(name, tok, "<eos>", None, "hermes", False, 3, TINY_CHARS)
    raise ValueError(f"unknown family {name!r}")


FAMILIES = ("qwen2.5", "qwen3", "llama3", "tiny")
