"""Multi-turn SFT rows (spmdrl/data/sft.py) from the built-in tool task: ids and masks are the rollout's,
tool messages become observations, limits and errors."""

from __future__ import annotations

import collections
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spmdrl.data import tools_task
from spmdrl.data.parquet import DataError
from spmdrl.data.sft import SFTDataset
from spmdrl.data.tools_task import ToolsTaskConfig
from spmdrl.data.turns import TurnCodec

SMALL = ToolsTaskConfig(num_train=600, num_test=60)


@pytest.fixture(scope="module")
def tokenizer():
    from spmdrl.models.tiny import build_tokenizer

    return build_tokenizer()


# ---------------------------------------------------------------------------- multi-turn SFT


def sft(paths: list[Path], tokenizer, **kw) -> SFTDataset:
    args = dict(
        prompt_key="prompt",
        response_key="response",
        max_prompt_length=64,
        max_response_length=160,
        overlong="error",
    )
    return SFTDataset(paths, tokenizer, **(args | kw))


def test_multi_turn_sft_ids_are_the_rollouts_ids(tmp_path: Path, tokenizer):
    paths = tools_task.write_split_files(tmp_path, SMALL)
    ds = sft([paths["train"]], tokenizer)
    train, _ = tools_task.generate(SMALL)
    assert len(ds) == len(train) and ds.num_filtered == 0
    codec = TurnCodec(tokenizer)
    eos = tokenizer.eos_token_id
    seen = collections.Counter()
    for i, row in enumerate(train[:40]):
        ex = ds[i]
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        # What a multi-turn rollout builds: prompt, then each sampled turn (its eos included, mask 1),
        # then the codec's observation ids for the tool messages (mask 0).
        ids, mask = list(prompt_ids), [0] * len(prompt_ids)
        for m in row["response"]:
            if m["role"] == "assistant":
                turn = tokenizer.encode(m["content"], add_special_tokens=False) + [eos]
                ids, mask = ids + turn, mask + [1] * len(turn)
            else:
                obs = codec.observation_ids([m])
                ids, mask = ids + obs, mask + [0] * len(obs)
        assert ex.input_ids == ids and ex.loss_mask == mask
        trained = [t for t, k in zip(ex.input_ids, ex.loss_mask, strict=True) if k]
        contents = [m["content"] for m in row["response"] if m["role"] == "assistant"]
        assert tokenizer.decode(trained) == "".join(c + "<|im_end|>" for c in contents)
        seen[len(row["response"])] += 1
        if len(row["response"]) == 3:
            # The whole sequence is the chat template's rendering of the conversation.
            conversation = tokenizer.apply_chat_template(row["prompt"] + row["response"], tokenize=False)
            assert tokenizer.decode(ex.input_ids) == conversation.rstrip("\n")
            untrained = tokenizer.decode(
                [t for t, k in zip(ex.input_ids, ex.loss_mask, strict=True) if not k]
            )
            assert (
                untrained
                == text
                + f"\n<|im_start|>tool\n{row['reward_model']['ground_truth']}<|im_end|>\n<|im_start|>assistant\n"
            )
    assert seen[1] and seen[3], "both kinds of demonstration are covered"


def _write(path: Path, prompts: list, responses: list) -> Path:
    import pyarrow as pa

    pq.write_table(pa.table({"prompt": prompts, "response": responses}), path)
    return path


def test_consecutive_tool_messages_share_one_observation(tmp_path: Path, tokenizer):
    response = [
        {"role": "assistant", "content": "<tool_call>a</tool_call><tool_call>b</tool_call>"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "#### 3"},
    ]
    ex = sft([_write(tmp_path / "x.parquet", ["q"], [response])], tokenizer)[0]
    obs = TurnCodec(tokenizer).observation_ids(response[1:3])
    eos = tokenizer.eos_token_id
    first = tokenizer.encode(response[0]["content"], add_special_tokens=False) + [eos]
    last = tokenizer.encode("#### 3", add_special_tokens=False) + [eos]
    n_prompt = len(ex.input_ids) - len(first) - len(obs) - len(last)
    assert ex.input_ids[n_prompt:] == first + obs + last
    assert ex.loss_mask == [0] * n_prompt + [1] * len(first) + [0] * len(obs) + [1] * len(last)


def test_multi_turn_response_limits_and_errors(tmp_path: Path, tokenizer):
    demo = tools_task.tool_demonstration(4821, 193)
    path = _write(tmp_path / "m.parquet", ["What is 4821 * 193?"], [demo])
    ex = sft([path], tokenizer)[0]
    n_response = len(ex.input_ids) - ex.loss_mask.index(1)
    # The response limit counts both turns, both eos tokens and the observation.
    assert sft([path], tokenizer, max_response_length=n_response).num_filtered == 0
    with pytest.raises(DataError, match="data.max_response_length"):
        sft([path], tokenizer, max_response_length=n_response - 1)
    starts_with_tool = _write(tmp_path / "t.parquet", ["q"], [demo[1:]])
    with pytest.raises(DataError, match="first message has role 'tool'"):
        sft([starts_with_tool], tokenizer)
    ends_with_tool = _write(tmp_path / "e.parquet", ["q"], [demo[:2]])
    with pytest.raises(DataError, match="must be the assistant's answer"):
        sft([ends_with_tool], tokenizer)
