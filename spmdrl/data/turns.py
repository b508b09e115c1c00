"""Turn boundaries as token ids: what goes between the model's sampled turns in a multi-turn rollout.

A multi-turn trajectory is ``prompt ids + sampled ids + observation ids + sampled ids + ...``. The
sampled ids are the engine's, never decoded and re-encoded (re-encoding can merge or split tokens
differently, and the trainer would then score tokens the engine never sampled). Everything else, the
tool results and the chat template's turn boundaries around them, is *observation*: tokens with loss
mask 0, written here, in one place for every model family.

How the observation ids are found: the tokenizer's own chat template renders a reference conversation
twice, ``[user, assistant]`` and ``[user, assistant, *tool messages]`` with the generation prompt, and
the observation is the text the second adds after the assistant's end-of-turn token:

- ChatML (Qwen2.5, Qwen3; the built-in tiny model): the assistant's turn ends with ``<|im_end|>``
  (sampled, mask 1); the observation is ``"\\n<|im_start|>user\\n<tool_response>\\n...``
  ``</tool_response><|im_end|>\\n<|im_start|>assistant\\n"`` (Qwen's templates put tool results in a
  user turn; consecutive tool messages share it).
- Llama 3.1: the turn ends with ``<|eot_id|>`` (or ``<|eom_id|>`` after a tool call); the observation
  is ``"<|start_header_id|>ipython<|end_header_id|>\\n\\n...<|eot_id|><|start_header_id|>assistant"``
  ``"<|end_header_id|>\\n\\n"``.

A vision-language model's tools may return images (:class:`Observation`): a tool message's content is
then a list of parts (transformers' multimodal chat format), ``{"type": "image", "image": <PIL image>}``
and ``{"type": "text", "text": ...}``, and the template writes its image placeholder for each image part.
The observation then has two forms, as an image prompt has (spmdrl.data.vision): the engine's, one
placeholder per image (vLLM expands it), and the trainer's, each image expanded to its tokens by the
model's processor, with the images' pixel values.

The end-of-turn tokens a family uses are listed in :data:`END_OF_TURN_TOKENS`; the text around them
comes from the template, so a model with its own template needs no code here. A template whose earlier
turns render differently once later turns exist (the check in :meth:`TurnCodec.observation_ids`) is
refused with an error, since the trajectory the trainer sees would not be the one the engine saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spmdrl.data.vision import ImageInputs

# Tokens that end an assistant turn, by family: the engine stops on them (they are the tokenizer's
# eos or listed in generation_config.eos_token_id) and the observation starts right after them.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML: Qwen2.5, Qwen3
    "<|eot_id|>",  # Llama 3.x
    "<|eom_id|>",  # Llama 3.1, after a built-in tool call
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
)

# The reference conversation rendered to find the boundaries; its text never reaches a trajectory.
_PROBE_USER = "Q"
_PROBE_ASSISTANT = "A"


@dataclass(frozen=True)
class Observation:
    """What an env's messages add to a trajectory between two sampled turns (loss mask 0 on all of it)."""

    ids: list[int]  # as the trainer scores them: each image expanded to its tokens
    engine_ids: list[int]  # as the engine takes them: one placeholder per image (the same ids without images)
    images: list[Any] = field(default_factory=list)  # PIL images, in order, for the engine
    pixels: ImageInputs | None = None  # the same images as the trainer's forward takes them (one row)


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The images of ``messages``' image parts, in order."""
    images = []
    for m in messages:
        if isinstance(m["content"], str):
            continue
        for part in m["content"]:
            if part.get("type") != "image":
                continue
            if part.get("image") is None:
                raise TemplateError(
                    f"a {m['role']!r} message has an image part without its image: write "
                    "{'type': 'image', 'image': <PIL image>} (spmdrl.tools.ToolCallOutcome.message does)"
                )
            images.append(part["image"])
    return images


def _template_form(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` as the chat template reads it: an image part without its image (the template writes a
    placeholder for it)."""
    content = message["content"]
    if isinstance(content, str):
        return dict(message)
    parts = [{"type": "image"} if p.get("type") == "image" else dict(p) for p in content]
    return {**message, "content": parts}


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact multi-turn rollouts."""


class TurnCodec:
    """Observation ids for one tokenizer (and its chat template), and which ids end a turn."""

    def __init__(
        self, tokenizer: Any, *, tools: Sequence[Mapping[str, Any]] | None = None, processor: Any = None
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        # A vision-language model's processor (spmdrl.models.load.load_processor): observations with images.
        self.processor = processor
        vocab = tokenizer.get_vocab()
        self.end_ids: set[int] = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        if tokenizer.eos_token_id is not None:
            self.end_ids.add(int(tokenizer.eos_token_id))
        self._end_texts = [t for t in END_OF_TURN_TOKENS if t in vocab]
        if tokenizer.eos_token and tokenizer.eos_token not in self._end_texts:
            self._end_texts.append(tokenizer.eos_token)
        if not self._end_texts:
            raise TemplateError(
                "the tokenizer has no eos token and none of the known end-of-turn tokens "
                f"({', '.join(END_OF_TURN_TOKENS)}): a multi-turn rollout cannot tell where a turn ends"
            )
        base = self._render(self._probe(), generation_prompt=False)
        self._prefix = base[: self._cut(base)]
        self._cache: dict[tuple[tuple[str, str], ...], list[int]] = {}

    def _probe(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )
        except Exception as e:  # no template, or a template that rejects the probe
            raise TemplateError(
                f"the tokenizer's chat template could not render a tool turn ({type(e).__name__}: {e}); "
                "multi-turn rollouts need a chat template that renders role 'tool' messages"
            ) from e
        return str(text)

    def _cut(self, base: str) -> int:
        """Where the probe's assistant turn ends in ``base``: just after its end-of-turn token."""
        start = base.rfind(_PROBE_ASSISTANT)
        ends = [(base.find(t, start), t) for t in self._end_texts]
        ends = [(i, t) for i, t in ends if i >= 0]
        if start < 0 or not ends:
            raise TemplateError(
                "the chat template does not end an assistant turn with an end-of-turn token "
                f"({', '.join(self._end_texts)}); rendered: {base[-200:]!r}"
            )
        i, t = min(ends)
        # The token this template ends an assistant turn with: the rollout stops a turn on it and a
        # multi-turn SFT demonstration ends each turn with it (a base tokenizer's eos may differ).
        self.turn_end_id = int(self.tokenizer.convert_tokens_to_ids(t))
        return i + len(t)

    def observation_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids between an assistant turn's end-of-turn token and the next assistant turn's first
        sampled token, for these messages (``{"role": "tool", "content": ...}``, or a user turn)."""
        key = tuple((str(m["role"]), str(m["content"])) for m in messages)
        hit = self._cache.get(key)
        if hit is not None:
            return list(hit)
        ids = list(self.tokenizer.encode(self._observation_text(messages), add_special_tokens=False))
        if len(self._cache) < 4096:  # tool outputs repeat (errors, small results); bounded anyway
            self._cache[key] = ids
        return list(ids)

    def observation(self, messages: Sequence[Mapping[str, Any]]) -> Observation:
        """What ``messages`` add between two sampled turns, in the engine's and the trainer's forms; with
        image parts, the template's placeholder for each and the processor's expansion and pixel values.
        Raises TemplateError for image parts without a processor (a text model)."""
        images = message_images(messages)
        if not images:
            ids = self.observation_ids([_template_form(m) for m in messages])  # type: ignore[misc]
            return Observation(ids, ids)
        if self.processor is None:
            raise TemplateError(
                f"an observation has {len(images)} image(s) but the model is a text model (no processor "
                "takes images); image observations need a vision-language model"
            )
        from spmdrl.data.vision import encode_prompt

        text = self._observation_text([_template_form(m) for m in messages])
        image_id = getattr(self.processor, "image_token_id", None)
        if isinstance(image_id, int):
            placed = self.tokenizer.encode(text, add_special_tokens=False).count(image_id)
            if placed != len(images):
                raise TemplateError(
                    f"the chat template wrote {placed} image placeholder(s) for an observation of "
                    f"{len(images)} image(s): it must write one per {{'type': 'image'}} part of a tool or "
                    "user message"
                )
        encoded = encode_prompt(self.processor, text, images)
        return Observation(encoded.token_ids, encoded.engine_ids, encoded.images, encoded.pixels)

    def _observation_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        full = self._render(self._probe() + [dict(m) for m in messages], generation_prompt=True)
        prefix = self._prefix
        if not full.startswith(prefix):
            raise TemplateError(
                "the chat template renders earlier turns differently once a tool turn follows, so a "
                "trajectory's ids would not be a prefix of the next turn's prompt; rendered "
                f"{prefix[-120:]!r} then {full[: len(prefix)][-120:]!r}"
            )
        return full[len(prefix) :]

    def generation_prompt_ids(self) -> list[int]:
        """The ids an assistant turn starts with (``<|im_start|>assistant\\n``), for checks and tests."""
        probe = self._probe()[:1]
        without = self._render(probe, generation_prompt=False)
        with_prompt = self._render(probe, generation_prompt=True)
        return list(self.tokenizer.encode(with_prompt[len(without) :], add_special_tokens=False))


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The token the chat template closes an assistant message with, when it is not the tokenizer's eos
    (Llama 3's ``<|eot_id|>`` beside ``<|end_of_text|>``, Gemma's ``<end_of_turn>`` beside ``<eos>``);
    empty when it is the eos (ChatML instruct, Mistral) or the template shows none.

    A response ends there: the engine stops on it (vLLM itself stops only on the eos and on
    generation_config.json's ``eos_token_id``, which a checkpoint may not list it in), and an SFT
    demonstration ends with it (spmdrl.data.sft), so a warm-started model learns the token rollouts stop on.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    try:
        end = TurnCodec(tokenizer).turn_end_id
    except TemplateError:
        return []
    return [] if end == tokenizer.eos_token_id else [end]
