"""Model creation in numbered steps: meta device -> parallelize -> materialize -> load weights.

No rank ever holds a full randomly initialized copy: parameters are created on the meta device,
sharded by FSDP2, materialized shard by shard, then filled from the safetensors files.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from spmdrl.errors import ConfigError
from spmdrl.models.config import LoraConfig, ModelConfig, ac_mode
from spmdrl.models.expert_parallel import apply_ep
from spmdrl.models.experts import is_fused, to_model_layout
from spmdrl.models.families import lora_on_moe_message
from spmdrl.models.lora import apply_lora, initial_adapter_weights
from spmdrl.models.memory_model import whole_model_unit
from spmdrl.models.parallelize import apply_ac, apply_autocast, apply_compile, apply_fsdp

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA and float32 on CPU (CPU bf16 matmuls are slow and lossy for tiny models)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    # model.activation_checkpointing: off / full / mlp, or true / false (full / off); on every
    # ac_every-th decoder layer (spmdrl.models.parallelize.apply_ac).
    activation_checkpointing: str | bool = False
    ac_every: int = 1
    compile: bool = False  # model.compile: torch.compile per decoder block (apply_compile)
    trust_remote_code: bool = False
    train: bool = True
    # "lm": the causal LM (actor, reference). "value": the same backbone with a scalar value head per
    # token instead of the LM head (the critic), built from a causal-LM checkpoint or a critic's own.
    # "reward": one scalar per sequence (*ForSequenceClassification, num_labels=1: a reward model), from a
    # reward model's checkpoint or a causal LM's backbone (recipes/rm.py trains its head from 0).
    head: str = "lm"
    # FSDP2 CPU offload: the sharded parameters live in host memory (spmdrl.models.parallelize.apply_fsdp).
    offload: bool = False
    # LoRA adapters (spmdrl.models.lora): only they train. None: every weight trains (or none, frozen).
    lora: LoraConfig | None = None
    # model.fsdp_unit: auto / layer / model (resolved in parallelize, where the mesh is known), or none (no
    # FSDP2: the bare module under autocast, one-rank meshes only).
    fsdp_unit: str = "auto"
    # A vision-language model's vision tower and connector frozen (model.freeze_vision_tower).
    freeze_vision_tower: bool = True


def model_spec(
    cfg: ModelConfig, path: Path, device: torch.device, *, train: bool, head: str = "lm"
) -> ModelSpec:
    """The ModelSpec for ``cfg`` (dtypes resolved for ``device``); frozen models skip activation checkpointing.

    A trained model is offloaded under ``offload_params``, a frozen one (the reference) under ``offload_ref``.
    ``model.lora`` adapts a trained causal LM (the actor, an SFT model), never the reference or a critic.
    """
    return ModelSpec(
        path=path,
        param_dtype=resolve_dtype(cfg.param_dtype, device),
        reduce_dtype=resolve_dtype(cfg.reduce_dtype, device),
        activation_checkpointing=ac_mode(cfg.activation_checkpointing) if train else "off",
        ac_every=cfg.activation_checkpointing_every,
        compile=cfg.compile and train,
        trust_remote_code=cfg.trust_remote_code,
        train=train,
        head=head,
        offload=cfg.offload_params if train else cfg.offload_ref,
        lora=cfg.lora if cfg.lora.enabled and train and head == "lm" else None,
        fsdp_unit=cfg.fsdp_unit,
        freeze_vision_tower=cfg.freeze_vision_tower,
    )


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real.

    Non-persistent buffers (rotary inv_freq) are not in the checkpoint, so they must be computed
    by the module's own __init__; building everything on meta would leave them as garbage after
    ``to_empty``. Parameters are the memory that matters.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # Already-meta params are kept as the same object so that weight tying (a setattr) survives.
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the directory's *.safetensors files (memory-mapped; pages load on first touch)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[k] = sf.get_tensor(k)
    return tensors


def parallelize(
    model: nn.Module, spec: ModelSpec, mesh: DeviceMesh, experts_mesh: DeviceMesh | None = None
) -> None:
    """Step 2 of :func:`build_fsdp_model`, on a model still on the meta device: activation checkpointing
    inside, then torch.compile per block, FSDP2 outside (torchtitan's order); model.fsdp_unit=none, autocast
    instead of FSDP2 (one-rank meshes only: spec_whole_model refuses others). Its own function so that a
    benchmark building a model of random weights (benchmarks/update_profile.py) runs the same steps.

    ``experts_mesh`` (parallel.ep > 1, spmdrl.distributed.placement.Meshes.experts): expert parallelism first,
    on the bare modules (spmdrl.models.expert_parallel.apply_ep), then FSDP2 over both meshes."""
    if experts_mesh is not None:
        apply_ep(model, experts_mesh["ep"])
    if ac_mode(spec.activation_checkpointing) != "off":
        apply_ac(model, ac_mode(spec.activation_checkpointing), every=spec.ac_every)
    if spec.compile:
        apply_compile(model)
    whole = spec_whole_model(spec, model, mesh)  # under none: refuses a mesh of several ranks (ConfigError)
    if spec.fsdp_unit == "none":
        apply_autocast(model, spec.param_dtype, mesh.device_type)
        return
    apply_fsdp(
        model,
        mesh,
        param_dtype=spec.param_dtype,
        reduce_dtype=spec.reduce_dtype,
        offload=spec.offload,
        whole_model=whole,
        experts_mesh=experts_mesh,
    )


def spec_whole_model(spec: ModelSpec, model: nn.Module, mesh: DeviceMesh) -> bool:
    """model.fsdp_unit for this model on ``mesh`` (spmdrl.models.memory_model.whole_model_unit; the token
    budgets resolve the actor's the same way, from the card's total memory)."""
    total = torch.cuda.mem_get_info()[1] if mesh.device_type == "cuda" else None
    return whole_model_unit(
        spec.fsdp_unit,
        mesh_ranks=mesh.size(),
        params=sum(p.numel() for p in model.parameters()),
        compute_bytes=spec.param_dtype.itemsize,
        trained=spec.train,
        total_bytes=total,
    )


def materialize(
    model: nn.Module,
    spec: ModelSpec,
    device: torch.device,
    buffers: list[tuple[nn.Module, str, torch.Tensor]],
) -> None:
    """Step 3 of :func:`build_fsdp_model`, after parallelize: each rank allocates its shards (uninitialized)
    on ``device``, in host memory when offloaded (FSDP2 copies each unit's shards over for its compute);
    ``buffers`` ((module, name, value), taken before parallelize) get their computed values back on the
    compute device either way, where the forward reads them (they are not FSDP2's to manage)."""
    model.to_empty(device=torch.device("cpu") if spec.offload else device)
    # A bare module's (model.fsdp_unit=none) tied LM head got a tensor of its own from to_empty, which
    # replaces each module's parameters one by one; FSDP2's keep the one DTensor. Tied again here.
    if spec.fsdp_unit == "none":
        model.tie_weights()
    with torch.no_grad():
        for mod, name, value in buffers:
            mod._buffers[name] = value.to(device)


def build_fsdp_model(
    spec: ModelSpec, mesh: DeviceMesh, device: torch.device, experts_mesh: DeviceMesh | None = None
) -> nn.Module:
    """``experts_mesh``: the actor's experts mesh under parallel.ep > 1 (:func:`parallelize`), else None."""
    hf_config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    # 1. Build on meta: the architecture without memory.
    if spec.head not in ("lm", "value", "reward"):
        raise ValueError(f"ModelSpec.head must be 'lm', 'value' or 'reward', got {spec.head!r}")
    auto = causal_lm_class(hf_config)
    if is_vision_language(hf_config) and spec.head != "lm":
        raise ConfigError(
            f"{spec.path} is a vision-language model ({type(hf_config).__name__}); spmdrl builds no critic or "
            "reward model on one (docs/models.md#vision-language-models): use a text model for critic.model_path "
            "or the reward model"
        )
    if spec.head == "value":
        # One output per token, no dropout (values must be deterministic); verl's critic is the same class.
        hf_config.num_labels, hf_config.classifier_dropout = 1, 0.0
        auto = AutoModelForTokenClassification
    elif spec.head == "reward":  # one scalar per sequence, no dropout (scores must be deterministic)
        hf_config.num_labels, hf_config.classifier_dropout = 1, 0.0
        auto = AutoModelForSequenceClassification
    with _params_on_meta():
        model = auto.from_config(
            hf_config,
            trust_remote_code=spec.trust_remote_code,
            dtype=torch.float32,
            **attention_kwargs(hf_config),
        )
    # The class actually built, for the config that checkpoints and exports write: a critic built from a
    # causal LM's config would otherwise be exported as that causal LM (and misread by vLLM or AutoModel).
    model.config.architectures = [type(model).__name__]
    # What the HF export writes under trainer.export_dtype=auto (spmdrl.checkpoint.export.train_dtype).
    model.spmdrl_param_dtype = spec.param_dtype
    # 1b. LoRA: adapters around the target linears, everything else frozen, before FSDP2 reads requires_grad.
    if spec.lora is not None:
        if any(is_fused(n) for n, _ in model.named_parameters()):
            raise ConfigError(lora_on_moe_message(f"{spec.path} ({type(model).__name__})"))
        adapted = apply_lora(model, spec.lora)
        log.info("LoRA rank %d, alpha %g on %d linear modules", spec.lora.rank, spec.lora.alpha, len(adapted))
    # A trained model's sharded params are the fp32 master copy; FSDP2 casts to param_dtype for compute.
    # Keep (owner module, name, value) rather than dotted names: activation checkpointing renames paths.
    buffers = [
        (mod, name, buf.detach().clone())
        for mod in model.modules()
        for name, buf in mod.named_buffers(recurse=False)
    ]
    # 1c. A frozen model (the reference) needs no fp32 master copy: its shards are stored in param_dtype, the
    # dtype FSDP2 would otherwise cast them to at every forward (the same rounding, once, at load): in bf16
    # half the memory and no cast per forward. Buffers (rotary frequencies) keep their values, set below.
    if not spec.train and spec.param_dtype != torch.float32:
        model.to(spec.param_dtype)
    elif spec.lora is not None and spec.param_dtype != torch.float32:
        # LoRA: the frozen base is never updated either, so it is stored the same way; only the adapters
        # keep a float32 master copy. FSDP2 gathers both in param_dtype (the same values as casting a float32
        # base at every forward). In place (``.data``), so that tied weights stay one tensor.
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(spec.param_dtype)
    # 1d. A frozen vision tower: before FSDP2, which reads requires_grad when it groups the parameters.
    if spec.train and spec.freeze_vision_tower and is_vision_language(hf_config):
        frozen = freeze_vision_tower(model)
        log.info("vision tower frozen: %s", ", ".join(frozen))
    # 2. Parallelize: activation checkpointing inside, then compile, FSDP2 outside.
    parallelize(model, spec, mesh, experts_mesh)
    # 3. Materialize: each rank allocates only its shards; buffers get their computed values back.
    materialize(model, spec, device, buffers)
    # 4. Load weights: each rank reads the (memory-mapped) files and keeps its own slices.
    state = read_safetensors(spec.path)
    new_head: list[str] = []
    if spec.head in ("value", "reward"):
        # From a causal-LM checkpoint: its LM head has no place here, and the value head starts at 0, so
        # the first values are 0 (a neutral baseline) rather than random.
        state.pop("lm_head.weight", None)
        # (A sequence-classification head has no bias.)
        names = {n.replace("._checkpoint_wrapped_module", "") for n, _ in model.named_parameters()}
        new_head = [k for k in VALUE_HEAD_KEYS if k not in state and k in names]
        state.update({k: torch.zeros_like(_full_shape_tensor(model, k)) for k in new_head})
    if spec.lora is not None:  # the adapters are not in the base checkpoint: B = 0 starts at the base model
        state.update(initial_adapter_weights(model, seed=0))
    # A mixture-of-experts checkpoint stores each expert's matrices; transformers' model fuses them.
    state = to_model_layout(state)
    _check_keys(model, state, spec.path)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    if new_head:
        log.info("value head %s initialized to 0 (not in %s)", new_head, spec.path)
    if is_vision_language(hf_config):  # its image tokens are never sampled (spmdrl.models.head.BANNED_TOKENS)
        from spmdrl.data.vision import image_token_ids
        from spmdrl.models.head import BANNED_TOKENS
        from spmdrl.models.load import load_processor

        banned = image_token_ids(load_processor(spec.path, spec.trust_remote_code))
        setattr(model, BANNED_TOKENS, torch.tensor(banned, dtype=torch.long, device=device))
    # Training never decodes incrementally; HF's KV cache would only cost memory, and under
    # activation checkpointing the recomputed forward would append to it a second time.
    model.config.use_cache = False
    model.train(spec.train)
    if not spec.train:
        model.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "built %s from %s: %.2fM parameters, %.2fM trained",
        type(model).__name__,
        spec.path,
        n_params / 1e6,
        n_train / 1e6,
    )
    return model


def is_vision_language(hf_config: object) -> bool:
    """Whether the config is a vision-language model's (a vision tower beside the decoder)."""
    return getattr(hf_config, "vision_config", None) is not None


def causal_lm_class(hf_config: object) -> type:
    """transformers' auto class of the generating model: the causal LM, or for a vision-language model the
    image-text-to-text class (Idefics3ForConditionalGeneration), which takes the images beside the tokens."""
    return AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM


# A vision-language model's modules outside the decoder, frozen by model.freeze_vision_tower: the tower and
# the projection of its features into the decoder's width (Idefics3's names).
VISION_MODULES = ("vision_model", "connector")


def freeze_vision_tower(model: nn.Module) -> list[str]:
    """requires_grad off on the vision tower and its connector; the names of the modules frozen."""
    inner = model.model
    frozen = [name for name in VISION_MODULES if getattr(inner, name, None) is not None]
    for name in frozen:
        getattr(inner, name).requires_grad_(False)
    return frozen


def attention_kwargs(hf_config: object) -> dict[str, str]:
    """transformers' attention implementation for this config, where its default is wrong.

    Gemma 2 soft-caps attention scores (``attn_logit_softcapping``); transformers' SDPA path (its default)
    silently drops the cap, which the engine applies, so the trainer would score another model than the
    one that sampled. Eager attention applies it."""
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        return {"attn_implementation": "eager"}
    return {}


def build_meta_model(spec: ModelSpec) -> nn.Module:
    """The architecture on the meta device: names, shapes and tied weights, no memory. Under a split
    placement the critic ranks hold this copy of the actor to receive its weights (weight_sync.Fanout)."""
    hf_config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    with torch.device("meta"):
        return causal_lm_class(hf_config).from_config(
            hf_config, trust_remote_code=spec.trust_remote_code, dtype=torch.float32
        )


# The critic's value head (Qwen2ForTokenClassification and its siblings call it score).
VALUE_HEAD_KEYS = ("score.weight", "score.bias")


def _full_shape_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """A CPU tensor of the full (unsharded) shape of parameter ``name``."""
    p = dict(model.named_parameters())[name]
    return torch.empty(p.shape, dtype=torch.float32)


def _check_keys(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Fail loudly on a checkpoint that does not fit the architecture (a silent partial load trains garbage)."""
    expected = {k.replace("._checkpoint_wrapped_module", "") for k in model.state_dict()}
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise ValueError(f"{path}: checkpoint tensors the model does not have: {unexpected[:8]}")
    missing = sorted(expected - set(state))
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"{path}: model weights missing from the checkpoint: {missing[:8]}")
