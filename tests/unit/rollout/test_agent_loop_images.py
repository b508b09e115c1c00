"""A vision-language model's trajectory in the agent loop (spmdrl/rollout/agent_loop.py), without an
engine: what a turn's request carries (the engine's ids, one placeholder per image, with every image so
far), what the trajectory keeps for the trainer (expanded ids, loss mask 0 on the observation, its pixel
values after the prompt's), and the response budget counted in expanded tokens (tool_overflow). The
built-in tiny VLM's tokenizer, template and processor; the stepper here only records the requests (the
real engine's side: tests/integration/test_vlm.py)."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from spmdrl.config import MultiTurnConfig
from spmdrl.data.turns import TurnCodec
from spmdrl.data.vision import encode_prompt
from spmdrl.rollout.agent_loop import AgentLoop, LoopStats, _Trajectory, multi_turn_metrics
from spmdrl.rollout.engine import SamplingSpec, TurnOutput
from spmdrl.rollout.turn_env import ToolTurnEnv, TurnReply
from spmdrl.tools import ToolExecutor, get_parser, load_tools


@pytest.fixture(scope="module")
def vl() -> tuple[Any, Any]:
    from spmdrl.models.load import load_processor, load_tokenizer
    from spmdrl.models.tiny import TINY_VL, default_cache_dir, ensure_tiny_model

    model_dir = ensure_tiny_model(default_cache_dir(), TINY_VL)  # the tests' shared cache: built once
    return load_tokenizer(model_dir), load_processor(model_dir)


class _Requests:
    def __init__(self) -> None:
        self.added: list[tuple[list[int], list[Any]]] = []

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingSpec, images: Any = ()) -> None:
        self.added.append((list(prompt_ids), list(images)))


def _loop(vl: tuple[Any, Any], max_response_tokens: int) -> AgentLoop:
    tok, processor = vl
    env = ToolTurnEnv(ToolExecutor(load_tools(["draw_shape"])), get_parser("hermes"), images=True)
    return AgentLoop(
        MultiTurnConfig(enable=True, tools=["draw_shape"]),
        env=env,
        codec=TurnCodec(tok, processor=processor),
        tokenizer=tok,
        max_response_tokens=max_response_tokens,
        max_model_len=512,
    )


def _drawing() -> TurnReply:
    img = Image.new("RGB", (64, 64), "white")
    return TurnReply(
        [{"role": "tool", "content": [{"type": "image", "image": img}, {"type": "text", "text": "ok"}]}]
    )


def test_a_trajectory_with_an_image_observation(vl) -> None:  # noqa: ANN001
    tok, processor = vl
    prompt = encode_prompt(
        processor,
        "<|im_start|>user\n<image>Draw.<|im_end|>\n<|im_start|>assistant\n",
        [Image.new("RGB", (40, 30), "red")],
    )
    loop = _loop(vl, max_response_tokens=100)
    t = _Trajectory(0, 0, 0, prompt.token_ids, {}, image_prompt=prompt)
    sampled = tok.encode("call<|im_end|>", add_special_tokens=False)
    loop._append_turn(t, TurnOutput("t0-0", sampled, [-0.5] * len(sampled), "stop"))
    index, obs, reason, _ = loop._reply_event(t, _drawing())
    assert index == 0 and reason == "" and obs is not None
    loop._append_observation(t, obs)
    requests = _Requests()
    loop._admit(requests, t, SamplingSpec(n=1, max_tokens=8), base=0, dp_index=0)
    ((engine_ids, images),) = requests.added
    image_id = processor.image_token_id
    # The engine's request: the prompt's and the observation's placeholders, one per image sent.
    assert engine_ids == prompt.engine_ids + sampled + obs.engine_ids
    assert engine_ids.count(image_id) == len(images) == 2
    assert images[0] is prompt.images[0] and images[1].size == (64, 64)
    # The trainer's: expanded (4 image tokens per image), the observation masked, the sampled turn not.
    assert t.ids == sampled + obs.ids and t.ids.count(image_id) == 4
    assert t.mask == [1] * len(sampled) + [0] * len(obs.ids)
    assert t.logprobs[len(sampled) :] == [0.0] * len(obs.ids)
    assert t.info.observation_images == 1 and t.info.observation_tokens == len(obs.ids)
    gen = loop._generation(t)
    assert gen.images is not None and gen.images.counts_B == (1,)
    # multi_turn/observation_images: this rank's sum, over the trajectories (the prompt's image not counted).
    sums = multi_turn_metrics([gen, gen], LoopStats(wall_s=1.0, engine_idle_s=0.0, engine_steps=1))
    assert sums["observation_images"] == 2.0 and sums["n"] == 2.0


def test_the_budget_counts_an_images_expanded_tokens(vl) -> None:  # noqa: ANN001
    tok, _ = vl
    loop = _loop(vl, max_response_tokens=0)
    obs = loop.codec.observation(_drawing().messages)
    assert len(obs.ids) == len(obs.engine_ids) + 6  # tiny-vl: one placeholder -> 7 tokens
    # Room for the engine's form and one sampled token, not for the trainer's: the observation overflows.
    sampled = tok.encode("call<|im_end|>", add_special_tokens=False)
    loop.max_response_tokens = len(sampled) + len(obs.engine_ids) + 2
    t = _Trajectory(0, 0, 0, [1, 2], {})
    loop._append_turn(t, TurnOutput("t0-0", sampled, [-0.5] * len(sampled), "stop"))
    assert loop._reply_event(t, _drawing())[1:3] == (None, "tool_overflow")
    loop.max_response_tokens = len(sampled) + len(obs.ids) + 1
    assert loop._reply_event(t, _drawing())[2] == ""
