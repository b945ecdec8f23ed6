"""chat.py encoders against the official Jinja template (rendered as transformers renders it) and the
golden strings of spec/chat.md; the real tokenizer's ids; the parsers on the spec's cases, with
streaming equal to whole-text parsing under every chunking."""
import json
import random

import pytest
from hypothesis import given, settings, strategies as st

import chat
import checkpoint
from chat import ASSISTANT, BOS, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, DSML, EOS, TOOL_SEP, USER

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment

SYS = {"role": "system", "content": "You are helpful."}
U = {"role": "user", "content": "Time in Tokyo?"}
TC = {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": '{"city": "Tokyo"}'}}]}
TOOL = {"role": "tool", "content": "10:00"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}


def jinja_render(messages, **kw):
    """The official template as transformers renders it: trim_blocks, lstrip_blocks, tojson keeping
    key order and Unicode; dict arguments serialised first, since the template only concatenates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    msgs = json.loads(json.dumps(messages))
    for m in msgs:
        for c in m.get("tool_calls") or []:
            if not isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
    return env.from_string(chat.chat_template()).render(messages=msgs, bos_token=BOS, **kw)


# -----------------------------------------------------------------------------
# v32exp: golden renders (spec §3.3), the V3.1 differences (§3.4), the tools block (§3.5)

def test_golden_renders_of_spec_3_3():
    B = BOS + "You are helpful.<｜User｜>Time in Tokyo?"
    calls = (CALLS_BEGIN + CALL_BEGIN + 'get_time' + TOOL_SEP + '{"city": "Tokyo"}' + CALL_END + CALLS_END + EOS)
    assert chat.encode([SYS, U]) == B + "<｜Assistant｜></think>"                                        # A
    assert chat.encode([SYS, U], thinking=True) == B + "<｜Assistant｜><think>"                          # B
    hist = [SYS, U, {"role": "assistant", "content": "<think>hmm</think>Hi!"}, {"role": "user", "content": "again"}]
    assert chat.encode(hist, thinking=True) == \
        B + "<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜><｜User｜>again<｜Assistant｜><think>"           # C
    d = B + "<｜Assistant｜></think>" + calls + "<｜tool▁output▁begin｜>10:00<｜tool▁output▁end｜>"
    assert chat.encode([SYS, U, TC, TOOL]) == d                                                         # D
    # E and F elide their start with "…" in the spec; the full strings follow from rules 3-5 of §3.2
    # (E ends at the EOS: rendered without the generation prompt, which rule 6 would append)
    assert chat.encode([SYS, U, TC, TOOL, {"role": "assistant", "content": "It is 10:00."}], add_generation_prompt=False) == \
        d + "It is 10:00.<｜end▁of▁sentence｜>"                                                           # E
    par = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Tokyo"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": '{"city": "東京"}'}}]}
    assert chat.encode([SYS, U, par, TOOL, TOOL]) == (
        B + "<｜Assistant｜></think>Let me check." + CALLS_BEGIN + CALL_BEGIN + 'get_time' + TOOL_SEP
        + '{"city": "Tokyo"}' + CALL_END + CALL_BEGIN + 'get_time' + TOOL_SEP + '{"city": "東京"}' + CALL_END
        + CALLS_END + EOS + "<｜tool▁output▁begin｜>10:00<｜tool▁output▁end｜>" * 2)                         # F
    assert chat.encode([SYS]) == BOS + "You are helpful.<｜Assistant｜></think>"                         # G
    pre = {"role": "assistant", "content": "Sure,", "prefix": True}
    assert chat.encode([SYS, U, pre], thinking=True) == B + "<｜Assistant｜><think>Sure,<｜end▁of▁sentence｜>"  # I


def test_v32exp_differs_from_v31_as_spec_3_4_says():
    # the V3.2-Exp column of the table: each case adds what V3.1 leaves out
    assert chat.encode([SYS]).endswith("You are helpful.<｜Assistant｜></think>")
    a = {"role": "assistant", "content": "A"}
    assert chat.encode([SYS, U, a]).endswith("A<｜end▁of▁sentence｜><｜Assistant｜></think>")
    assert chat.encode([SYS, TC], add_generation_prompt=False).startswith(BOS + "You are helpful.<｜Assistant｜></think>" + CALLS_BEGIN)


def test_nothing_appended_after_a_tool_result():
    assert chat.encode([U, TC, TOOL], thinking=True).endswith("<｜tool▁output▁end｜>")


def test_empty_tool_calls_is_absent_and_dict_arguments_are_not_double_encoded():
    a = {"role": "assistant", "content": "Hi", "tool_calls": []}
    assert chat.encode([U, a]) == chat.encode([U, {"role": "assistant", "content": "Hi"}])
    as_dict = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"b": "<a&'>", "a": "東京"}}}]}
    as_text = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"b": "<a&\'>", "a": "東京"}'}}]}
    assert chat.encode([U, as_dict]) == chat.encode([U, as_text])
    assert '{"b": "<a&\'>", "a": "東京"}' in chat.encode([U, as_dict])                     # key order, Unicode kept


def test_tools_block_with_and_without_system():
    tail = chat.V31_TOOLS_TAIL
    block = ("## Tools\nYou have access to the following tools:\n\n### get_weather\nDescription: Weather of a city"
             '\n\nParameters: {"type": "object", "properties": {"location": {"type": "string"}}}\n' + tail)
    assert chat.encode([SYS, U], tools=[WEATHER]) == \
        BOS + "You are helpful.\n\n" + block + "<｜User｜>Time in Tokyo?<｜Assistant｜></think>"
    assert chat.encode([U], tools=[WEATHER]) == BOS + "\n\n" + block + "<｜User｜>Time in Tokyo?<｜Assistant｜></think>"
    bare = {"type": "function", "function": {"name": "now", "description": None, "parameters": {}}}
    assert "\n### now\n\nParameters: {}\n" in chat.encode([U], tools=[bare])            # None: no Description line
    assert tail.startswith("\nIMPORTANT: ALWAYS adhere") and "{{additional_tool_calls}}" in tail


def test_thinking_switch_and_enable_thinking_alias():
    assert chat.encode([U]).endswith("</think>") and chat.encode([U], thinking=False).endswith("</think>")
    assert chat.encode([U], enable_thinking=True) == chat.encode([U], thinking=True)
    with pytest.raises(ValueError, match="disagree"):
        chat.encode([U], thinking=False, enable_thinking=True)
    with pytest.raises(ValueError, match="chat format"):
        chat.encode([U], fmt="v3")


def test_no_stray_whitespace():
    text = chat.encode([SYS, U, TC, TOOL], thinking=True)
    assert not text.startswith("\n") and "  " not in text


# -----------------------------------------------------------------------------
# v32exp: the encoder equals the official Jinja template on generated conversations

PIECES = ["hi", "東京", "😀", " ", "\n", "</think>", "<think>", "<｜tool▁sep｜>", "｜", "▁", "{", "}", '"', "a b", "x"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=5).map("".join)
ARGS = st.one_of(st.dictionaries(st.sampled_from(["city", "n", "東"]), st.one_of(TEXT, st.integers(), st.booleans()),
                                 max_size=3),
                 st.dictionaries(st.sampled_from(["q"]), TEXT, max_size=1).map(lambda d: json.dumps(d, ensure_ascii=False)))
CALL = st.builds(lambda n, a: {"type": "function", "function": {"name": n, "arguments": a}},
                 st.sampled_from(["get_time", "f", "搜索"]), ARGS)
MESSAGE = st.one_of(
    st.builds(lambda c: {"role": "system", "content": c}, TEXT),
    st.builds(lambda c: {"role": "user", "content": c}, TEXT),
    st.builds(lambda c, p: {"role": "assistant", "content": c} | ({"prefix": True} if p else {}), TEXT, st.booleans()),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
              st.one_of(st.none(), TEXT), st.lists(CALL, min_size=1, max_size=3)),
    st.builds(lambda c: {"role": "tool", "content": c}, TEXT),
)


@pytest.mark.slow
@settings(max_examples=150)
@given(st.lists(MESSAGE, max_size=7), st.booleans(), st.booleans())
def test_encoder_equals_official_template(messages, gen, thinking):
    assert chat.encode(messages, add_generation_prompt=gen, thinking=thinking) == \
        jinja_render(messages, add_generation_prompt=gen, thinking=thinking)


def test_template_is_the_spec_text_byte_for_byte():
    from conftest import ROOT
    spec = ROOT.parent / "shared" / "spec" / "chat.md"
    if not spec.is_file():
        pytest.skip("shared/spec/chat.md is not beside this clone")
    text = spec.read_text(encoding="utf-8")
    start = text.index("```jinja\n", text.index("### 3.1 Exact text")) + len("```jinja\n")
    assert chat.chat_template() == text[start:text.index("\n```", start)]


# -----------------------------------------------------------------------------
# DSML encoders (spec §5.1-5.4)

WEATHER_CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": {"location": "杭州", "days": 2}}},
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"location": "北京", "days": 3}}}]


def dsml32_conversation(thinking):
    return [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in 杭州?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need tool." if thinking else None,
             "tool_calls": WEATHER_CALLS},
            {"role": "tool", "content": "Sunny"}, {"role": "tool", "content": "Rainy"}]


def test_dsml32_golden_example_of_spec_5_2():
    tools_block = chat.dsml_tools_block([WEATHER], "dsml32")
    invoke = ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" string="true">{}</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="days" string="false">{}</｜DSML｜parameter>\n</｜DSML｜invoke>')
    # the spec elides the second invoke with "…"; it is rendered from the same rules (北京, 3 days)
    block = "\n\n<｜DSML｜function_calls>\n" + invoke.format("杭州", 2) + "\n" + invoke.format("北京", 3) + "\n</｜DSML｜function_calls>"
    results = "\n\n<function_results>\n<result>Sunny</result>\n<result>Rainy</result>\n</function_results>\n\n"
    head = BOS + "You are helpful.\n\n" + tools_block + "<｜User｜>Weather in 杭州?<｜Assistant｜>"
    assert chat.encode(dsml32_conversation(True), fmt="dsml32", thinking=True, tools=[WEATHER]) == \
        head + "<think>Need tool.</think>" + block + EOS + results + "<think>"
    assert chat.encode(dsml32_conversation(False), fmt="dsml32", tools=[WEATHER]) == \
        head + "</think>" + block + EOS + results + "</think>"
    assert tools_block.startswith("## Tools\nYou have access to a set of tools you can use to answer the user's question.\n")
    assert tools_block.endswith('<functions>\n' + json.dumps(WEATHER["function"], ensure_ascii=False) + "\n</functions>\n")


def test_dsml32_rules():
    # every user turn ends with the thinking switch; add_generation_prompt has no effect
    u = [{"role": "user", "content": "a"}]
    assert chat.encode(u, fmt="dsml32") == BOS + "<｜User｜>a<｜Assistant｜></think>"
    assert chat.encode(u, fmt="dsml32", add_generation_prompt=False) == chat.encode(u, fmt="dsml32")
    # earlier reasoning is dropped; only the turn after the last user shows it
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A", "reasoning_content": "r1"},
            {"role": "user", "content": "b"}]
    assert chat.encode(conv, fmt="dsml32", thinking=True) == \
        BOS + "<｜User｜>a<｜Assistant｜></think>A" + EOS + "<｜User｜>b<｜Assistant｜><think>"
    dev = [{"role": "developer", "content": "do it"}]
    assert chat.encode(dev, fmt="dsml32") == BOS + "<｜User｜>\n\n# The user's message is: do it<｜Assistant｜></think>"
    rf = [{"role": "system", "content": "S", "response_format": {"type": "json"}}, {"role": "user", "content": "q"}]
    assert chat.encode(rf, fmt="dsml32").startswith(BOS + 'S\n\n## Response Format:\n\nYou MUST strictly adhere to the '
                                                    'following schema to reply:\n{"type": "json"}<｜User｜>')
    # parameter types: strings raw (no escaping), everything else JSON
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments":
            {"s": 'a "q"\nline', "i": 1, "x": 1.5, "b": True, "n": None, "l": [1, "東"], "d": {"k": "v"}}}}]}
    text = chat.encode([{"role": "user", "content": "q"}, call], fmt="dsml32")
    assert '<｜DSML｜parameter name="s" string="true">a "q"\nline</｜DSML｜parameter>' in text
    for k, v in (("i", "1"), ("x", "1.5"), ("b", "true"), ("n", "null"), ("l", '[1, "東"]'), ("d", '{"k": "v"}')):
        assert f'<｜DSML｜parameter name="{k}" string="false">{v}</｜DSML｜parameter>' in text
    with pytest.raises(ValueError, match="tool result without"):
        chat.encode([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}], fmt="dsml32")


def test_dsml4_rules():
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning": "Need tool.", "tool_calls": WEATHER_CALLS},
            {"role": "tool", "content": "Sunny"}, {"role": "tool", "content": "Rainy"}]
    text = chat.encode(conv, fmt="dsml4", thinking=True, tools=[WEATHER])
    invoke = ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" string="true">{}</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="days" string="false">{}</｜DSML｜parameter>\n</｜DSML｜invoke>')
    assert text == (BOS + "S\n\n" + chat.dsml_tools_block([WEATHER], "dsml4") + "<｜User｜>Weather?<｜Assistant｜><think>"
                    + "Need tool.</think>\n\n<｜DSML｜tool_calls>\n" + invoke.format("杭州", 2) + "\n"
                    + invoke.format("北京", 3) + "\n</｜DSML｜tool_calls>" + EOS
                    + "<｜User｜><tool_result>Sunny</tool_result>\n\n<tool_result>Rainy</tool_result><｜Assistant｜><think>")
    # without tools, reasoning before the last user is dropped and only the last user opens <think>
    plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A", "reasoning": "r"},
             {"role": "user", "content": "b"}]
    assert chat.encode(plain, fmt="dsml4", thinking=True) == \
        BOS + "<｜User｜>a<｜Assistant｜></think>A" + EOS + "<｜User｜>b<｜Assistant｜><think>"
    assert chat.encode(plain, fmt="dsml4", thinking=True, drop_thinking=False) == \
        BOS + "<｜User｜>a<｜Assistant｜><think>r</think>A" + EOS + "<｜User｜>b<｜Assistant｜><think>"
    assert chat.encode(plain, fmt="dsml4", thinking=True, reasoning_effort="max").startswith(BOS + chat.DSML4_EFFORT_MAX)
    assert chat.dsml_tools_block([WEATHER], "dsml4").startswith(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
        'writing a "<｜DSML｜tool_calls>" block like the following:\n\n')
    assert "### Available Tool Schemas\n\n" in chat.dsml_tools_block([WEATHER], "dsml4")


def test_default_format_from_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    assert chat.default_format(tmp_path) == "dsml32"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert chat.default_format(tmp_path) == "dsml4"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{x}}"}))
    assert chat.default_format(tmp_path) == "v32exp"
    for text, what in (("[]", "expected a JSON object, got list"), ("{oops", "not valid JSON"),
                       ("[" * 100000, "JSON nested too deeply")):
        (tmp_path / "tokenizer_config.json").write_text(text)
        with pytest.raises(ValueError, match=f"tokenizer_config.json: {what}"):
            chat.default_format(tmp_path)


# -----------------------------------------------------------------------------
# The real tokenizer (spec §1)

@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_str(checkpoint.tokenizer_files()["tokenizer.json"])


def test_real_tokenizer_ids(tok):
    text = ("<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek.<｜end▁of▁sentence｜>"
            "<｜User｜>1+1=?<｜Assistant｜><think>")
    assert tok.encode(text, add_special_tokens=False).ids == [
        0, 128803, 33310, 128804, 128799, 19923, 3, 342, 1030, 22651, 4374, 1465, 16, 1, 128803, 19, 13, 19,
        127252, 128804, 128798]
    call = (CALLS_BEGIN + CALL_BEGIN + "get_time" + TOOL_SEP + '{"city": "Tokyo"}' + CALL_END + CALLS_END)
    assert tok.encode(call, add_special_tokens=False).ids == [128806, 128808, 1133, 20035, 128814, 24313, 37399, 3362,
                                                              582, 106239, 62773, 128809, 128807]
    markers = ["<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", USER, ASSISTANT, "<|EOT|>",
               CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
               chat.OUTPUT_BEGIN, chat.OUTPUT_END, TOOL_SEP]
    for i, m in enumerate(markers):
        assert tok.encode(m, add_special_tokens=False).ids == [128798 + i], m
    assert tok.get_vocab_size() == 128815
    assert json.loads(checkpoint.tokenizer_files()["tokenizer_config.json"])["chat_template"] == chat.chat_template()


# -----------------------------------------------------------------------------
# Parsers: whole text

def v31(*calls, content=""):
    return content + CALLS_BEGIN + "".join(CALL_BEGIN + n + TOOL_SEP + a + CALL_END for n, a in calls) + CALLS_END


def test_offsets_of_the_worked_example_of_spec_2():
    r = chat.parse(v31(("get_time", '{"city": "Tokyo"}')))
    got = [(s["kind"], s["chars"], s["bytes"]) for s in r["spans"]]
    assert got == [("calls_begin", (0, 20), (0, 28)), ("call_begin", (20, 39), (28, 55)), ("name", (39, 47), (55, 63)),
                   ("tool_sep", (47, 59), (63, 81)), ("arguments", (59, 76), (81, 98)),
                   ("call_end", (76, 93), (98, 123)), ("calls_end", (93, 111), (123, 149))]


def test_v31_calls_content_and_finish():
    r = chat.parse(v31(("get_time", '{"city": "Tokyo"}')))
    assert r["tool_calls"] == [{"name": "get_time", "arguments": '{"city": "Tokyo"}'}]
    assert r["content"] is None and r["reasoning"] is None and r["finish_reason"] == "tool_calls"
    r = chat.parse(v31(("a", "{}"), ("b", '{"x": 1}'), ("c", '{"y": [1, {"z": null}]}'), content="Let me check."))
    assert [c["name"] for c in r["tool_calls"]] == ["a", "b", "c"] and r["content"] == "Let me check."
    assert chat.parse("Just text.")["finish_reason"] == "stop"


@pytest.mark.parametrize("args", ['{"a": {"b": [1, 2.5e3, -0]}}', '{"t": true, "f": false, "n": null}',
                                  '{"q": "say \\"hi\\""}', '{"nl": "a\\nb"}', '{\n  "pretty": 1\n}',
                                  '{"emoji": "😀", "cjk": "東京"}', '{"s": "<b> 5 > 4 \\"}"}'])
def test_v31_argument_shapes(args):
    r = chat.parse(v31(("f", args)))
    assert r["tool_calls"] == [{"name": "f", "arguments": args}] and r["errors"] == []


def test_reasoning_split_follows_the_prompt_tail():
    thinking_prompt = chat.encode([U], thinking=True)
    r = chat.parse("weigh it</think>It is 10." + v31(("get_time", "{}")), prompt=thinking_prompt)
    assert r["reasoning"] == "weigh it" and r["content"] == "It is 10." and len(r["tool_calls"]) == 1
    assert chat.parse("no end of thinking", prompt=thinking_prompt) == chat.parse("no end of thinking", prompt=thinking_prompt) \
        and chat.parse("no end of thinking", prompt=thinking_prompt)["content"] is None
    # after a tool result nothing is appended, so even with thinking on the output is content (spec §7)
    after_tool = chat.encode([U, TC, TOOL], thinking=True)
    assert chat.parse("It is 10:00.", prompt=after_tool) ["content"] == "It is 10:00."
    # calls written before </think> stay reasoning (the official V3.2 parser rejects them)
    r = chat.parse(v31(("f", "{}")) + "</think>ok", prompt=thinking_prompt)
    assert r["tool_calls"] == [] and r["content"] == "ok"


def test_malformed_v31_outcomes():
    def reasons(text, **kw):
        r = chat.parse(text, **kw)
        return [e["reason"] for e in r["errors"]], r

    e, r = reasons(v31(("f", '{"a": 1,}')))                     # invalid JSON: an error, not a call
    assert e == ["invalid_arguments"] and r["tool_calls"] == [] and r["finish_reason"] == "stop"
    assert r["errors"][0]["text"] == CALL_BEGIN + 'f' + TOOL_SEP + '{"a": 1,}' + CALL_END    # the whole call, raw
    e, r = reasons(CALLS_BEGIN + CALL_BEGIN + "f" + TOOL_SEP + '{"a": 1')   # truncated mid-args
    assert e == ["unterminated_call"] and r["errors"][0]["text"].endswith('{"a": 1')
    e, r = reasons(CALLS_BEGIN + CALL_BEGIN + "get_ti")                      # truncated mid-name
    assert e == ["unterminated_call"] and r["tool_calls"] == []
    e, r = reasons(CALLS_BEGIN + CALL_BEGIN + "f" + TOOL_SEP + "{}" + CALL_END)   # no calls-end: harmless
    assert e == [] and len(r["tool_calls"]) == 1
    e, r = reasons("x" + CALL_BEGIN + "f" + TOOL_SEP + "{}" + CALL_END + CALLS_END)   # no calls-begin: lenient
    assert e == [] and r["tool_calls"][0]["name"] == "f" and r["content"] == "x"
    e, r = reasons(v31(("", "{}")))                                          # empty name
    assert e == ["empty_name"] and r["tool_calls"] == []
    e, r = reasons(v31(("delete_all", "{}")), tools=[WEATHER])               # unknown tool: reported, flagged
    assert r["tool_calls"] == [{"name": "delete_all", "arguments": "{}", "unknown_tool": True}]
    assert r["finish_reason"] == "tool_calls"
    e, r = reasons(v31(("f", "{}")) + "trailing words")                      # text after the calls: kept
    assert e == ["text_after_calls"] and r["content"] == "trailing words"
    e, r = reasons(v31(("f", "[1, 2]")))                                     # arguments must be an object
    assert e == ["invalid_arguments"]
    ascii_lookalike = "<|tool▁calls▁begin|><|tool▁call▁begin|>f<|tool▁sep|>{}<|tool▁call▁end|><|tool▁calls▁end|>"
    e, r = reasons(ascii_lookalike)                                          # not markers: plain content
    assert r["tool_calls"] == [] and r["content"] == ascii_lookalike and e == []


def dsml(*invokes, block="function_calls", lead="\n\n"):
    return f"{lead}<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def invoke(name, *params):
    body = "".join(f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>\n' for k, s, v in params)
    return f'<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>'


def test_dsml_calls_and_round_trip():
    text = "Checking." + dsml(invoke("get_weather", ("location", "true", "杭州"), ("days", "false", "2")))
    r = chat.parse(text, fmt="dsml32")
    assert r["content"] == "Checking." and r["finish_reason"] == "tool_calls"
    assert r["tool_calls"] == [{"name": "get_weather", "arguments": '{"location": "杭州", "days": 2}'}]
    r4 = chat.parse(text.replace("function_calls", "tool_calls"), fmt="dsml4")
    assert r4["tool_calls"] == r["tool_calls"]
    assert chat.parse(text, fmt="dsml4")["tool_calls"] == []               # V4 does not read V3.2's block name
    assert chat.parse(dsml('<｜DSML｜invoke name="now"/>', block="tool_calls"), fmt="dsml4")["tool_calls"] == \
        [{"name": "now", "arguments": "{}"}]                                # self-closing: zero arguments


@pytest.mark.parametrize("fmt", ["v32exp", "dsml32", "dsml4"])
@given(st.lists(st.tuples(st.sampled_from(["get_time", "f", "搜索"]), ARGS), min_size=1, max_size=3), TEXT)
def test_encode_then_parse_gives_back_the_calls(fmt, calls, content):
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    content = content.replace("</think>", "").replace("<think>", "")
    prompt = chat.encode([U], fmt=fmt)
    full = chat.encode([U, {"role": "assistant", "content": content, "tool_calls": tool_calls}], fmt=fmt,
                       add_generation_prompt=False)
    assert full.startswith(prompt)
    completion = full[len(prompt):]                        # what the model would have written
    r = chat.parse(completion.removesuffix(EOS), fmt=fmt, prompt=prompt)
    want = [json.loads(a) if isinstance(a, str) else a for _, a in calls]
    assert [json.loads(c["arguments"]) for c in r["tool_calls"]] == want
    assert [c["name"] for c in r["tool_calls"]] == [n for n, _ in calls]
    assert (r["content"] or "") == content and r["errors"] == []


def test_malformed_dsml_outcomes():
    def reasons(text, fmt="dsml32"):
        r = chat.parse(text, fmt=fmt)
        return [e["reason"] for e in r["errors"]], r

    assert reasons(dsml(invoke("f", ("k", "maybe", "1"))))[0] == ["malformed_parameter"]
    missing_attr = f'<{DSML}invoke name="f">\n<{DSML}parameter name="k">1</{DSML}parameter>\n</{DSML}invoke>'
    assert reasons(dsml(missing_attr))[0] == ["malformed_parameter"]
    assert reasons(dsml(invoke("f", ("k", "true", "1"), ("k", "true", "2"))))[0] == ["duplicate_parameter"]
    assert reasons(dsml(invoke("f", ("k", "false", "abc"))))[0] == ["invalid_arguments"]
    e, r = reasons(invoke("f", ("k", "true", "v")))                   # bare invoke, no block: content
    assert e == [] and r["tool_calls"] == [] and r["content"].startswith(f"<{DSML}invoke")
    e, r = reasons(f"\n\n<{DSML}function_calls>\n" + invoke("f", ("k", "true", "v")))   # unterminated block
    assert e == [] and len(r["tool_calls"]) == 1
    e, r = reasons(f"\n\n<{DSML}function_calls>\n<{DSML}invoke name=\"f\">\n<{DSML}parameter name=\"k\" string=\"true\">v")
    assert e == ["unterminated_call"] and r["tool_calls"] == []
    e, r = reasons(dsml(invoke("f"), block="toolcalls"))             # a typo of the block name: content
    assert r["tool_calls"] == [] and "toolcalls" in r["content"]
    e, r = reasons(dsml(f'<{DSML}invoke name="f">\n{{"k": 1}}\n</{DSML}invoke>'))     # JSON inside invoke: refused
    assert e == ["malformed_invoke"] and r["tool_calls"] == []
    e, r = reasons(dsml(invoke("f", ("k", "true", f"a</{DSML}parameter>b"))))          # the close tag inside a value
    assert e == ["malformed_invoke"]
    e, r = reasons(dsml(invoke("f", ('a"b', "true", "v"))))                           # a quote in a parameter name
    assert e == [] and json.loads(r["tool_calls"][0]["arguments"]) == {'a"b': "v"}
    e, r = reasons(dsml(invoke("f")) + "after")
    assert e == ["text_after_calls"] and r["content"] == "after"
    e, r = reasons("a |DSML|function_calls b")                       # ASCII look-alike: content
    assert r["content"] == "a |DSML|function_calls b" and e == []


# -----------------------------------------------------------------------------
# Streaming equals whole-text parsing, whatever the chunking

def coalesce(events):  # merge consecutive text pieces; ids are random, so left out
    out = []
    for e in events:
        e = {k: v for k, v in e.items() if k != "id"}
        if out and e["type"] in ("reasoning", "content") and out[-1]["type"] == e["type"]:
            out[-1]["text"] += e["text"]
        elif out and e["type"] == "tool_call_arguments" and out[-1]["type"] == e["type"] and out[-1]["index"] == e["index"]:
            out[-1]["text"] += e["text"]
        else:
            out.append(e)
    return out


def stream(chunks, fmt, prompt, tools=None):
    p = chat.StreamParser(fmt, prompt, tools)
    events = [e for c in chunks for e in p.feed(c)] + p.finish()
    return coalesce(events), p.spans, p.calls, p.errors, events


THINK_PROMPT = chat.encode([U], thinking=True)
STREAM_CASES = [
    ("v32exp", "", v31(("get_time", '{"city": "東京 😀"}'), ("f", '{"a": [1, {"b": true}], "n": 12}'), content="Sure.")),
    ("v32exp", THINK_PROMPT, "hmm▁｜</think>ok " + v31(("f", '{\n "x": "}\\"<"\n}'))),
    ("v32exp", "", "5 < 6 and <｜ is not a marker, nor <｜tool▁call"),
    ("v32exp", "", "x" + CALLS_BEGIN + "junk" + CALL_BEGIN + "f" + TOOL_SEP + "{bad}" + CALL_END + CALLS_END + "tail"),
    ("v32exp", "", CALLS_BEGIN + CALL_BEGIN + "f" + TOOL_SEP + '{"a": 1'),
    ("dsml32", "<think>", "plan</think>Let me look." + dsml(invoke("get_weather", ("location", "true", "杭州 5 < 6"),
                                                                   ("days", "false", "2")), '<｜DSML｜invoke name="z"/>')),
    ("dsml32", "", "a <｜DSML not a tag, \n\n then" + dsml(invoke("f", ("k", "maybe", "1")), invoke("g", ("k", "false", "x")))),
    ("dsml4", "", "Done.\n\n" + dsml(invoke("get_weather", ("location", "true", "😀東京")), block="tool_calls")),
    ("dsml4", "", "\n\n<｜DSML｜tool_calls>\n" + '<｜DSML｜invoke name="c">\n<｜DSML｜parameter name="k" string="true">v'),
]


@pytest.mark.parametrize("fmt, prompt, text", STREAM_CASES)
def test_streaming_equals_whole_at_every_cut(fmt, prompt, text):
    whole = stream([text], fmt, prompt)[:4]
    for i in range(len(text) + 1):                                    # one cut at every character
        assert stream([text[:i], text[i:]], fmt, prompt)[:4] == whole, i
    assert stream(list(text), fmt, prompt)[:4] == whole               # one character per chunk
    data = text.encode("utf-8")                                       # one UTF-8 byte per chunk (cuts inside ｜ ▁ 東 😀)
    assert stream([data[i:i + 1] for i in range(len(data))], fmt, prompt)[:4] == whole
    rng = random.Random(len(text))
    for _ in range(20):                                               # random multi-piece chunks
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert stream(pieces, fmt, prompt)[:4] == whole


@pytest.mark.parametrize("fmt, prompt, text", STREAM_CASES[:3] + STREAM_CASES[5:6])
def test_streaming_at_every_pair_of_cuts(fmt, prompt, text):
    whole = stream([text], fmt, prompt)[:4]
    step = max(1, len(text) // 40)
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert stream([text[:i], text[i:j], text[j:]], fmt, prompt)[:4] == whole, (i, j)


@pytest.mark.parametrize("fmt, prompt, text", STREAM_CASES)
def test_streaming_per_token_with_the_real_tokenizer(tok, fmt, prompt, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    whole = stream([text], fmt, prompt)[:4]
    for k in (1, 2, 3, 5, 8, len(ids)):                              # k tokens per delta (MTP, stream_interval)
        d = chat.Detokenizer(tok)
        chunks = []
        for i in range(0, len(ids), k):
            chunks.append("".join(d.feed(t) for t in ids[i:i + k]))
        chunks.append(d.flush())
        assert "".join(chunks) == text
        assert stream(chunks, fmt, prompt)[:4] == whole, k


# After a prompt that opens <think>: reasoning until the first </think>, then content, neither holding a
# marker, whole and streamed; the expected strings written here by hand
THINK_SPLITS = [  # (completion, reasoning, content)
    ("Let me weigh it.\n</think>\n\nIt is 10." + EOS, "Let me weigh it.\n", "\n\nIt is 10."),
    ("a</think>b", "a", "b"),
    ("</think>only the answer", None, "only the answer"),
    ("東京 😀</think>😀 東京", "東京 😀", "😀 東京"),
    ("still weighing </thi", "still weighing </thi", None),          # no end: all reasoning, the held tail too
]
CALL_AFTER = {"v32exp": v31(("f", "{}")), "dsml32": dsml(invoke("f", ("k", "true", "v"))),
              "dsml4": dsml(invoke("f", ("k", "true", "v")), block="tool_calls")}


@pytest.mark.parametrize("fmt", chat.FORMATS)
@pytest.mark.parametrize("text, reasoning, content", THINK_SPLITS + [("plan</think>Let me look.", "plan", "Let me look.")])
def test_reasoning_and_content_split_without_the_markers(fmt, text, reasoning, content):
    prompt = chat.encode([U], fmt=fmt, thinking=True)
    assert prompt.endswith("<think>")
    if text.startswith("plan"):                                       # a call after the content
        text += CALL_AFTER[fmt]
    r = chat.parse(text, fmt=fmt, prompt=prompt)
    assert (r["reasoning"], r["content"]) == (reasoning, content)
    assert r["errors"] == [] and len(r["tool_calls"]) == text.startswith("plan")
    data = text.encode("utf-8")
    chunkings = [[text], list(text), [data[i:i + 1] for i in range(len(data))]]
    chunkings += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for chunks in chunkings:                                          # streamed: the same split
        events = stream(chunks, fmt, prompt)[4]
        got = tuple("".join(e["text"] for e in events if e["type"] == k) or None for k in ("reasoning", "content"))
        assert got == (reasoning, content), chunks


def test_reasoning_split_needs_the_prompt_to_open_thinking():
    # a prompt that closes thinking (</think>): everything is content, as written
    for fmt in chat.FORMATS:
        prompt = chat.encode([U], fmt=fmt, thinking=False)
        assert prompt.endswith("</think>")
        r = chat.parse("It is 10." + EOS, fmt=fmt, prompt=prompt)
        assert (r["reasoning"], r["content"]) == (None, "It is 10.")


def test_stream_events_are_well_formed():
    text = v31(("a", '{"x": 1}'), ("b", '{"y": [2]}'))
    _, _, calls, _, events = stream(list(text), "v32exp", "")
    starts = [e for e in events if e["type"] == "tool_call"]
    assert [e["index"] for e in starts] == [0, 1] and len({e["id"] for e in starts}) == 2
    for i in (0, 1):
        args = "".join(e["text"] for e in events if e["type"] == "tool_call_arguments" and e["index"] == i)
        assert json.loads(args) == json.loads(calls[i]["arguments"])
    assert events[-1] == {"type": "finish", "finish_reason": "tool_calls"}
    assert not any(e["type"] == "content" for e in events)            # no spurious content


@pytest.mark.parametrize("tail", ['{"n": 12}', '{"l": [1, 2]}', '{"o": {"p": {}}}', '{"t": true}', '{"s": "x"}'])
def test_last_argument_piece_and_end_marker_in_one_delta(tail):
    # regressions of vLLM #48342 / PR #38866: the tail must not be cut when it arrives with the marker
    head = CALLS_BEGIN + CALL_BEGIN + "f" + TOOL_SEP + tail[:3]
    r = stream([head, tail[3:] + CALL_END + CALLS_END], "v32exp", "")
    assert r[2] == [{"name": "f", "arguments": tail}]


def test_engine_regressions():
    # vLLM deepseek_v31 has no DOTALL: pretty-printed arguments were missed
    assert chat.parse(v31(("f", '{\n  "a": 1\n}')))["tool_calls"][0]["arguments"] == '{\n  "a": 1\n}'
    # SGLang's greedy regex merged two complete calls arriving in one buffer
    r = stream([v31(("f", '{"a": 1}'), ("g", '{"b": 2}'))], "v32exp", "")
    assert [c["name"] for c in r[2]] == ["f", "g"]
    # vLLM returned finish_reason tool_calls with no calls; SGLang turned bad JSON into whole-text content
    r = chat.parse("Hello " + v31(("f", "{oops")))
    assert r["finish_reason"] == "stop" and r["content"] == "Hello " and r["errors"][0]["reason"] == "invalid_arguments"
    # content and the marker in one chunk: the content exactly once
    r = stream(["Sure." + CALLS_BEGIN, CALL_BEGIN + "f" + TOOL_SEP + "{}" + CALL_END + CALLS_END], "v32exp", "")
    assert [e for e in r[0] if e["type"] == "content"] == [{"type": "content", "text": "Sure."}]
    # empty deltas after the calls add nothing
    p = chat.StreamParser("v32exp")
    p.feed(v31(("f", "{}")))
    assert p.feed("") == [] and p.feed(b"") == []


def test_spans_cover_the_text_in_chars_and_bytes():
    for fmt, prompt, text in STREAM_CASES:
        spans = chat.parse(text, fmt=fmt, prompt=prompt)["spans"]
        assert spans[0]["chars"][0] == 0 and spans[-1]["chars"][1] == len(text)
        data = text.encode("utf-8")
        assert spans[-1]["bytes"][1] == len(data)
        for a, b in zip(spans, spans[1:]):
            assert a["chars"][1] == b["chars"][0] and a["bytes"][1] == b["bytes"][0]
        for s in spans:                                             # byte slices decode to the char slices
            assert data[slice(*s["bytes"])].decode("utf-8") == text[slice(*s["chars"])]


def test_markers_spelled_as_ordinary_pieces_are_markers(tok):
    # spec §10.24: markers are recognised by their text, whatever ids spelled them (streaming = whole)
    text = v31(("f", '{"a": 1}'))
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    ids = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
    assert 128806 not in ids                                        # no single marker token
    d = chat.Detokenizer(tok)
    chunks = [d.feed(i) for i in ids] + [d.flush()]
    assert "".join(chunks) == text
    assert stream(chunks, "v32exp", "")[2] == [{"name": "f", "arguments": '{"a": 1}'}]


# -----------------------------------------------------------------------------
# Linear work whatever the chunking; text that is not text, or nests too deep, raises nothing

def long_texts(n):  # name -> (fmt, prompt, text of about n chars): each state of the machines held long
    inv = f'<{DSML}invoke name="f">\n<{DSML}parameter name="k" string="true">'
    return {
        "content": ("v32exp", "", ("The quick fox, 東京 😀 <｜ " * n)[:n]),
        "reasoning": ("dsml32", THINK_PROMPT, ("weigh <think> it\n\n" * n)[:n]),
        "eos": ("v32exp", "", ("ab" + EOS) * (n // 24)),
        "calls": ("v32exp", "", CALLS_BEGIN + (CALL_BEGIN + "f" + TOOL_SEP + '{"a": 1}' + CALL_END) * (n // 48)),
        "dsml_calls": ("dsml4", "", dsml(*[invoke("f", ("k", "true", "v"))] * (n // 100), block="tool_calls")),
        "arguments": ("v32exp", "", CALLS_BEGIN + CALL_BEGIN + "f" + TOOL_SEP + '{"a": "' + "x" * n),
        "blank_gap": ("v32exp", "", CALLS_BEGIN + " " * n + CALLS_END),
        "text_gap": ("dsml32", "", dsml("j " * (n // 2))),
        "after": ("v32exp", "", v31(("f", "{}")) + "a" * n),
        "name": ("v32exp", "", CALLS_BEGIN + CALL_BEGIN + "n" * n),
        "invoke_head": ("dsml4", "", f"\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"" + "n" * n),
        "invoke_body": ("dsml32", "", f"\n\n<{DSML}function_calls>\n<{DSML}invoke name=\"f\">" + " " * n),
        "param_value": ("dsml4", "", f"\n\n<{DSML}tool_calls>\n" + inv + "v" * n),
    }


def parse_work(monkeypatch, fmt, prompt, text, size):
    """Characters the parser copies or searches when fed `size` at a time: the buffer rebuilt per
    feed, and each scan up to its marker (or the buffer's end)."""
    work, scan = [0], chat.StreamParser._scan

    def counted(self, markers, final):
        i, mk = scan(self, markers, final)
        work[0] += i + len(mk) if mk else len(self.buf) - self.pos
        return i, mk
    monkeypatch.setattr(chat.StreamParser, "_scan", counted)
    p = chat.StreamParser(fmt, prompt)
    for k in range(0, len(text), size):
        chunk = text[k:k + size]
        work[0] += len(p.buf) - p.pos + len(chunk)
        p.feed(chunk)
    p.finish()
    return work[0]


@pytest.mark.parametrize("name", list(long_texts(0)))
def test_parsing_work_is_linear(monkeypatch, name):
    # 10x the text: 10x the work, in 16-char chunks and in one piece (the old parser re-copied the
    # whole history per chunk and re-searched the rest of a whole text per marker: 1 MB took 2 s)
    for size in (16, 10 ** 7):
        small, large = (parse_work(monkeypatch, *long_texts(n)[name], size) for n in (10_000, 100_000))
        assert small < 10 * 10_000 and large < 10.5 * small, (size, small, large)


@pytest.mark.parametrize("name", ["content", "reasoning", "eos", "calls", "dsml_calls"])
def test_only_a_short_tail_is_kept_between_chunks(name):
    def kept(x):  # chars of text held, through lists and dicts
        if isinstance(x, str):
            return len(x)
        return sum(map(kept, x.values() if isinstance(x, dict) else x)) if isinstance(x, (list, dict)) else 0
    fmt, prompt, text = long_texts(20_000)[name]
    p = chat.StreamParser(fmt, prompt)
    for k in range(0, len(text), 16):
        p.feed(text[k:k + 16])
        state = {a: v for a, v in vars(p).items() if a not in ("events", "spans", "calls", "errors")}
        assert kept(state) < 500, (k, {a: kept(v) for a, v in state.items()})   # one small call at most


def test_lone_surrogates_read_as_replacement_characters():
    # a str with a lone surrogate is not text (no UTF-8): read as U+FFFD, one char and 3 bytes, never raised
    r = chat.parse("a\ud800b" + v31(("f", '{"k": "\udfff"}')))
    assert r["content"] == "a\ufffdb" and r["tool_calls"] == [{"name": "f", "arguments": '{"k": "\ufffd"}'}]
    assert r["spans"][0] == {"kind": "content", "chars": (0, 3), "bytes": (0, 5)}
    text = "x\ud83d\ude00y" + dsml(invoke("g\udc00", ("k", "true", "\ud800")))
    whole = stream([text], "dsml32", "")[:4]
    assert stream(list(text), "dsml32", "")[:4] == whole                         # a pair split or not: the same
    assert whole[2] == [{"name": "g\ufffd", "arguments": '{"k": "\ufffd"}'}]
    assert stream([text.encode("utf-8", "surrogatepass")], "dsml32", "")[0][0]["text"] == "x" + "\ufffd" * 6 + "y"
    for fmt in chat.FORMATS:                                                    # the encoder's prompt is UTF-8 text
        prompt = chat.encode([{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "\udfff",
                              "tool_calls": [{"function": {"name": "f", "arguments": {"k": "\udbff"}}}]}], fmt=fmt)
        assert "\ufffd" in prompt and prompt.encode("utf-8")


def test_deeply_nested_arguments_are_invalid_not_a_crash():
    r = chat.parse(v31(("f", "[" * 100_000)))                                   # json.loads: RecursionError
    assert r["tool_calls"] == [] and [e["reason"] for e in r["errors"]] == ["invalid_arguments"]


@given(st.lists(st.one_of(st.integers(0, 129279), st.sampled_from([1, 128798, 128799, 128803, 128806])), max_size=40))
def test_detokenizer_streams_what_one_decode_gives(tok, ids):
    # any ids (split characters, special tokens skipped or not): the pieces add up to one decode
    for skip in (True, False):
        d = chat.Detokenizer(tok, skip_special_tokens=skip)
        assert "".join([d.feed(i) for i in ids] + [d.flush()]) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_work_is_linear(tok):
    # each feed decodes the tokens since the last text shown and the window before them, not the history
    ids = tok.encode("Sparse attention, 稀疏注意力, 😀 — " * 300, add_special_tokens=False).ids
    decoded = []

    class Counting:
        def decode(self, part, skip_special_tokens):
            decoded.append(len(part))
            return tok.decode(part, skip_special_tokens=skip_special_tokens)

    d = chat.Detokenizer(Counting())
    text = "".join([d.feed(i) for i in ids] + [d.flush()])
    assert text == tok.decode(ids) and len(ids) > 2000
    assert sum(decoded) <= 12 * len(ids), sum(decoded) / len(ids)
