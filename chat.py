"""Chat formats of the DeepSeek models: prompt encoders and completion parsers (spec/chat.md).

Three formats, picked explicitly:
- "v32exp": DeepSeek-V3.1 / V3.1-Terminus / V3.2-Exp. The prompt is what the official Jinja template
  (chat_template.jinja, data byte for byte) renders; tool calls are single added tokens:
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
- "dsml32": DeepSeek-V3.2 (official encoding_dsv32.py rules): DSML markup <｜DSML｜function_calls>.
- "dsml4": DeepSeek-V4 (encoding_dsv4.py rules): DSML <｜DSML｜tool_calls>, tool results merged into
  user turns.

Public API:
    encode(messages, fmt, thinking, tools, add_generation_prompt) -> prompt text
    parse(completion, fmt, prompt, tools) -> {"reasoning", "content", "tool_calls", "finish_reason",
                                              "errors", "spans"}
    StreamParser(fmt, prompt, tools): feed(str | bytes) -> [event], finish() -> [event]
    Detokenizer(tokenizer): feed(token_id) -> text (holds back incomplete UTF-8)

Parsing is one text-level state machine per format; parse() is the stream fed in one piece, and the
tests check that every chunking (per character, per UTF-8 byte, per token) gives the same result.

Encoding rules worth knowing:
- **Tools** are not rendered by the V3.2-Exp template. With `tools=`, `v32exp` appends the block the
  serving engines use (vLLM's and SGLang's tool templates, Ollama's renderer) to the system prompt:
  `system + "\\n\\n## Tools\\nYou have access to the following tools:\\n" + …` (spec/chat.md §3.5), also
  when there is no system message; a tool whose `description` is None gets no `Description:` line.
  In the DSML formats the tools ride on the first system message (one is inserted if needed).
- `thinking` is the template's switch. **`enable_thinking` is accepted as an alias** (both given and
  different is an error), so a client that sends it gets a prompt and a parser that agree.
- Tool-call `arguments` may be a JSON string or a dict: the same bytes either way (key order kept,
  non-ASCII unescaped, never encoded twice). `tool_calls: []` is treated as absent.
- DSML: `add_generation_prompt` has no effect (every user turn ends with the assistant prefix).

Parsing rules: the reasoning split follows how the **prompt** ends (`<think>` → reasoning until
`</think>`), never a request flag, so after a V3.1 tool result (nothing appended) the answer is
content. The stream parser is a text-level state machine behind an incremental detokenizer: it holds
back an incomplete UTF-8 sequence and any suffix that could still become a marker, so streaming gives
exactly what whole-text parsing gives (tested at every character, every UTF-8 byte, every token and
random chunks). Events: `reasoning`, `content` (text pieces), `tool_call` (index, id, name, once the
name is complete), `tool_call_arguments` (argument text pieces), `tool_call_done` (the complete, valid
arguments), `error`, and `finish`. Malformed output never raises and never loses text:

| case | outcome |
|---|---|
| arguments that are not a JSON object (`v32exp`), a `string="false"` value that is not JSON (DSML) | not a call; `errors` gets `invalid_arguments` with the call's raw text |
| output ends inside a call (mid-name, mid-arguments, mid-tag) | not a call; `unterminated_call` with the raw text |
| the closing `<｜tool▁calls▁end｜>` / `</｜DSML｜…>` missing after complete calls | the calls stand; no error |
| `<｜tool▁call▁begin｜>` without `<｜tool▁calls▁begin｜>` | accepted as a call |
| empty name | `empty_name` |
| a name not in the given tool list | reported, with `"unknown_tool": true` |
| text after the calls' closing marker | kept as content, and noted as `text_after_calls` |
| non-whitespace text between calls | kept as content, noted as `unexpected_text` |
| calls written inside the reasoning (before `</think>`) | stay reasoning (the official V3.2 parser rejects them) |
| DSML: bad `string` attribute or parameter tag, duplicate parameter, text or JSON inside an invoke, `</｜DSML｜parameter>` inside a value | not a call; `malformed_parameter`, `duplicate_parameter` or `malformed_invoke` |
| DSML `invoke` without its block, a misspelled block (`toolcalls`), ASCII look-alikes of markers (`<\\|tool▁sep\\|>`, `\\|DSML\\|`) | plain content |
| self-closing `<｜DSML｜invoke name="x"/>` | a call with `{}` |

`finish_reason` is `tool_calls` only when at least one call with valid JSON arguments was parsed.
Tool-call ids (`call_` + 24 hex digits) appear only in each call's first event.

A session with the bundled tiny checkpoint (random weights, so the words are noise; the format is
not). Thinking mode shows the reasoning apart; with `--tools`, a tool call is printed as JSON and its
result asked for, and it goes back to the model as a tool message:

    $ .venv/bin/python generate.py --ckpt tiny-v32 --interactive --thinking --max-new-tokens 12 --temperature 0
    >>> What is 2+2?
    [reasoning]  estas institution assemblages zones� best grieાર tum tolerant →
    .Mathematics
    prefill: 11 tokens in 0.26 s (42.7 tok/s); decode: 11 tokens in 0.39 s (28.1 tok/s); 11 new tokens
    >>> /exit

    $ .venv/bin/python generate.py --ckpt DIR --interactive --tools tools.json     # a trained checkpoint
    >>> What time is it in Tokyo?
    [tool call] {"name": "get_time", "arguments": {"city": "Tokyo"}}
    result of get_time> 10:00
    It is 10:00 in Tokyo.

(The second session's flow is exercised in `tests/test_generate.py` with a scripted stand-in model,
since the tiny model never writes a well-formed call.) Each model turn reuses the KV cache: only the
tokens the caches do not already hold are prefilled.
"""
import codecs
import functools
import json
import re
import uuid
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
DSML = "｜DSML｜"
FORMATS = ("v32exp", "dsml32", "dsml4")

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def chat_template():  # the official V3.2-Exp Jinja template text (tokenizer_config.json's chat_template)
    return TEMPLATE_PATH.read_text(encoding="utf-8")


# -----------------------------------------------------------------------------
# Format strings (data, byte for byte from spec/chat.md §3.5, §5.1 and the V4 encoder)

V31_TOOLS_HEAD = "## Tools\nYou have access to the following tools:\n"
V31_TOOLS_TAIL = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
    "{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n")

DSML32_TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml}function_calls>
...
</{dsml}function_calls>
<function_results>
...
</function_results>
{think}...thinking about results{end_think}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

DSML4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
DSML4_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


def to_json(x):  # what HF's tojson and the DSML encoders write: key order kept, Unicode unescaped
    return json.dumps(x, ensure_ascii=False)


# -----------------------------------------------------------------------------
# Messages in, normalised: OpenAI-style dicts; tool_calls [] counts as absent (the template would lose
# the content and print an orphan end marker, spec §3.6); arguments become JSON text exactly once

def _calls(msg):  # -> [(name, arguments JSON text, id)] or None
    calls = msg.get("tool_calls")
    if not calls:
        return None
    out = []
    for c in calls:
        f = c.get("function", c)                         # OpenAI {"function": {...}} or flat {"name", ...}
        args = f.get("arguments", {})
        out.append((f["name"], args if isinstance(args, str) else to_json(args), c.get("id")))
    return out


def _tool_functions(tools):  # OpenAI tool list -> the function dicts
    return [t.get("function", t) for t in tools or []]


def v31_tools_block(tools):  # spec §3.5: the block the serving engines put after the system prompt
    text = V31_TOOLS_HEAD
    for f in _tool_functions(tools):
        desc = "" if f.get("description") is None else "\nDescription: " + f["description"]   # None: no line
        text += "\n### " + f["name"] + desc + "\n\nParameters: " + to_json(f.get("parameters", {})) + "\n"
    return text + V31_TOOLS_TAIL


def dsml_tools_block(tools, fmt):
    schemas = "\n".join(to_json(f) for f in _tool_functions(tools))
    template = DSML32_TOOLS if fmt == "dsml32" else DSML4_TOOLS
    return template.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def resolve_thinking(thinking=None, enable_thinking=None):
    """`thinking` is the official template's switch; `enable_thinking` (what some clients send) is
    accepted as an alias, so the prompt and the parser never disagree. Both given and different: error."""
    if thinking is not None and enable_thinking is not None and bool(thinking) != bool(enable_thinking):
        raise ValueError("thinking and enable_thinking disagree")
    return bool(thinking if thinking is not None else enable_thinking)


def encode(messages, fmt="v32exp", thinking=None, tools=None, add_generation_prompt=True, enable_thinking=None,
           drop_thinking=True, reasoning_effort=None):
    """OpenAI-style messages -> prompt text in the chosen format. tools (an OpenAI tool list) go into the
    system prompt. In the DSML formats a user turn always ends with the assistant prefix and
    add_generation_prompt has no effect (the reference encoders have no such flag). drop_thinking and
    reasoning_effort ("max") act in dsml4 only: in dsml32 the official rules never show reasoning
    before the last user turn, so dropping it changes nothing. A lone surrogate anywhere in the input
    (not a character; no tokenizer or UTF-8 writer takes it) comes out as U+FFFD, as in the parser."""
    if fmt not in FORMATS:
        raise ValueError(f"chat format {fmt!r} is not one of {', '.join(FORMATS)}")
    thinking = resolve_thinking(thinking, enable_thinking)
    if fmt == "v32exp":
        return no_surrogates(_encode_v32exp(messages, thinking, tools, add_generation_prompt))
    return no_surrogates(_encode_dsml(messages, fmt, thinking, tools, drop_thinking, reasoning_effort))


def _encode_v32exp(messages, thinking, tools, add_generation_prompt):
    """The official template's rules (spec §3.2), state for state."""
    system = "\n\n".join(m.get("content") or "" for m in messages if m["role"] == "system")
    if tools:
        system += "\n\n" + v31_tools_block(tools)
    out = [BOS, system]
    last_user = is_tool = is_prefix = False
    only_system = any(m["role"] == "system" for m in messages)     # true until a non-system message
    for m in messages:
        role, content = m["role"], m.get("content")
        calls = _calls(m) if role == "assistant" else None
        if role == "user":
            out.append(USER + (content or ""))
            last_user, is_tool = True, False
        elif role == "assistant" and calls:
            if last_user or only_system:
                out.append(ASSISTANT + END_THINK)          # historical tool calls: non-thinking prefix
            first = True
            for name, args, _ in calls:
                opening = ((content if content is not None else "") + CALLS_BEGIN) if first else ""
                out.append(opening + CALL_BEGIN + name + TOOL_SEP + args + CALL_END)
                first = False
            out.append(CALLS_END + EOS)
            last_user = is_tool = False
        elif role == "assistant":
            prefix = bool(m.get("prefix"))
            if last_user:
                out.append(ASSISTANT + (THINK if prefix and thinking else END_THINK))
            is_prefix |= prefix
            content = content or ""
            if is_tool:
                out.append(content + EOS)
                is_tool = False
            else:
                out.append(content.split(END_THINK, 1)[1] if END_THINK in content else content)   # reasoning dropped
                out.append(EOS)
            last_user = False
        elif role == "tool":
            out.append(OUTPUT_BEGIN + (content or "") + OUTPUT_END)
            last_user, is_tool = False, True
        elif role != "system":
            raise ValueError(f"role {role!r} is not part of the v32exp format")
        if role != "system":
            only_system = False
    if add_generation_prompt and not is_tool and (last_user or only_system or not is_prefix):
        out.append(ASSISTANT + (THINK if thinking else END_THINK))   # after a tool result: nothing
    return "".join(out)


def _attach_tools(messages, tools):  # tools travel on the first system message (SGLang's wrapper rule)
    messages = [dict(m) for m in messages]
    if tools:
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = tools
    return messages


def _dsml_params(args_json):  # arguments JSON text -> the DSML parameter lines
    args = json.loads(args_json)
    if not isinstance(args, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {args_json!r}")
    return "\n".join(f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                     f'{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>' for k, v in args.items())


def _dsml_calls(calls, block):
    invokes = [f'<{DSML}invoke name="{name}">\n{_dsml_params(args)}\n</{DSML}invoke>' for name, args, _ in calls]
    return f"\n\n<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def _system_text(m, fmt):
    text = ""
    if m.get("tools"):
        text += "\n\n" + dsml_tools_block(m["tools"], fmt)
    if m.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT.format(schema=to_json(m["response_format"]))
    return text


def _encode_dsml(messages, fmt, thinking, tools, drop_thinking, reasoning_effort):
    messages = _attach_tools(messages, tools)
    if fmt == "dsml4":
        return _encode_dsml4(messages, thinking, drop_thinking, reasoning_effort)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)
    switch = lambda on: THINK if on else END_THINK           # noqa: E731  the thinking switch token
    out = [BOS]
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if role == "system":
            out.append((content or "") + _system_text(m, fmt))
        elif role in ("user", "developer"):
            if role == "developer":
                content = _system_text(m, fmt) + "\n\n# The user's message is: " + (content or "")
            out.append(USER + (content or "") + ASSISTANT + switch(i == last_user and thinking))
        elif role == "assistant":
            calls = _calls(m)
            reasoning = ""
            if thinking and i > last_user:               # drop_thinking: earlier reasoning is never shown
                reasoning = (m.get("reasoning_content") or "") + END_THINK
            out.append(reasoning + (content or "") + (_dsml_calls(calls, "function_calls") if calls else "") + EOS)
        elif role == "tool":
            j = i - 1
            while j >= 0 and messages[j]["role"] == "tool":
                j -= 1
            calls = _calls(messages[j]) if j >= 0 and messages[j]["role"] == "assistant" else None
            order = i - j
            if not calls or order > len(calls):
                raise ValueError(f"message {i}: a tool result without a matching assistant tool call")
            out.append(("\n\n<function_results>" if order == 1 else "") + f"\n<result>{content or ''}</result>")
            if order == len(calls):
                out.append("\n</function_results>\n\n" + switch(i >= last_user and thinking))
        else:
            raise ValueError(f"role {role!r} is not part of the dsml32 format")
    return "".join(out)


def _encode_dsml4(messages, thinking, drop_thinking, reasoning_effort):
    merged = []                                      # tool results join the user turn (no tool role in V4)
    for m in messages:
        if m["role"] == "tool":
            block = "<tool_result>" + (m.get("content") or "") + "</tool_result>"
            if merged and merged[-1]["role"] == "user" and merged[-1].get("_blocks") is not None:
                merged[-1]["_blocks"].append(block)
            else:
                merged.append({"role": "user", "_blocks": [block]})
        elif m["role"] == "user" and merged and merged[-1]["role"] == "user" and merged[-1].get("_blocks") is not None:
            merged[-1]["_blocks"].append(m.get("content") or "")
        else:
            merged.append(dict(m))
    if any(m.get("tools") for m in merged):
        drop_thinking = False                        # V4 keeps reasoning whenever tools are present
    last_user = max((i for i, m in enumerate(merged) if m["role"] in ("user", "developer")), default=-1)
    out = [BOS]
    for i, m in enumerate(merged):
        role, content = m["role"], m.get("content")
        if i == 0 and thinking and reasoning_effort == "max":
            out.append(DSML4_EFFORT_MAX)
        if role == "system":
            out.append((content or "") + _system_text(m, "dsml4"))
        elif role == "developer":
            out.append(USER + (content or "") + _system_text(m, "dsml4"))
        elif role == "user":
            out.append(USER + ("\n\n".join(m["_blocks"]) if m.get("_blocks") is not None else (content or "")))
        elif role == "assistant":
            calls = _calls(m)
            reasoning = ""
            if thinking and (not drop_thinking or i > last_user):
                reasoning = (m.get("reasoning") or "") + END_THINK
            out.append(reasoning + (content or "") + (_dsml_calls(calls, "tool_calls") if calls else "") + EOS)
        else:
            raise ValueError(f"role {role!r} is not part of the dsml4 format")
        nxt = merged[i + 1]["role"] if i + 1 < len(merged) else None
        if role in ("user", "developer") and nxt in (None, "assistant"):
            on = thinking and (not drop_thinking or i >= last_user)
            out.append(ASSISTANT + (THINK if on else END_THINK))
    return "".join(out)


def default_format(ckpt_dir):
    """v32exp when the checkpoint's tokenizer_config.json carries a chat_template, else by model_type."""
    ckpt_dir = Path(ckpt_dir)
    tc = ckpt_dir / "tokenizer_config.json"
    if tc.is_file():
        try:
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as e:   # RecursionError is not a ValueError: nest limit below
            raise ValueError(f"{tc}: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{tc}: JSON nested too deeply to read") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{tc}: expected a JSON object, got {type(cfg).__name__}")
        if cfg.get("chat_template"):
            return "v32exp"
    try:
        model_type = json.loads((ckpt_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None                            # the model loader reports a broken config.json
    return {"deepseek_v32": "dsml32", "deepseek_v4": "dsml4"}.get(model_type, "v32exp")


# -----------------------------------------------------------------------------
# Parsing: one text-level state machine per format, fed in any chunks

MERGED_SPANS = {"reasoning", "content", "name", "arguments", "markup", "filler", "error"}   # markers never merge
SURROGATE = re.compile("[\ud800-\udfff]")


@functools.lru_cache(maxsize=None)
def marker_regex(markers):  # one search for the earliest marker; the longer one first, so it wins a tie
    return re.compile("|".join(re.escape(mk) for mk in sorted(markers, key=len, reverse=True)))


def held_suffix(buf, pos, markers):
    """Length of the longest suffix of buf[pos:] that is a proper prefix of a marker: only the tail
    shorter than the marker is looked at, from its leftmost possible start (so the longest hold)."""
    hold = 0
    for mk in markers:
        p = buf.find(mk[0], max(pos, len(buf) - len(mk) + 1))
        while p >= 0 and len(buf) - p > hold:
            if mk.startswith(buf[p:]):
                hold = len(buf) - p
                break
            p = buf.find(mk[0], p + 1)
    return hold


def utf8_len(text):
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def no_surrogates(text):
    """A lone surrogate is not a character and has no UTF-8: each becomes U+FFFD (one char, 3 bytes),
    as the byte decoder does with invalid UTF-8. Pairs are not joined, so every chunking agrees."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return SURROGATE.sub("\ufffd", text)


class StreamParser:
    """Feed completion text (str, or bytes through an incremental UTF-8 decoder) in any chunks; get
    events back. Held back, so never emitted twice or out of order: an incomplete UTF-8 sequence and
    any suffix that could still become a marker; structural text between calls is decided only once
    the next marker (or the end) is seen. A lone surrogate in a str chunk (not text; it has no UTF-8)
    is read as U+FFFD, the character the byte decoder gives invalid UTF-8. Events are dicts:

        {"type": "reasoning", "text"}            reasoning text (the prompt ended with <think>)
        {"type": "content", "text"}              answer text
        {"type": "tool_call", "index", "id", "name"[, "unknown_tool": True]}   a call's name is complete
        {"type": "tool_call_arguments", "index", "text"}   a piece of its arguments JSON text
        {"type": "tool_call_done", "index", "arguments"}   complete, with valid JSON object arguments
        {"type": "error", "reason", "text"[, "index"]}     malformed output; its raw text is kept here
        {"type": "finish", "finish_reason"}                last event of finish(): "tool_calls" or "stop"

    Linear: the work per chunk does not depend on what came before. Only the unconsumed tail (shorter
    than the longest marker) is kept between chunks, plus what the output needs whole: an open call's
    raw text (for its error), its arguments, and an undecided structural gap, each kept as pieces.
    """

    def __init__(self, fmt="v32exp", prompt="", tools=None):
        if fmt not in FORMATS:
            raise ValueError(f"chat format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.tool_names = None if tools is None else {f["name"] for f in _tool_functions(tools)}
        # the reasoning split follows the prompt's tail, never a request flag (spec §7)
        self.state = "reasoning" if prompt.endswith(THINK) else "content"
        b = "function_calls" if fmt == "dsml32" else "tool_calls"
        self.open_block, self.close_block = f"<{DSML}{b}>", f"</{DSML}{b}>"
        self.buf, self.pos = "", 0                       # the text; buf[:pos] is consumed (dropped per feed)
        self.chars = self.bytes = 0                      # offsets of buf[pos]
        self.record = None                               # an open call's raw text so far, as pieces
        self.gap, self.gap_start = [], None              # an undecided structural gap, and its offsets
        self.events, self.spans, self.calls, self.errors = [], [], [], []
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.call, self.n_calls, self.after = None, 0, []
        self.finished = False

    # --- plumbing -------------------------------------------------------------------------------

    def feed(self, chunk):  # str or bytes -> [event]
        if self.finished:
            raise ValueError("feed() after finish()")
        if isinstance(chunk, (bytes, bytearray, memoryview)):
            chunk = self.decoder.decode(bytes(chunk))
        self.events = []
        self.buf, self.pos = self.buf[self.pos:] + no_surrogates(chunk), 0
        self._run(final=False)
        return self._joined(self.events)

    def finish(self):  # -> [event], the last one {"type": "finish", ...}
        self.events = []
        self.buf, self.pos = self.buf[self.pos:] + self.decoder.decode(b"", final=True), 0
        self._run(final=True)
        self._end_of_stream()
        self.finished = True
        self.events.append({"type": "finish", "finish_reason": self.finish_reason})
        return self._joined(self.events)

    @staticmethod
    def _joined(events):  # text events gather pieces while the machine runs (one join, not one per piece)
        for ev in events:
            if ev["type"] in ("reasoning", "content"):
                ev["text"] = "".join(ev["text"])
        return events

    @property
    def finish_reason(self):  # tool_calls only when at least one call with valid JSON arguments
        return "tool_calls" if self.calls else "stop"

    def _consume(self, n):  # n chars of the buffer -> their text; the offsets move on, no span yet
        text = self.buf[self.pos:self.pos + n]
        self.pos, self.chars, self.bytes = self.pos + n, self.chars + n, self.bytes + utf8_len(text)
        if self.record is not None:
            self.record.append(text)
        return text

    def _span(self, kind, chars, nbytes):  # the text from offsets (chars, nbytes) to here is a `kind`
        if chars == self.chars:
            return
        last = self.spans[-1] if self.spans else None
        if last and kind in MERGED_SPANS and last["kind"] == kind and last["chars"][1] == chars:
            last["chars"], last["bytes"] = (last["chars"][0], self.chars), (last["bytes"][0], self.bytes)
        else:
            self.spans.append({"kind": kind, "chars": (chars, self.chars), "bytes": (nbytes, self.bytes)})

    def _take(self, n, kind):  # consume n chars of the buffer as a span of `kind` -> the text
        chars, nbytes = self.chars, self.bytes
        text = self._consume(n)
        self._span(kind, chars, nbytes)
        return text

    def _scan(self, markers, final):
        """-> (n, marker): the earliest marker is n chars into the buffer (the longer one on a tie);
        else (n, None): n chars are safe to consume, holding back a suffix that is a proper prefix of
        a marker (nothing is held back when final). Looks at the unconsumed text only."""
        m = marker_regex(tuple(markers)).search(self.buf, self.pos)
        if m:
            return m.start() - self.pos, m.group()
        n = len(self.buf) - self.pos
        return (n if final else n - held_suffix(self.buf, self.pos, markers)), None

    def _open_record(self):  # from here to the call's end, consumed text is kept for its error
        self.record = []

    def _close_record(self):  # -> the open call's raw text
        text, self.record = "".join(self.record), None
        return text

    def _emit_text(self, kind, text):
        if text:
            if self.events and self.events[-1]["type"] == kind:
                self.events[-1]["text"].append(text)
            else:
                self.events.append({"type": kind, "text": [text]})

    def _error(self, reason, text, index=None):
        err = {"reason": reason, "text": text} | ({"index": index} if index is not None else {})
        self.errors.append(err)
        self.events.append({"type": "error", **err})

    def _text_until(self, kind, markers, final):  # emit text of `kind` up to a marker -> the marker or None
        i, mk = self._scan(markers, final)
        self._emit_text(kind, self._take(i, kind))
        return mk

    def _gap(self, markers, final):
        """Structural text up to the next marker, consumed as it comes (never scanned twice) but
        decided only once the marker or the end is seen -> (marker, gap text) or None if undecided."""
        i, mk = self._scan(markers, final)
        if self.gap_start is None:
            self.gap_start = (self.chars, self.bytes)
        self.gap.append(self._consume(i))
        if mk is None and not final:
            return None
        gap, self.gap = "".join(self.gap), []
        return mk, gap

    def _gap_span(self, kind):  # the decided gap's span
        start, self.gap_start = self.gap_start, None
        self._span(kind, *start)

    def _between(self, markers, final):
        """Structural gap (between calls, inside an invoke): whitespace is filler; anything else is
        kept as content and noted. Decided only once the next marker or the end is seen."""
        got = self._gap(markers, final)
        if got is None:
            return None
        mk, gap = got
        if gap.strip():
            self._gap_span("content")
            self._emit_text("content", gap)
            self._error("unexpected_text", gap)
        else:
            self._gap_span("filler")
        return mk

    # --- calls ----------------------------------------------------------------------------------

    def _start_call(self, name, bad=None):
        name = name.strip()
        self.call = {"index": self.n_calls, "name": name, "args": [], "started": False,
                     "bad": bad or (None if name else "empty_name"), "params": {}}
        self.n_calls += 1
        if self.call["bad"]:
            return
        ev = {"type": "tool_call", "index": self.call["index"], "id": f"call_{uuid.uuid4().hex[:24]}", "name": name}
        if self.tool_names is not None and name not in self.tool_names:
            ev["unknown_tool"] = True
        self.call.update(started=True, unknown=ev.get("unknown_tool", False))
        self.events.append(ev)

    def _args(self, text):
        if text:
            self.call["args"].append(text)
            if self.call["started"] and not self.call["bad"]:
                self.events.append({"type": "tool_call_arguments", "index": self.call["index"], "text": text})

    def _end_call(self, reason=None):
        """Close the current call: JSON object arguments -> a call; anything else -> an error that
        keeps the call's raw text, so no half JSON is ever reported as a complete call."""
        c, self.call = self.call, None
        reason, args, raw = reason or c["bad"], "".join(c["args"]), self._close_record()
        if reason is None:
            try:
                reason = None if isinstance(json.loads(args), dict) else "invalid_arguments"
            except (ValueError, RecursionError):                 # deep nesting: not arguments we can use
                reason = "invalid_arguments"
        if reason:
            self._error(reason, raw, c["index"])
            return
        call = {"name": c["name"], "arguments": args} | ({"unknown_tool": True} if c["unknown"] else {})
        self.calls.append(call)
        self.events.append({"type": "tool_call_done", "index": c["index"], "arguments": args})

    # --- the machine ----------------------------------------------------------------------------

    def _run(self, final):
        step = self._step_v31 if self.fmt == "v32exp" else self._step_dsml
        # a pending gap is decided at the end even with nothing left to read
        while (self.pos < len(self.buf) or final and self.gap_start is not None) and step(final):
            pass

    def _step_reasoning(self, final):  # shared: reasoning until </think>, then content
        mk = self._text_until("reasoning", [END_THINK], final)
        if mk is None:
            return False
        self._take(len(mk), "think_end")
        self.state = "content"
        return True

    def _step_after(self, final):
        i, mk = self._scan([EOS], final)
        text = self._take(i, "content")
        self._emit_text("content", text)
        self.after.append(text)
        if mk is None:
            return False
        self._take(len(mk), "eos")
        self._flush_after()
        return True

    def _flush_after(self):
        after, self.after = "".join(self.after), []
        if after:
            self._error("text_after_calls", after)

    # V3.1 / V3.2-Exp:  <｜tool▁calls▁begin｜> ( <｜tool▁call▁begin｜> NAME <｜tool▁sep｜> ARGS <｜tool▁call▁end｜> )+ <｜tool▁calls▁end｜>
    def _step_v31(self, final):
        s = self.state
        if s == "reasoning":
            return self._step_reasoning(final)
        if s == "content":               # a bare call-begin (calls-begin missing) is accepted as a call
            mk = self._text_until("content", [CALLS_BEGIN, CALL_BEGIN, EOS], final)
            if mk is None:
                return False
            kind = {CALLS_BEGIN: "calls_begin", CALL_BEGIN: "call_begin", EOS: "eos"}[mk]
            if mk == CALL_BEGIN:                                 # a call's raw text starts with its marker
                self._open_record()
                self.state, self.name = "name", []
            elif mk == CALLS_BEGIN:
                self.state = "calls"
            self._take(len(mk), kind)
            return True
        if s == "calls":                 # between calls
            mk = self._between([CALL_BEGIN, CALLS_END, EOS], final)
            if mk is None:
                return False
            if mk == CALL_BEGIN:
                self._open_record()
                self.state, self.name = "name", []
            elif mk == CALLS_END:
                self.state = "after"
            self._take(len(mk), {CALL_BEGIN: "call_begin", CALLS_END: "calls_end", EOS: "eos"}[mk])
            return True
        if s == "name":
            i, mk = self._scan([TOOL_SEP, CALL_END, CALL_BEGIN, CALLS_END, EOS], final)
            self.name.append(self._take(i, "name"))
            if mk is None:
                return False
            if mk == TOOL_SEP:
                self._take(len(mk), "tool_sep")
                self._start_call("".join(self.name))
                self.state = "args"
                return True
            if mk == CALL_END:                                   # a call without <｜tool▁sep｜>
                self._take(len(mk), "call_end")
            self._error("malformed_call", self._close_record())
            self.state = "calls"
            return True
        if s == "args":
            i, mk = self._scan([CALL_END, CALL_BEGIN, CALLS_END, EOS], final)
            self._args(self._take(i, "arguments"))
            if mk is None:
                return False
            if mk == CALL_END:
                self._take(len(mk), "call_end")
                self._end_call()
            else:                                                # the call never closed
                self._end_call("unterminated_call")
            self.state = "calls"
            return True
        if s == "after":
            return self._step_after(final)
        raise AssertionError(s)

    # DSML (V3.2: function_calls, V4: tool_calls)
    def _step_dsml(self, final):
        s, open_block, close_block = self.state, self.open_block, self.close_block
        invoke, invoke_end = f"<{DSML}invoke", f"</{DSML}invoke>"
        param, param_end = f"<{DSML}parameter", f"</{DSML}parameter>"
        if s == "reasoning":
            return self._step_reasoning(final)
        if s == "content":               # the block marker owns the "\n\n" before it
            mk = self._text_until("content", ["\n\n" + open_block, open_block, EOS], final)
            if mk is None:
                return False
            self._take(len(mk), "eos" if mk == EOS else "block_begin")
            if mk != EOS:
                self.state = "block"
            return True
        if s == "block":                 # between invokes
            mk = self._between([invoke, close_block, EOS], final)
            if mk is None:
                return False
            if mk == invoke:
                self._open_record()
                self.state, self.head = "invoke_head", []
            elif mk == close_block:
                self.state = "after"
            self._take(len(mk), {invoke: "invoke_begin", close_block: "block_end", EOS: "eos"}[mk])
            return True
        if s == "invoke_head":           # ` name="NAME">`, or self-closing `/>` for no arguments
            i, mk = self._scan(['">', '"/>', invoke_end, close_block, EOS], final)
            self.head.append(self._take(i, "markup"))
            if mk is None:
                return False
            if mk not in ('">', '"/>'):                          # no end of the tag before the next marker
                self._error("malformed_invoke", self._close_record())
                self.state = "block"
                if mk == invoke_end:
                    self._take(len(mk), "invoke_end")
                return True
            self._take(len(mk), "markup")
            m = re.fullmatch(r'\s*name="(.*)', "".join(self.head), re.DOTALL)
            self._start_call(m.group(1) if m else "", None if m else "malformed_invoke")
            if mk == '"/>':
                self._args("{}")
                self._end_call()
                self.state = "block"
            else:
                self.state = "invoke_body"
            return True
        if s == "invoke_body":           # parameters, then </｜DSML｜invoke>
            mk = self._between_in_call([param, invoke_end, close_block, invoke, EOS], final)
            if mk is None:
                return False
            if mk == param:
                self._take(len(mk), "param_begin")
                self.state, self.phead = "param_head", []
            elif mk == invoke_end:
                self._take(len(mk), "invoke_end")
                self._args("}" if self.call["params"] else "{}")
                self._end_call()
                self.state = "block"
            else:                                                # a new invoke, the block's end, EOS
                self._end_call("unterminated_call")
                self.state = "block"
            return True
        if s == "param_head":            # ` name="KEY" string="true|false">`
            i, mk = self._scan(['">', param_end, invoke_end, close_block, EOS], final)
            self.phead.append(self._take(i, "markup"))
            if mk is None:
                return False
            m = re.fullmatch(r' name="(.*)" string="(true|false)', "".join(self.phead), re.DOTALL) if mk == '">' else None
            if mk == '">':
                self._take(len(mk), "markup")
                self.pkey, self.pstring, self.pvalue = (m.group(1), m.group(2) == "true", []) if m else (None, False, [])
                self.state = "param_value"
            else:
                self.state = "invoke_body"
                if mk == param_end:
                    self._take(len(mk), "param_end")
            if m is None:
                self.call["bad"] = self.call["bad"] or "malformed_parameter"
            return True
        if s == "param_value":
            i, mk = self._scan([param_end, invoke_end, close_block, EOS], final)
            self.pvalue.append(self._take(i, "arguments"))
            if mk is None:
                return False
            if mk != param_end:                                  # the parameter never closed
                self._end_call("unterminated_call")
                self.state = "block"
                return True
            self._take(len(mk), "param_end")
            if self.pkey is not None:
                self.pvalue = "".join(self.pvalue)
                if self.pkey in self.call["params"]:
                    self.call["bad"] = self.call["bad"] or "duplicate_parameter"
                # the official decoding: strings JSON-quoted, other values verbatim (checked at the close)
                piece = to_json(self.pkey) + ": " + (to_json(self.pvalue) if self.pstring else self.pvalue)
                self._args(("{" if not self.call["params"] else ", ") + piece)
                self.call["params"][self.pkey] = self.pvalue
            self.state = "invoke_body"
            return True
        if s == "after":
            return self._step_after(final)
        raise AssertionError(s)

    def _between_in_call(self, markers, final):  # inside an invoke: anything but whitespace spoils the call
        got = self._gap(markers, final)
        if got is None:
            return None
        mk, gap = got
        if gap.strip():
            self.call["bad"] = self.call["bad"] or "malformed_invoke"
        self._gap_span("error" if gap.strip() else "filler")
        return mk

    def _end_of_stream(self):
        """What is open when the text ends: a call -> unterminated (its raw text kept in the error).
        A missing closing marker after complete calls is harmless and not reported."""
        if self.call is not None:
            self._end_call("unterminated_call")
        elif self.state in ("name", "invoke_head"):                 # the call's name never completed
            self._error("unterminated_call", self._close_record())
        self._flush_after()


def parse(completion, fmt="v32exp", prompt="", tools=None):
    """A whole completion -> {"reasoning", "content", "tool_calls", "finish_reason", "errors", "spans"}.
    Text fields are None when empty; tool_calls holds the calls with valid JSON object arguments
    (flagged "unknown_tool" when a tool list is given and lacks the name); errors keeps the raw text
    of everything malformed. Raises on no completion: text that is not text (a lone surrogate) reads
    as U+FFFD, as in StreamParser."""
    p = StreamParser(fmt, prompt, tools)
    events = p.feed(completion) + p.finish()
    text = {"reasoning": [], "content": []}
    for ev in events:
        if ev["type"] in text:
            text[ev["type"]].append(ev["text"])
    text = {k: "".join(v) for k, v in text.items()}
    return {"reasoning": text["reasoning"] or None, "content": text["content"] or None, "tool_calls": p.calls,
            "finish_reason": p.finish_reason, "errors": p.errors, "spans": p.spans}


# -----------------------------------------------------------------------------
# Token ids -> text, for streaming

class Detokenizer:
    """Incremental detokenizer: feed token ids, get the new text; an incomplete UTF-8 sequence (a
    character split across tokens decodes to U+FFFD) is held back until it completes. Each call
    decodes only the tokens since the last text shown plus those before it (the prefix window:
    byte-level BPE needs them for a character split across tokens), so a long generation costs
    linear time, not the whole history per token."""

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tok, self.skip, self.ids = tokenizer, skip_special_tokens, []
        self.prefix = self.read = 0          # ids[prefix:read] decode to text already shown

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def feed(self, token_id):
        self.ids.append(int(token_id))
        shown = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(shown):      # incomplete, or nothing new yet
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]

    def flush(self):  # at the end: whatever is left, replacement characters included
        shown = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(shown):]
