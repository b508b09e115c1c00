"""Every supported model family (spmdrl.models.families) on a small random model of its own architecture
(spmdrl.testing.models.save_family_model): engine/trainer parity after a checked weight sync, tied and
untied, responses that end at the chat template's end-of-turn token, a checkpoint round trip with an
export transformers loads to the same logits, and two GRPO steps of a real torchrun run (PPO with a
critic for Llama).

What each family brings that Qwen2 does not: Llama 3's rope scaling and ``<|eot_id|>`` turn end beside
``<|end_of_text|>``; Qwen3's q_norm / k_norm; Mistral's sliding window (narrower than the prompts);
Gemma's (1 + w) norms, scaled embeddings, soft-capping, alternating sliding layers and ``<end_of_turn>``;
Qwen3-MoE's router and fused experts (synced per expert, checked per expert, exported per expert).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from spmdrl.config import RolloutConfig
from spmdrl.rollout.mismatch import logprob_mismatch
from spmdrl.testing.models import FAMILY_SPECS, save_family_model
from spmdrl.testing.spawn import run_side_by_side

# The engine's kernels depend on the CPU: CI runs these as every CPU kind too.
pytestmark = pytest.mark.cpu_kinds

FAMILIES = list(FAMILY_SPECS)
VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
PROMPT_LEN = 150  # longer than the sliding windows (32) and than vLLM's CPU KV block (128)
MAX_LEN = 256


def _prompts(tokenizer, rank: int) -> list[list[int]]:  # noqa: ANN001
    """Chat-templated prompts with a system prompt, padded with random text tokens to PROMPT_LEN."""
    from spmdrl.data.prompts import encode, render_prompt

    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(2):
        filler = torch.randint(20, 500, (PROMPT_LEN,), generator=g).tolist()
        messages = [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Question {i}: " + tokenizer.decode(filler)},
        ]
        ids = encode(tokenizer, render_prompt(tokenizer, messages, where="test"))
        out.append(ids[-PROMPT_LEN:] if len(ids) > PROMPT_LEN else ids)
    return out


@torch.no_grad()
def _mismatch(model, engine, prompts: list[list[int]], seed: int) -> dict[str, float]:  # noqa: ANN001
    from spmdrl.models.forward import policy_logprobs
    from spmdrl.rl.batch import pack_generations
    from spmdrl.rollout.engine import SamplingSpec

    gens = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=seed))
    batch = pack_generations(prompts, gens, pad_id=0)
    lp_BT, _ = policy_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT)
    model.reshard()
    return logprob_mismatch(lp_BT, batch.engine_logprobs_BT, batch.response_mask_BT)


@torch.no_grad()
def _perturb(model: torch.nn.Module, originals: list[torch.Tensor], seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    for p, orig in zip(model.parameters(), originals, strict=True):
        p.to_local().copy_(orig + torch.randn(orig.shape, generator=g) * scale)


@torch.no_grad()
def _make_end_of_turn_likely(model: torch.nn.Module, prompt: list[int], token: int) -> None:
    """Point the LM head's row of ``token`` along the final hidden state after ``prompt``, so greedy
    decoding answers ``token`` at once (a random model would almost never sample it)."""
    seen: list[torch.Tensor] = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0][0, -1].detach().clone()))
    model(input_ids=torch.tensor([prompt]))
    handle.remove()
    model.reshard()
    h = seen[0]
    head.weight.to_local()[token] = 40.0 * h / h.dot(h)  # its logit is 40, the others are O(1)


def _parity_worker(rank: int, world: int, dirs: dict[str, str]) -> dict[str, dict | str]:
    """Each family's figures, or the traceback of the family that failed (the others still run)."""
    import traceback

    from spmdrl.distributed.placement import Placement

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    results: dict[str, dict | str] = {}
    for family, model_dir in dirs.items():
        try:
            results[family] = _parity(mesh, rank, model_dir)
        except Exception:  # noqa: BLE001 - reported by that family's test
            results[family] = traceback.format_exc()
    return results


def _parity(mesh: DeviceMesh, rank: int, model_dir: str) -> dict:
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.load import load_tokenizer
    from spmdrl.rollout.engine import SamplingSpec, build_engine
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights

    tok = load_tokenizer(Path(model_dir))
    prompts = _prompts(tok, rank)
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    originals = [p.to_local().clone() for p in model.parameters()]
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=16, seed=0),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    try:
        out: dict = {"dtype": str(engine.dtype), "end_of_turn_ids": list(engine.end_of_turn_ids)}
        out["fresh"] = _mismatch(model, engine, prompts, seed=1)
        for round_ in range(2):
            _perturb(model, originals, seed=10 * round_ + rank)
            out[f"stale{round_}"] = _mismatch(model, engine, prompts, seed=2)
            stats = sync_weights(model, engine, bucket_mb=0.5, check=SyncCheck(seed=round_))
            out[f"checked{round_}"] = stats.checked_groups
            out[f"synced{round_}"] = _mismatch(model, engine, prompts, seed=3)
        # A response ends at the template's end-of-turn token (Llama 3's <|eot_id|>, Gemma's
        # <end_of_turn>), also where the checkpoint's generation config does not list it.
        turn_end = (engine.end_of_turn_ids or [tok.eos_token_id])[0]
        _make_end_of_turn_likely(model, prompts[0], turn_end)
        sync_weights(model, engine, check=SyncCheck(seed=5))
        greedy = engine.generate(prompts[:1], SamplingSpec(n=1, temperature=0.0, max_tokens=8, seed=0))[0]
        out["turn_end"] = turn_end
        out["greedy"] = (greedy.token_ids, greedy.finish_reason)
        return out
    finally:
        engine.close()  # also when a check raises: the next family builds its engine here


def _family_dir(tmp_path: Path, family: str, tied: bool) -> str:
    return str(save_family_model(tmp_path / f"{family}-{'tied' if tied else 'untied'}", family, tied=tied))


def _tie_variants(family: str) -> tuple[bool, bool]:
    """(tied for the parity test, tied for the GRPO run): the family's usual layout in one, the other
    layout in the other, so both are covered with one engine per test (Gemma 2 is tied in both)."""
    spec = FAMILY_SPECS[family]
    return spec.tied_default, (not spec.tied_default) if spec.untied_ok else True


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict | str]:
    """Every family's parity figures, from two one-process workers side by side, half the families each:
    a process and its imports per family cost more than the family's check."""
    root = tmp_path_factory.mktemp("families")
    dirs = {f: _family_dir(root, f, _tie_variants(f)[0]) for f in FAMILIES}
    halves = [(dict(list(dirs.items())[i::2]),) for i in range(2)]
    runs = run_side_by_side(_parity_worker, 1, halves, timeout_s=900, env=VLLM_ENV)
    return {f: out for (run,) in runs for f, out in run.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_trainer_after_a_checked_sync(parity: dict[str, dict | str], family: str) -> None:
    out = parity[family]
    assert isinstance(out, dict), f"{family}: the parity worker failed:\n{out}"
    label = "tied" if _tie_variants(family)[0] else "untied"
    where = f"{family} {label} ({out['dtype']} engine)"
    # fp32 trainer against the engine on the same weights: kernel rounding (bf16 engines more).
    tol = 0.02 if "bfloat16" in out["dtype"] else 2e-3
    assert out["fresh"]["logprob_abs_diff_mean"] < tol, (where, out["fresh"])
    for r in range(2):
        assert out[f"stale{r}"]["logprob_abs_diff_mean"] > 10 * tol, (where, r, out[f"stale{r}"])
        assert out[f"synced{r}"]["logprob_abs_diff_mean"] < tol, (where, r, out[f"synced{r}"])
        # Both decoder layers' matrices (two input sizes each) and vectors, the top's matrices and vectors.
        assert out[f"checked{r}"] >= 2 * 3 + 2, (where, out[f"checked{r}"])
    spec = FAMILY_SPECS[family]
    if spec.end_of_turn:
        # The engine stops on the template's end-of-turn token, which is not the eos.
        assert len(out["end_of_turn_ids"]) == 1, (where, out["end_of_turn_ids"])
    else:
        assert out["end_of_turn_ids"] == [], (where, out["end_of_turn_ids"])
    # Greedy decoding's first token is the end of the turn, and the response ends there (with it).
    assert out["greedy"] == ([out["turn_end"]], "stop"), (where, out["greedy"])


# ---- a real run: two GRPO steps on 2 processes, its checkpoint and its export ------------------------


def _train(tmp_path: Path, model_dir: str, recipe: str, *overrides: str) -> Path:
    from spmdrl.testing.launch import torchrun

    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            f"recipe={recipe}",
            f"model.path={model_dir}",
            f"trainer.output_dir={out}",
            # The fastest settings that still run every phase: no warm-start, no validation, 2 steps of
            # 4 prompts x 2 samples; prompts in these templates are longer than ChatML's.
            "warmstart.enabled=false",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "tiny_task.num_train=64",
            "tiny_task.num_test=8",
            "trainer.global_batch_size=4",
            "rollout.n=2",
            "rollout.cpu_kvcache_gib=0.25",
            "trainer.micro_batch_size=8",
            "data.max_prompt_length=96",
            "data.max_response_length=16",
            "logging.samples_every=0",
            # A random model earns no reward, so every advantage is 0; the entropy bonus keeps a gradient.
            "algorithm.entropy_coeff=0.01",
            *overrides,
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env={"SPMDRL_CACHE": str(tmp_path / "cache"), **VLLM_ENV},
    )
    assert res.returncode == 0, res.output[-5000:]
    return out


def _read_metrics(out: Path) -> list[dict]:
    from spmdrl.logging.metrics import read_metrics

    return [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]


@torch.no_grad()
def _check_export(export: Path, checkpoint: Path, tmp_path: Path) -> None:
    """The export transformers loads gives the trainer's logits, and the sharded checkpoint exported on
    one process gives the same tensors bit for bit (the checkpoint round trip)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from spmdrl.checkpoint.export import export_checkpoint
    from spmdrl.models.build import attention_kwargs, read_safetensors
    from spmdrl.models.experts import to_model_layout

    config = AutoConfig.from_pretrained(export)
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, **attention_kwargs(config))
    # The trainer's model: the same class from the config, the checkpoint's tensors as spmdrl loads them.
    trainer = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention_kwargs(config))
    # (A mixture of experts' export holds each expert's matrices; the model's experts are fused.)
    missing, unexpected = trainer.load_state_dict(to_model_layout(read_safetensors(export)), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if config.tie_word_embeddings:
        trainer.tie_weights()
    ids = torch.randint(3, 500, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(input_ids=ids).logits, trainer(input_ids=ids).logits, rtol=0, atol=1e-5)

    export_checkpoint(checkpoint, tmp_path / "from_checkpoint")
    a, b = (
        load_file(export / "model.safetensors"),
        load_file(tmp_path / "from_checkpoint" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_steps_checkpoint_and_export(tmp_path: Path, family: str) -> None:
    tied = _tie_variants(family)[1]
    model_dir = _family_dir(tmp_path, family, tied)
    out = _train(tmp_path, model_dir, "grpo_tiny")
    rows = _read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
        # Every step's sync was checked (a failed check stops the run) and the engine served the
        # trainer's weights: a bf16-vs-fp32 gap, not a stale model's.
        assert 0 < r["timing/weight_sync_check_s"] <= r["timing/weight_sync_s"]
        assert r["mismatch/logprob_abs_diff_mean"] < 0.05, r["mismatch/logprob_abs_diff_mean"]
    assert json.loads((out / "hf_model" / "config.json").read_text())["tie_word_embeddings"] == tied
    _check_export(out / "hf_model", out / "checkpoints" / "step-2", tmp_path)


def test_ppo_step_with_a_critic_on_llama(tmp_path: Path) -> None:
    """PPO's critic is transformers' token-classification class of the family (LlamaForTokenClassification),
    started from the actor's backbone; it trains and is exported next to the actor."""
    from safetensors.torch import load_file

    model_dir = _family_dir(tmp_path, "llama3", tied=False)
    # A random model earns nothing from the task's reward, and a critic fitting all-zero returns with a
    # zero head has no gradient: score responses by their length instead.
    (tmp_path / "by_length.py").write_text(
        "def score(response, ground_truth, *, data_source, extra_info):\n    return len(response) % 3 / 2\n"
    )
    out = _train(
        tmp_path,
        model_dir,
        "ppo_tiny",
        "critic.warmup_steps=0",
        f"reward.fn={tmp_path / 'by_length.py'}:score",
    )
    rows = _read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["critic/vf_loss"]) and math.isfinite(r["actor/pg_loss"])
        assert r["critic/grad_norm"] > 0
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(out / "critic_hf_model")
    assert type(critic).__name__ == "LlamaForTokenClassification" and critic.config.num_labels == 1
    # The export says what it holds: vLLM and AutoModel read the class from architectures.
    assert json.loads((out / "critic_hf_model" / "config.json").read_text())["architectures"] == [
        "LlamaForTokenClassification"
    ]
    assert json.loads((out / "hf_model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert float(load_file(out / "critic_hf_model" / "model.safetensors")["score.weight"].abs().sum()) > 0


def test_an_unsupported_architecture_stops_the_run_before_any_model(tmp_path: Path) -> None:
    from spmdrl.testing.launch import torchrun

    model_dir = Path(_family_dir(tmp_path, "qwen2", tied=True))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["Phi3ForCausalLM"], model_type="phi3")
    (model_dir / "config.json").write_text(json.dumps(config))
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"model.path={model_dir}",
            f"trainer.output_dir={tmp_path}/r",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
    )
    assert res.returncode != 0
    assert "Phi3ForCausalLM" in res.output and "supported architectures: LlamaForCausalLM" in res.output
    assert "built " not in res.output and "building vLLM" not in res.output and "SFT" not in res.output
