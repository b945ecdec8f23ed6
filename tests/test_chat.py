"""chat.py against the official Jinja template rendered as Hugging Face renders it, and the real
tokenizer against the ids in spec/chat.md §1."""
import json

import pytest
from hypothesis import given, strategies as st

import chat
import checkpoint

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment


def jinja_render(messages, **kw):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(chat.chat_template()).render(messages=messages, bos_token=chat.BOS, **kw)


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT), min_size=1, max_size=6),
       st.booleans(), st.booleans())
def test_render_equals_the_official_template(turns, gen, thinking):
    messages = [{"role": r, "content": c} for r, c in turns]
    assert chat.render(messages, add_generation_prompt=gen, thinking=thinking) == \
        jinja_render(messages, add_generation_prompt=gen, thinking=thinking)


def test_single_turn_and_history():
    assert chat.render([{"role": "user", "content": "hi"}]) == \
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    conv = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Time in Tokyo?"},
            {"role": "assistant", "content": "<think>hmm</think>Hi!"}, {"role": "user", "content": "again"}]
    assert chat.render(conv, thinking=True) == ("<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Time in Tokyo?"
                                                "<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜><｜User｜>again"
                                                "<｜Assistant｜><think>")


def test_real_tokenizer_reproduces_the_model_card_ids():
    from tokenizers import Tokenizer
    files = checkpoint.tokenizer_files()
    tok = Tokenizer.from_str(files["tokenizer.json"])
    text = ("<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek.<｜end▁of▁sentence｜>"
            "<｜User｜>1+1=?<｜Assistant｜><think>")
    assert tok.encode(text, add_special_tokens=False).ids == [
        0, 128803, 33310, 128804, 128799, 19923, 3, 342, 1030, 22651, 4374, 1465, 16, 1, 128803, 19, 13, 19,
        127252, 128804, 128798]
    assert tok.get_vocab_size() == 128815
    assert json.loads(files["tokenizer_config.json"])["chat_template"] == chat.chat_template()


def test_template_is_the_spec_text_byte_for_byte():
    from conftest import ROOT
    spec = ROOT.parent / "shared" / "spec" / "chat.md"
    if not spec.is_file():
        pytest.skip("shared/spec/chat.md is not beside this clone")
    text = spec.read_text(encoding="utf-8")
    start = text.index("```jinja\n", text.index("### 3.1 Exact text")) + len("```jinja\n")
    assert chat.chat_template() == text[start:text.index("\n```", start)]
