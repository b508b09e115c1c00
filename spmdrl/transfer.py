"""Host-to-device copies that do not make the CPU wait for the GPU."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without a sync: on CUDA it is pinned first and copied
    asynchronously. A blocking copy from pageable memory waits for everything queued on the stream
    before it, so a loop that moves its index tensors this way per micro-batch never lets the CPU run
    ahead. The pinned buffer is the caching host allocator's: it is not reused before the copy is done.
    """
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
