"""Turn encoding for multi-turn rollouts (spmdrl/data/turns.py): observation ids follow the chat template."""

from __future__ import annotations

import pytest

from spmdrl.data.turns import TemplateError, TurnCodec


# ------------------------------------------------------------------------- the boundaries, the mask
def test_observation_ids_follow_the_chat_template() -> None:
    from spmdrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    codec = TurnCodec(tok)
    ids = codec.observation_ids([{"role": "tool", "content": "56088"}])
    assert tok.decode(ids) == "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    assert codec.end_ids == {tok.eos_token_id}
    # A conversation rendered whole encodes to prompt + sampled turn + observation: the pieces add up.
    msgs = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    turn = tok.encode("call", add_special_tokens=False) + [tok.eos_token_id]
    whole = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "56088"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tok.encode(prompt, add_special_tokens=False) + turn + ids == tok.encode(
        whole, add_special_tokens=False
    )


def _with_template(template: str, eos: str):  # noqa: ANN202
    from spmdrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [eos, "<|start_header_id|>", "<|end_header_id|>"]})
    tok.chat_template = template
    return tok


LLAMA31_LIKE = (
    "{% for m in messages %}{% set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


QWEN_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_observation_ids_for_llama_and_qwen_tool_turns() -> None:
    tok = _with_template(LLAMA31_LIKE, "<|eot_id|>")
    ids = TurnCodec(tok).observation_ids([{"role": "tool", "content": "42"}])
    assert tok.decode(ids) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.convert_tokens_to_ids("<|eot_id|>") in TurnCodec(tok).end_ids

    tok = _with_template(QWEN_LIKE, "<|eot_id|>")
    two = TurnCodec(tok).observation_ids([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert tok.decode(two) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_that_rewrites_earlier_turns_is_refused() -> None:
    # Renders the last assistant turn differently once something follows it: not token-exact.
    bad = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}{{ '<|im_start|>assistant\\n'"
        " + m['content'] + '<|im_end|>\\n' }}{% elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n"
        "(old)<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok = _with_template(bad, "<|eot_id|>")
    with pytest.raises(TemplateError, match="renders earlier turns differently"):
        TurnCodec(tok).observation_ids([{"role": "tool", "content": "1"}])


def test_turn_end_is_the_templates_not_a_base_models_eos() -> None:
    """A base tokenizer whose eos is <|endoftext|> still ends ChatML turns with <|im_end|>: the rollout
    stops turns on it and multi-turn SFT ends each turn with it."""
    from spmdrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.eos_token = "<|endoftext|>"
    codec = TurnCodec(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert codec.turn_end_id == im_end
    assert {im_end, tok.eos_token_id} <= codec.end_ids
