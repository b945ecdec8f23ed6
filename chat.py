"""The DeepSeek-V3.2-Exp chat format (spec/chat.md §3), as far as generate.py needs it today:
the official Jinja template as data (chat_template.jinja, byte for byte from the checkpoint's
tokenizer_config.json) and the rendering of plain user/assistant/system conversations.
Tools, thinking history and the streaming parsers are a separate issue.
"""
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def chat_template():  # the official V3.2-Exp template text
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def render(messages, add_generation_prompt=True, thinking=False):
    """[{"role": "system"|"user"|"assistant", "content": str}, ...] -> prompt text, following the
    template's rules (§3.2): system texts hoisted and joined by blank lines after BOS; an assistant
    turn after a user turn opens with <｜Assistant｜></think>; historical reasoning (before the first
    </think>) is dropped; every assistant turn ends with EOS."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    out, last_user = [BOS, system], False
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "user":
            out.append(USER + content)
            last_user = True
        elif role == "assistant":
            if last_user:
                out.append(ASSISTANT + END_THINK)
            if END_THINK in content:
                content = content.split(END_THINK, 1)[1]
            out.append(content + EOS)
            last_user = False
        elif role != "system":
            raise ValueError(f"role {role!r} is not supported here (tools arrive with the chat issue)")
    if add_generation_prompt:                     # no prefix messages here, so always (§3.2 rule 6)
        out.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(out)
