"""Policies: tiny builder + tokenizer, local directories, offline errors, and the real SmolLM2 conversion."""

import pytest

from forge.config import ModelConfig
from forge.errors import UserError
from forge.models import build_char_tokenizer, format_prompt_fn, load_policy


def test_char_tokenizer_round_trips_and_has_distinct_pad_eos():
    tok = build_char_tokenizer()
    text = "Compute 12 + 7 = 19."
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.pad_token_id != tok.eos_token_id


def test_tiny_policy_is_seeded_and_saves_to_a_loadable_dir(tmp_path):
    a, tok = load_policy(ModelConfig(path="tiny-random"), seed=3)
    b, _ = load_policy(ModelConfig(path="tiny-random"), seed=3)
    assert all((p - q).abs().max() == 0 for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert tok.padding_side == "left"
    a.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    c, tok2 = load_policy(ModelConfig(path=str(tmp_path / "m")))
    assert all((p - q).abs().max() == 0 for p, q in zip(a.parameters(), c.parameters(), strict=True))
    assert tok2.eos_token_id == tok.eos_token_id


def test_missing_or_invalid_model_path_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="does not exist"):
        load_policy(ModelConfig(path=str(tmp_path / "missing")))
    with pytest.raises(UserError, match="'someorg/somemodel' is a hub id that could not be fetched.*model.path=DIR"):
        load_policy(ModelConfig(path="someorg/somemodel"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        load_policy(ModelConfig(path=str(tmp_path / "empty")))


def test_smollm2_converts_once_and_answers_with_chat_template():
    model, tok = load_policy(ModelConfig(path="smollm2-135m-instruct"))
    assert model.config.vocab_size == 49152 and tok.pad_token_id is not None
    fmt = format_prompt_fn(tok, ModelConfig(path="smollm2-135m-instruct"))
    text = fmt("Compute 1 + 1. Reply with only the final integer.")
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    reply = tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in reply)


def test_format_prompt_applies_the_chat_template_to_messages_as_given():
    """A list of messages is rendered as is; model.system_prompt is prepended only when it holds no system message;
    string prompts keep today's rule; messages without a chat template are a one-line UserError."""
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    user = [{"role": "user", "content": "1+1="}]
    own_system = [{"role": "system", "content": "mine"}, *user]
    fmt = format_prompt_fn(tok, ModelConfig(system_prompt="sys"))
    assert fmt(user) == "[system]sys[user]1+1="
    assert fmt(own_system) == "[system]mine[user]1+1="
    assert fmt("2+2=") == "[system]sys[user]2+2="
    assert format_prompt_fn(tok, ModelConfig())(user) == "[user]1+1="
    assert format_prompt_fn(tok, ModelConfig(chat_template=False))("2+2=") == "2+2="
    with pytest.raises(UserError, match="model.chat_template=false: set it to true"):
        format_prompt_fn(tok, ModelConfig(chat_template=False))(user)
    with pytest.raises(UserError, match="tokenizer of model.path='tiny-random' has no chat template"):
        format_prompt_fn(build_char_tokenizer(), ModelConfig())(user)
