"""The RL batch of one rank: prompt + response rows and their per-token quantities, and how it is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmdrl.data.vision import ImageInputs
from spmdrl.rollout.engine import Generation

# Router replay's routing on a wire of (rows, width) tensors (spmdrl.distributed.exchange): each row's
# (T, layers, k) experts flattened to T * layers * k and shifted by one (0: no choice, as the wire pads),
# and (layers, k) per row; one (B, 0) field and (0, 0) without replay. Flattened position by position, a
# row's positions past its own width arrive as 0, that is no choice.
ROUTED, ROUTED_SHAPE = "routed_experts", "routed_shape"


def pack_routed(routed_BTLK: torch.Tensor | None, B: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The rows' routed experts as the wire carries them (ROUTED, ROUTED_SHAPE)."""
    if routed_BTLK is None:
        return {
            ROUTED: torch.zeros(B, 0, dtype=torch.int16, device=device),
            ROUTED_SHAPE: torch.zeros(B, 2, dtype=torch.long, device=device),
        }
    _, T, L, K = routed_BTLK.shape
    return {
        ROUTED: (routed_BTLK.to(device=device, dtype=torch.int16) + 1).reshape(B, T * L * K),
        ROUTED_SHAPE: torch.tensor([L, K], dtype=torch.long, device=device).expand(B, 2).contiguous(),
    }


def unpack_routed(rows: Mapping[str, torch.Tensor], width: int) -> torch.Tensor | None:
    """The rows' routed experts, (B, width, layers, k), -1 where none; None when they travelled none."""
    shape = rows[ROUTED_SHAPE]
    flat = rows[ROUTED]
    if shape.shape[0] == 0:
        return None
    L, K = (int(x) for x in shape[0, :2].tolist())  # a fixed-width wire pads it
    if L * K == 0:
        return None
    B = flat.shape[0]
    wire = flat.new_zeros(B, width * L * K)
    n = min(flat.shape[1], width * L * K)
    wire[:, :n] = flat[:, :n]
    return (wire.view(B, width, L, K) - 1).to(torch.int16)


# A vision-language model's images on the same wire: each row's images (ImageInputs, in the row's order)
# flattened to count * C * H * W pixel values (IMAGES, in the pixels' dtype) and count * H * W
# pixel-attention-mask values (IMAGE_MASK, bool: one byte a pixel on the wire where the processor's int64
# took eight; back as int64, 0/1, on arrival; 0 wide when the images have none), with
# (count, C, H, W, has mask) per row (IMAGE_SHAPE); all three (B, 0) without images (a text model). A
# row's fields past its own images arrive as the wire pads them, 0, and are cut off by its count.
IMAGES, IMAGE_MASK, IMAGE_SHAPE = "image_pixels", "image_mask", "image_shape"


def pack_images(
    images: ImageInputs | None, B: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The rows' images as the wire carries them (IMAGES, IMAGE_MASK, IMAGE_SHAPE); ``dtype``: the
    pixels' when there are none (a fixed wire's)."""
    if images is None:
        return {
            IMAGES: torch.zeros(B, 0, dtype=dtype, device=device),
            IMAGE_MASK: torch.zeros(B, 0, dtype=torch.bool, device=device),
            IMAGE_SHAPE: torch.zeros(B, 0, dtype=torch.long, device=device),
        }
    if len(images.counts_B) != B:
        raise ValueError(f"images of {len(images.counts_B)} rows for {B} rows")
    pixels, mask = images.pixel_values_NCHW, images.pixel_attention_mask_NHW
    C, H, W = pixels.shape[1:]
    most = max(images.counts_B, default=0)
    flat = torch.zeros(B, most * C * H * W, dtype=pixels.dtype, device=device)
    flat_mask = torch.zeros(B, 0 if mask is None else most * H * W, dtype=torch.bool, device=device)
    start = 0
    for r, n in enumerate(images.counts_B):
        flat[r, : n * C * H * W] = pixels[start : start + n].reshape(-1).to(device)
        if mask is not None:
            flat_mask[r, : n * H * W] = mask[start : start + n].reshape(-1).to(device) != 0
        start += n
    shape = torch.tensor(
        [[n, C, H, W, int(mask is not None)] for n in images.counts_B], dtype=torch.long, device=device
    ).view(B, 5)
    return {IMAGES: flat, IMAGE_MASK: flat_mask, IMAGE_SHAPE: shape}


def unpack_images(rows: Mapping[str, torch.Tensor]) -> ImageInputs | None:
    """The rows' images (on the host, where a batch keeps them), in row order; None when they travelled
    none. Rows from different ranks agree on the image shape (one forward takes them all); a row whose
    images had no mask beside rows whose did gets an all-ones one (every pixel real, as no mask means)."""
    shape = rows[IMAGE_SHAPE]
    if shape.shape[1] == 0:
        return None
    shape = shape.cpu()
    counts = [int(n) for n in shape[:, 0].tolist()]
    with_images = [r for r, n in enumerate(counts) if n]
    if not with_images:
        C, H, W = (int(x) for x in shape[0, 1:4].tolist()) if shape.shape[0] and shape[0, 1] else (3, 1, 1)
        return ImageInputs(torch.zeros(0, C, H, W, dtype=rows[IMAGES].dtype), None, tuple(counts))
    shapes = {tuple(shape[r, 1:4].tolist()) for r in with_images}
    if len(shapes) != 1:
        raise ValueError(f"rows' images of different shapes {sorted(shapes)}: one forward cannot take them")
    C, H, W = (int(x) for x in shapes.pop())
    pixels, flat_mask = rows[IMAGES].cpu(), rows[IMAGE_MASK].cpu().long()
    has_mask = any(int(shape[r, 4]) for r in with_images)
    values, masks = [], []
    for r in with_images:
        n = counts[r]
        values.append(pixels[r, : n * C * H * W].reshape(n, C, H, W))
        if has_mask:
            own = int(shape[r, 4]) and flat_mask.shape[1] >= n * H * W
            masks.append(
                flat_mask[r, : n * H * W].reshape(n, H, W)
                if own
                else torch.ones(n, H, W, dtype=flat_mask.dtype)
            )
    return ImageInputs(torch.cat(values), torch.cat(masks) if has_mask else None, tuple(counts))


@dataclass(frozen=True)
class RolloutRows:
    """Prompt + response rows, right-padded. ``response_mask_BT`` marks the sampled tokens;
    ``engine_logprobs_BT`` holds the engine's logprob of each, at the token's own position."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    engine_logprobs_BT: torch.Tensor
    # Router replay: the experts the engine routed each position through, (B, T, MoE layers, k) int16,
    # -1 where none (padding, each row's last token); None unless the generations carry them.
    routed_experts_BTLK: torch.Tensor | None = None


def routed_experts_rows(
    rows: Sequence[int], generations: Sequence[Generation], T: int
) -> torch.Tensor | None:
    """The generations' routed experts as right-padded rows of ``T`` positions, (B, T, layers, k), -1 where
    none; None when no generation carries them. ``rows``: each row's tokens (prompt + response)."""
    have = [g.routed_experts is not None for g in generations]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"generations {[i for i, h in enumerate(have) if not h][:8]} carry no routed experts while "
            "others do (router replay needs every row's)"
        )
    L, K = generations[0].routed_experts.shape[1:]
    out = torch.full((len(generations), T, L, K), -1, dtype=torch.int16)
    for i, (n, g) in enumerate(zip(rows, generations, strict=True)):
        r = torch.as_tensor(g.routed_experts)
        if r.shape[1:] != (L, K):
            raise ValueError(
                f"generation {i}: routed experts of shape {tuple(r.shape)}, others (-, {L}, {K})"
            )
        m = min(n, r.shape[0])
        out[i, :m] = r[:m].to(torch.int16)
    return out


def pack_generations(
    prompts: Sequence[list[int]], generations: Sequence[Generation], pad_id: int
) -> RolloutRows:
    """One row per generation: its prompt (``prompts[g.prompt_index]``) followed by its response tokens;
    the response mask is the generation's loss mask (all ones for a single-turn response)."""
    rows = [list(prompts[g.prompt_index]) + list(g.token_ids) for g in generations]
    T = max((len(r) for r in rows), default=0)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    response = torch.zeros((B, T), dtype=torch.bool)
    engine_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, (row, g) in enumerate(zip(rows, generations, strict=True)):
        if len(g.logprobs) != len(g.token_ids):
            raise ValueError(
                f"generation {i} has {len(g.token_ids)} tokens but {len(g.logprobs)} logprobs "
                "(generate with SamplingSpec.logprobs=True)"
            )
        start = len(row) - len(g.token_ids)
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        if g.loss_mask is None:
            response[i, start : len(row)] = True
        elif len(g.loss_mask) != len(g.token_ids):
            raise ValueError(
                f"generation {i} has {len(g.token_ids)} tokens but {len(g.loss_mask)} loss-mask values"
            )
        else:
            # Multi-turn: only the sampled tokens; tool output and turn boundaries are context.
            response[i, start : len(row)] = torch.tensor(g.loss_mask, dtype=torch.bool)
        engine_lp[i, start : len(row)] = torch.tensor(g.logprobs, dtype=torch.float32)
    routed = routed_experts_rows([len(r) for r in rows], generations, T)
    return RolloutRows(input_ids, attention, response, engine_lp, routed)


@dataclass(frozen=True)
class PolicyBatch:
    """Right-padded rows; every ``_BT`` tensor is indexed at the token's own position.

    ``response_mask_BT`` marks sampled tokens (the only ones the loss sees). ``old_logprobs_BT`` is the
    policy's logprobs before the update (PPO's "old" policy) when they were computed by a separate
    pass; None means on-policy: the update's own first forward is the old policy.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    engine_logprobs_BT: torch.Tensor
    advantages_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    # On-policy distillation: the teacher's logprobs of the sampled tokens (teacher.*).
    teacher_logprobs_BT: torch.Tensor | None = None
    # Rollout-correction importance weights (detached), multiplied into the per-token policy loss.
    is_weights_BT: torch.Tensor | None = None
    # PPO with a critic: the critic's values before the update (at each token's position: the value of
    # the state the token was sampled in) and the returns it is trained towards.
    values_BT: torch.Tensor | None = None
    returns_BT: torch.Tensor | None = None
    # The reward of each sequence at its last sampled token, 0 elsewhere (before any KL penalty).
    token_rewards_BT: torch.Tensor | None = None
    # The old policy's sum over the vocabulary of its squared probabilities at each token (the optimal
    # token baseline's input; computed with the old logprobs when the estimator needs it).
    sum_pi_squared_BT: torch.Tensor | None = None
    # Router replay (model.router_replay=r3): the experts the engine routed each position through,
    # (B, T, MoE layers, k) int16, -1 where none; the trainer's forwards route by them
    # (spmdrl.models.router_replay).
    routed_experts_BTLK: torch.Tensor | None = None
    # A vision-language model's images of the rows, in row order (spmdrl.data.vision): every forward of
    # these rows takes them. Not a tensor field: it follows the rows through every selection below.
    images: ImageInputs | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids_BT.shape[0]

    def rows(self, start: int, stop: int) -> PolicyBatch:
        """Rows [start, stop), trimmed to their longest sequence (less padding per micro-batch)."""
        width = int(self.attention_mask_BT[start:stop].sum(dim=1).max())
        return self._map(lambda t: t[start:stop, :width], range(start, stop))

    def to(self, device: torch.device) -> PolicyBatch:
        return self._map(lambda t: t.to(device))

    def replace(self, **tensors: torch.Tensor | None) -> PolicyBatch:
        return dataclasses.replace(self, **tensors)

    def first_response_column(self) -> int:
        """The first column any row samples a token in (logprobs before it are never needed)."""
        cols = torch.nonzero(self.response_mask_BT.any(dim=0)).flatten()
        return int(cols[0]) if cols.numel() else self.input_ids_BT.shape[1]

    def take(self, index_B: torch.Tensor, width: int | None = None) -> PolicyBatch:
        """The rows at ``index_B``, trimmed to their longest sequence (a micro-batch).

        ``width``: that longest sequence when the caller knows it from host-side lengths
        (:class:`RowLengths`); without it, it is read from the device (a sync on a GPU), and so is
        ``index_B`` copied there if it is on the host.
        """
        index_B = index_B.to(self.input_ids_BT.device)
        if width is None:
            width = int(self.attention_mask_BT.index_select(0, index_B).sum(dim=1).max())
        return self._map(lambda t: t.index_select(0, index_B)[:, :width], self._image_rows(index_B))

    def row_lengths(self) -> RowLengths:
        """Each row's sizes on the host, read from the device in one copy (see :class:`RowLengths`)."""
        return RowLengths.of(self.attention_mask_BT, self.response_mask_BT)

    def select(self, index_B: torch.Tensor) -> PolicyBatch:
        """The rows at ``index_B`` (in that order), full width."""
        return self._map(lambda t: t.index_select(0, index_B.to(t.device)), self._image_rows(index_B))

    def split(self, sizes: Sequence[int]) -> list[PolicyBatch]:
        """Consecutive row blocks of ``sizes`` (they must add up to num_rows), full width."""
        if sum(sizes) != self.num_rows:
            raise ValueError(f"split sizes {list(sizes)} do not add up to {self.num_rows} rows")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [
            self._map(lambda t, a=a, n=n: t[a : a + n], range(a, a + n))
            for a, n in zip(starts, sizes, strict=True)
        ]

    @staticmethod
    def concat(batches: Sequence[PolicyBatch]) -> PolicyBatch:
        """Rows of ``batches`` in order, right-padded (0) to the widest; the same fields must be set in all."""
        if not batches:
            raise ValueError("concat of no batches")
        width = max(b.input_ids_BT.shape[1] for b in batches)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(PolicyBatch):
            parts = [getattr(b, f.name) for b in batches]
            if all(p is None for p in parts):
                out[f.name] = None
                continue
            if any(p is None for p in parts):
                raise ValueError(f"concat: {f.name} is set in some batches and not in others")
            if f.name == "images":
                out[f.name] = ImageInputs.cat(parts)
                continue
            # Right-padded along dim 1 (T): 0, or -1 (no choice) for the routed experts' trailing dims.
            value = -1 if f.name == "routed_experts_BTLK" else 0
            out[f.name] = torch.cat(
                [
                    torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]), value=value)
                    for p in parts
                ]
            )
        return PolicyBatch(**out)  # type: ignore[arg-type]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields that are set, by name, as (rows, width) tensors: what spmdrl.distributed.exchange
        moves. Router replay's (B, T, layers, k) routing travels flattened (:func:`pack_routed`), and so do a
        VLM's images, each row's with it (:func:`pack_images`)."""
        out = {
            f.name: t
            for f in dataclasses.fields(self)
            if f.name not in ("images", "routed_experts_BTLK") and (t := getattr(self, f.name)) is not None
        }
        device = self.input_ids_BT.device
        if self.routed_experts_BTLK is not None:
            out.update(pack_routed(self.routed_experts_BTLK, self.num_rows, device))
        if self.images is not None:
            out.update(pack_images(self.images, self.num_rows, device))
        return out

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor]) -> PolicyBatch:
        """The inverse of :meth:`tensors` (the routing as wide as the rows, the images on the host); a
        missing ``advantages_BT`` starts at 0."""
        tensors = dict(tensors)
        tensors.setdefault("advantages_BT", torch.zeros_like(tensors["engine_logprobs_BT"]))
        if ROUTED in tensors:
            wire = {k: tensors.pop(k) for k in (ROUTED, ROUTED_SHAPE)}
            tensors["routed_experts_BTLK"] = unpack_routed(wire, tensors["input_ids_BT"].shape[1])
        if IMAGE_SHAPE in tensors:
            tensors["images"] = unpack_images({k: tensors.pop(k) for k in (IMAGES, IMAGE_MASK, IMAGE_SHAPE)})
        return PolicyBatch(**tensors)

    def field_spec(self) -> dict[str, torch.dtype]:
        """name -> dtype of the fields that are set (an exchange's FieldSpec)."""
        return {name: t.dtype for name, t in self.tensors().items()}

    def _image_rows(self, index_B: torch.Tensor) -> Sequence[int]:
        """The row numbers of ``index_B``, for the images (read only when there are images: a sync on a GPU)."""
        return [] if self.images is None else index_B.tolist()

    def _map(
        self, fn: Callable[[torch.Tensor], torch.Tensor], rows: Sequence[int] | None = None
    ) -> PolicyBatch:
        """``fn`` on every tensor field; the images follow ``rows`` (None: the same rows, in order)."""
        out: dict[str, Any] = {
            f.name: None if (t := getattr(self, f.name)) is None else fn(t)
            for f in dataclasses.fields(self)
            if f.name != "images"
        }
        images = self.images
        out["images"] = images.rows(list(rows)) if images is not None and rows is not None else images
        return PolicyBatch(**out)


@dataclass(frozen=True)
class RowLengths:
    """A batch's per-row sizes on the host: what a pass over micro-batches needs to know of the rows
    (widths, the first trained column, unit counts) without reading the device inside its loop, where
    every read would stop the CPU until the GPU has caught up. Rows are right-padded, so a row's tokens
    are its first ``tokens[i]`` columns and its sampled tokens lie among them.
    """

    tokens: list[int]  # attention-mask tokens (prompt + response)
    first_response: list[int]  # the first column with a sampled token; the batch's width if none
    response_tokens: list[int]  # sampled tokens (the response mask's ones)

    @staticmethod
    def of(attention_mask_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> RowLengths:
        """The sizes, in one device read. Raises ValueError for a row that is not right-padded: the
        passes attend causally with no mask (spmdrl.models.causal_attention), exact only when a row's
        padding follows all its tokens, and the checked columns come with that read at no extra cost."""
        B, T = response_mask_BT.shape
        resp_BT = response_mask_BT.bool()
        attn_BT = attention_mask_BT.bool()
        # argmax gives the first maximal index: the first sampled column of a row that has one.
        first_B = torch.where(resp_BT.any(dim=1), resp_BT.to(torch.uint8).argmax(dim=1), T)
        tokens_B = attn_BT.sum(dim=1)
        # Right-padded: the row's tokens are exactly its first tokens_B columns.
        within_BT = torch.arange(T, device=attn_BT.device)[None, :] < tokens_B[:, None]
        misplaced_B = (attn_BT != within_BT).sum(dim=1)
        stats_4B = torch.stack([tokens_B, first_B, resp_BT.sum(dim=1), misplaced_B]).long()
        tokens, first, response, misplaced = stats_4B.tolist()  # the one device read
        bad = [i for i, n in enumerate(misplaced) if n]
        if bad:
            raise ValueError(
                f"rows {bad[:8]} of this batch are not right-padded (a row's attention mask must be its "
                "first tokens, then padding): spmdrl's passes attend causally without a mask. Build rows "
                "with spmdrl.rl.batch.build_policy_batch, which right-pads them"
            )
        return RowLengths(tokens, first, response)

    def width(self, rows: Sequence[int]) -> int:
        """The longest sequence among ``rows`` (a micro-batch's width, as PolicyBatch.take trims it)."""
        return max((self.tokens[i] for i in rows), default=0)

    def first_column(self, rows: Sequence[int]) -> int:
        """The first column any of ``rows`` samples a token in, at most their width (as
        PolicyBatch.first_response_column of their micro-batch)."""
        return min([self.width(rows), *(self.first_response[i] for i in rows)])

    def padded(self, rows: Sequence[int]) -> bool:
        """Whether any of ``rows`` is shorter than their micro-batch's width."""
        width = self.width(rows)
        return any(self.tokens[i] < width for i in rows)


def build_policy_batch(
    prompts: Sequence[list[int]],
    generations: Sequence[Generation],
    *,
    pad_id: int,
    images: Sequence[ImageInputs | None] | None = None,
) -> PolicyBatch:
    """The rows the update trains on, from what the rollout produced; advantages are set later
    (``batch.replace(advantages_BT=...)``), once the logprobs a KL-in-reward needs are known.
    ``images``: a vision-language model's images of each prompt (one row of ImageInputs per prompt, None
    for a prompt without images); a row's images are its prompt's, then those its tools returned
    (``Generation.images``), the order their image tokens appear in."""
    rows = pack_generations(prompts, generations, pad_id)
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"{len(images)} prompts' images for {len(prompts)} prompts")
    return PolicyBatch(
        input_ids_BT=rows.input_ids_BT,
        attention_mask_BT=rows.attention_mask_BT,
        response_mask_BT=rows.response_mask_BT,
        engine_logprobs_BT=rows.engine_logprobs_BT,
        advantages_BT=torch.zeros_like(rows.engine_logprobs_BT),
        routed_experts_BTLK=rows.routed_experts_BTLK,
        images=None
        if images is None
        else ImageInputs.cat([ImageInputs.join([images[g.prompt_index], g.images]) for g in generations]),
    )
