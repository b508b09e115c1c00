"""vLLM's CPU worker, naming its shared-memory segments after the build's ident (:mod:`spmdrl.rollout.cpu_shm`).

vLLM imports this module by qualified name (``worker_cls``) while it builds a CPU engine with tp >= 2;
nothing else should import it (it imports vLLM).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker as _VLLMCPUWorker

from spmdrl.rollout import cpu_shm


class CPUWorker(_VLLMCPUWorker):
    def init_device(self) -> None:
        ident = cpu_shm.building_ident()
        if ident is not None:
            # vLLM 0.32's init_device sets VLLM_DIST_IDENT from the basename of a file:// init method (else
            # from what follows its last colon: "//" for external_launcher's env://), then creates the TP
            # group, which names its segments after it, with no code of ours in between: the init method
            # is the one input we can give. It is not used to connect, since torch.distributed is
            # initialized before any engine is built (VLLMEngine requires it).
            self.distributed_init_method = f"file://{ident}"
        super().init_device()
