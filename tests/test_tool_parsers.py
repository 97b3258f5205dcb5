"""Tool-call and reasoning parsers on recorded outputs, whole and streamed at every cut.

Each recorded output (written by hand in the model's format) has its expected
content and calls. It is parsed whole, then streamed cut at every character
boundary (all two-piece splits), one character at a time, and at random cuts;
every way must give the expected answer, with the streaming invariants of
OpenAI's chunks: one delta per call carries its id and name, no later than its
first arguments, and the ids are those of ``tool_calls``. Hypothesis then
builds arbitrary outputs from marker-like fragments and checks that streaming
at random cuts still gives what ``parse`` gives.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_ray.openai.reasoning import REASONING_PARSERS, ReasoningParser, make_reasoning_parser
from dspark_ray.openai.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolParser, make_tool_parser

WEATHER = {"location": "San Francisco, CA", "unit": "fahrenheit"}
NESTED = {
    "path": "notes/a}b.md",
    "content": 'Close a call with </tool_call>; braces: {"x": [1, {}]}\n\t"quoted" \\ backslash',
    "options": {"mode": "w", "tags": ["x", {"deep": None}], "n": -1.5e3},
}
UNICODE = {"text": "naïve café — 東京 🚀", "target": "ja", "escaped": "é🚀"}

# (id, output, content parse must return, [(name, arguments object)])
HERMES = [
    ("one-call",
     '<tool_call>\n{"name": "get_current_weather", "arguments": '
     '{"location": "San Francisco, CA", "unit": "fahrenheit"}}\n</tool_call>',
     None, [("get_current_weather", WEATHER)]),
    ("two-parallel",
     '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
     '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>',
     None, [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    ("content-before",
     "I'll look up the weather for you.\n\n<tool_call>\n"
     '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}\n'
     "</tool_call>",
     "I'll look up the weather for you.\n\n", [("get_current_weather", WEATHER)]),
    ("nested-strings-with-markers",
     "<tool_call>\n" + json.dumps({"name": "write_file", "arguments": NESTED}) + "\n</tool_call>",
     None, [("write_file", NESTED)]),
    ("unicode",
     '<tool_call>\n{"name": "translate", "arguments": {"text": "naïve café — 東京 🚀", "target": "ja", '
     '"escaped": "\\u00e9\\ud83d\\ude80"}}\n</tool_call>',
     None, [("translate", UNICODE)]),
    ("arguments-as-json-text",
     '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"ray serve </tool_call>\\", \\"limit\\": 5}"}'
     "\n</tool_call>",
     None, [("search", {"query": "ray serve </tool_call>", "limit": 5})]),
    ("no-newlines-and-odd-whitespace",
     '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
     '<tool_call>  \n\n {"name": "add", "arguments": {"a": 1, "b": 2}}   \n</tool_call>\n',
     None, [("get_time", {}), ("add", {"a": 1, "b": 2})]),
    ("whitespace-around-calls",
     '\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n\n \n'
     '<tool_call>\n{"name": "g", "arguments": {"y": 2}}\n</tool_call>\n\n',
     None, [("f", {"x": 1}), ("g", {"y": 2})]),
    ("content-after-call",
     '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone, <tool calls> finished.',
     "\nDone, <tool calls> finished.", [("f", {})]),
    ("plain-content",
     "The capital of France is Paris. Tags like <tool> or <tool_call without a bracket are text.",
     "The capital of France is Paris. Tags like <tool> or <tool_call without a bracket are text.", []),
    ("whitespace-only", "\n\n  ", "\n\n  ", []),
    ("empty", "", "", []),
    ("malformed-missing-brace",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', []),
    ("malformed-then-valid",
     'Let me try.\n<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "ok", "arguments": {"x": 2}}\n</tool_call>',
     'Let me try.\n<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>\n', [("ok", {"x": 2})]),
    ("valid-then-malformed-after-whitespace",
     '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "bad", "arguments": "not json"}\n</tool_call>',
     '\n<tool_call>\n{"name": "bad", "arguments": "not json"}\n</tool_call>', [("ok", {})]),
    ("junk-after-json-in-block",
     '<tool_call>\n{"name": "f", "arguments": {}} trailing words\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {}} trailing words\n</tool_call>', []),
    ("unterminated-valid",
     '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n',
     None, [("f", {"a": [1, 2]})]),
    ("unterminated-with-cut-end-tag",
     '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_ca',
     None, [("f", {"a": 1})]),
    ("unterminated-invalid",
     'Sure.<tool_call>\n{"name": "f", "argu',
     'Sure.<tool_call>\n{"name": "f", "argu', []),
]

LLAMA3 = [
    ("python-tag",
     '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Menlo Park", "unit": "celsius"}}',
     None, [("get_weather", {"location": "Menlo Park", "unit": "celsius"})]),
    ("no-tag",
     '{"name": "get_weather", "parameters": {"location": "Menlo Park"}}',
     None, [("get_weather", {"location": "Menlo Park"})]),
    ("two-calls",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("arguments-key-and-markers-in-strings",
     '{"name": "run_sql", "arguments": {"query": "SELECT \'}\' ; DROP {x}", "note": "a \\"quoted; }\\" b"}}',
     None, [("run_sql", {"query": "SELECT '}' ; DROP {x}", "note": 'a "quoted; }" b'})]),
    ("nested",
     json.dumps({"name": "write_file", "parameters": NESTED}) + ";",
     None, [("write_file", NESTED)]),
    ("unicode",
     '{"name": "translate", "parameters": {"text": "Grüße aus München 🍺", "to": "日本語"}}',
     None, [("translate", {"text": "Grüße aus München 🍺", "to": "日本語"})]),
    ("whitespace-around",
     '\n\n {"name": "f", "parameters": {}}\n;\n{"name": "g", "parameters": {"k": [1]}}  \n',
     None, [("f", {}), ("g", {"k": [1]})]),
    ("plain-content", "The weather in Paris is 18°C and sunny. {Braces} later are text.",
     "The weather in Paris is 18°C and sunny. {Braces} later are text.", []),
    ("content-opening-with-angle", "<b>Bold</b> answer", "<b>Bold</b> answer", []),
    ("leading-whitespace-content", "\n  Hello {name}", "\n  Hello {name}", []),
    ("whitespace-only", " \n ", " \n ", []),
    ("empty", "", "", []),
    ("python-tag-with-code", "<|python_tag|>print(1 + 1)", "<|python_tag|>print(1 + 1)", []),
    ("python-tag-alone", "<|python_tag|>", "<|python_tag|>", []),
    ("json-not-a-call", ' {"answer": 42, "unit": "none"}', ' {"answer": 42, "unit": "none"}', []),
    ("unterminated", '<|python_tag|>{"name": "f", "parameters": {"a": 1}',
     '<|python_tag|>{"name": "f", "parameters": {"a": 1}', []),
    ("invalid-json-balanced", "{name: f, parameters: {}}", "{name: f, parameters: {}}", []),
    ("call-then-prose",
     '{"name": "f", "parameters": {"x": 1}}\n\nI called f.',
     "\n\nI called f.", [("f", {"x": 1})]),
    ("call-then-malformed",
     '{"name": "f", "parameters": {}}; {"nam": "g", "parameters": {}}',
     '; {"nam": "g", "parameters": {}}', [("f", {})]),
    ("call-then-unterminated",
     '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {',
     '; {"name": "g", "parameters": {', [("f", {})]),
]

CASES = [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA3]
CASE_IDS = [f"{c[0]}-{c[1]}" for c in CASES]
ID = re.compile(r"call_[0-9a-f]{24}")


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, object]]]:
    """Feed the pieces, finish, check the chunk invariants; returns (content, [(name, arguments)])."""
    deltas: list[ParsedDelta] = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    heads: dict[int, tuple[str, str]] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.id is not None or tc.name is not None:
                assert tc.id is not None and tc.name is not None, "id and name come together"
                assert tc.index not in heads, f"call {tc.index} got a second id/name"
                heads[tc.index] = (tc.id, tc.name)
            assert tc.index in heads, f"call {tc.index} got arguments before its id and name"
            args[tc.index] = args.get(tc.index, "") + tc.arguments
    assert sorted(heads) == list(range(len(heads))), "calls are numbered 0, 1, ..."
    calls = parser.tool_calls
    assert [heads[i] for i in range(len(heads))] == [(c.id, c.name) for c in calls]
    assert [json.loads(args[i]) for i in range(len(args))] == [json.loads(c.arguments) for c in calls]
    return content, [(heads[i][1], json.loads(args[i])) for i in range(len(heads))]


@pytest.mark.parametrize(("parser", "name", "output", "content", "calls"), CASES, ids=CASE_IDS)
def test_parse_whole(parser: str, name: str, output: str, content: str | None, calls: list) -> None:
    got_content, got_calls = make_tool_parser(parser).parse(output)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for c in got_calls:
        assert ID.fullmatch(c.id)
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)
    assert len({c.id for c in got_calls}) == len(got_calls)
    if not calls:
        assert got_content == output, "an output without calls is content, unchanged"


@pytest.mark.parametrize(("parser", "name", "output", "content", "calls"), CASES, ids=CASE_IDS)
def test_streamed_at_every_cut(parser: str, name: str, output: str, content: str | None, calls: list) -> None:
    want = (content or "", calls)
    for cut in range(len(output) + 1):
        assert stream(make_tool_parser(parser), [output[:cut], output[cut:]]) == want, f"cut at {cut}"
    assert stream(make_tool_parser(parser), list(output)) == want, "one character at a time"


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_at_random_cuts(data: st.DataObject) -> None:
    parser, _, output, content, calls = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(output)), max_size=12)))
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    assert stream(make_tool_parser(parser), pieces) == (content or "", calls)


# Fragments that trip the markers, strings, escapes and separators, to build arbitrary outputs from.
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<|py", "{", "}", "[", "]",
             '"', "\\", ";", " ", "\n", "x", "<", '{"name": "f", "arguments": {"a": "}"}}', '"parameters": {}}',
             '{"name": "g", ', '<tool_call>\n{"name": "h", "arguments": "{\\"b\\": [1]}"}\n</tool_call>',
             "<think>", "</think>", "</th"]


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(sorted(TOOL_PARSERS)), data=st.data())
def test_any_output_streams_as_it_parses(parser: str, data: st.DataObject) -> None:
    output = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(output)), max_size=8)))
    content, calls = make_tool_parser(parser).parse(output)
    if not calls:
        assert content == output
    else:
        assert content is None or content.strip(), "no whitespace-only content beside calls"
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    want = [(c.name, json.loads(c.arguments)) for c in calls]
    assert stream(make_tool_parser(parser), pieces) == (content or "", want)


def test_calls_have_fresh_ids() -> None:
    output = HERMES[1][1]
    ids = [c.id for _ in range(3) for c in make_tool_parser("hermes").parse(output)[1]]
    assert len(set(ids)) == len(ids) == 6


def released(parser: ToolParser, text: str) -> list[str]:
    """The content released after each character of text, fed one at a time."""
    out, so_far = [], ""
    for ch in text:
        so_far += parser.feed(ch).content
        out.append(so_far)
    return out


def test_hermes_holds_back_only_a_possible_tag() -> None:
    # Content is released as soon as it cannot be the start of <tool_call>.
    text = "Use <tool> or <tool_call x> in <tool_c"
    got = released(make_tool_parser("hermes"), text)
    for n, so_far in enumerate(got, 1):
        prefix = text[:n]
        held = max(k for k in range(min(n, 10) + 1) if "<tool_call>".startswith(prefix[n - k:]))
        assert so_far == prefix[:n - held], prefix
    assert got[-1] == "Use <tool> or <tool_call x> in "


def test_hermes_streams_content_before_a_call_and_nothing_of_the_call_until_it_closes() -> None:
    parser = make_tool_parser("hermes")
    assert parser.feed("Checking.\n").content == "Checking.\n"
    d = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_')
    assert d == ParsedDelta()
    d = parser.feed("call>\n\n")
    assert d.content == "" and [(t.index, t.name, json.loads(t.arguments)) for t in d.tool_calls] == [(0, "f", {"a": 1})]
    assert parser.feed("More") == ParsedDelta(content="\n\nMore"), "whitespace after a call is released with text"


def test_hermes_drops_whitespace_between_calls_while_streaming() -> None:
    parser = make_tool_parser("hermes")
    parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert parser.feed("\n\n").content == ""
    parser.feed('<tool_call>{"name": "g", "arguments": {}}</tool_call>\n')
    assert parser.finish() == ParsedDelta()
    assert [c.name for c in parser.tool_calls] == ["f", "g"]


def test_llama3_decides_at_the_first_character() -> None:
    assert released(make_tool_parser("llama3_json"), "Hi {x}") == ["H", "Hi", "Hi ", "Hi {", "Hi {x", "Hi {x}"]
    # Whitespace and a possible python tag wait; anything else settles it as content.
    assert released(make_tool_parser("llama3_json"), " <|py") == ["", "", "", "", ""]
    assert released(make_tool_parser("llama3_json"), " <b") == ["", "", " <b"]


def test_tool_calls_accumulate_as_calls_complete() -> None:
    parser = make_tool_parser("llama3_json")
    parser.feed('{"name": "f", "parameters": {}}; {"name": "g", ')
    assert [c.name for c in parser.tool_calls] == ["f"]
    parser.feed('"parameters": {}}')
    assert [c.name for c in parser.tool_calls] == ["f", "g"]
    assert parser.finish() == ParsedDelta()


@pytest.mark.parametrize("name", ["mistral", "Hermes", ""])
def test_unknown_tool_parser(name: str) -> None:
    with pytest.raises(ValueError, match=r"known: hermes, llama3_json"):
        make_tool_parser(name)
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}


# --- reasoning ---------------------------------------------------------------------------------

# (parser, output, reasoning, content)
REASONING = [
    ("think", "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "\nThe user asks 2+2. That is 4.\n", "The answer is 4."),
    ("think", "<think>Still weighing </thin", "Still weighing </thin", None),
    ("think", "<think></think>Hi", None, "Hi"),
    ("think", "<think>a</think>\n\n", "a", None),
    ("think", "<think>a</think>\n \tx <think>y</think>", "a", "x <think>y</think>"),
    ("think", "\n<think>r</think>c", "r", "\nc"),
    ("think", "Just an answer, mentioning </think> and <think>.", None,
     "Just an answer, mentioning </think> and <think>."),
    ("think", "<thinking>no</thinking>", None, "<thinking>no</thinking>"),
    ("think", "<thi", None, "<thi"),
    ("think", "  ", None, "  "),
    ("think", "", None, None),
    ("think", "<think>Über 東京 🚀</think>答え", "Über 東京 🚀", "答え"),
    ("qwen3", "<think>\nLet me see.\n</think>\n\nHello! How can I help?", "\nLet me see.\n", "Hello! How can I help?"),
    ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),
    ("qwen3", "no opening tag</think>answer", None, "no opening tag</think>answer"),
    ("qwen3", "<think>\n\n</think>\n\nHi", "\n\n", "Hi"),
    ("qwen3", "<think>cut off while thin", "cut off while thin", None),
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\n**4**", "Okay, 2+2 is 4.\n", "**4**"),
    ("deepseek_r1", "<think>\nHmm.\n</think>Answer", "\nHmm.\n", "Answer"),
    ("deepseek_r1", "  <think>x</think>y", "  x", "y"),
    ("deepseek_r1", "Thinking without an end", "Thinking without an end", None),
    ("deepseek_r1", "</think>\n\nDirect", None, "Direct"),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "a <think> inside</think>b</think>", "a <think> inside", "b</think>"),
    ("deepseek_r1", "", None, None),
]


def stream_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), REASONING)
def test_reasoning_whole_and_streamed(parser: str, output: str, reasoning: str | None, content: str | None) -> None:
    assert make_reasoning_parser(parser).parse(output) == (reasoning, content)
    want = (reasoning or "", content or "")
    for cut in range(len(output) + 1):
        assert stream_reasoning(make_reasoning_parser(parser), [output[:cut], output[cut:]]) == want, f"cut at {cut}"
    assert stream_reasoning(make_reasoning_parser(parser), list(output)) == want


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_reasoning_random_cuts(data: st.DataObject) -> None:
    parser, output, reasoning, content = data.draw(st.sampled_from(REASONING))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(output)), max_size=10)))
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    assert stream_reasoning(make_reasoning_parser(parser), pieces) == (reasoning or "", content or "")


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(sorted(REASONING_PARSERS)), data=st.data())
def test_any_reasoning_output_streams_as_it_parses(parser: str, data: st.DataObject) -> None:
    output = "".join(data.draw(st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", "<", " ", "\n", "a"]),
                                        max_size=12)))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(output)), max_size=8)))
    reasoning, content = make_reasoning_parser(parser).parse(output)
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    assert stream_reasoning(make_reasoning_parser(parser), pieces) == (reasoning or "", content or "")
    # Nothing is lost but the markers and the whitespace after the end marker.
    if "<think>" not in output and "</think>" not in output:
        assert (reasoning or "") + (content or "") == output


def test_reasoning_holds_back_only_a_possible_marker() -> None:
    parser = make_reasoning_parser("think")
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>abc</th") == ("abc", "")
    assert parser.feed("ing") == ("</thing", "")
    assert parser.feed("</think>\n") == ("", "")
    assert parser.feed("\nAn") == ("", "An")
    assert parser.feed("swer") == ("", "swer")
    assert parser.finish() == ("", "")


def test_reasoning_custom_markers() -> None:
    parser = ReasoningParser("◁think▷", "◁/think▷")
    assert parser.parse("◁think▷hmm◁/think▷ ok") == ("hmm", "ok")
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningParser("", "</think>")


@pytest.mark.parametrize("name", ["deepseek-r1", "granite", ""])
def test_unknown_reasoning_parser(name: str) -> None:
    with pytest.raises(ValueError, match=r"known: deepseek_r1, qwen3, think"):
        make_reasoning_parser(name)
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "think"}
