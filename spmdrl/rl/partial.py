"""A training batch whose generation the next weights may interrupt (rollout.partial=continue|abort).

The async schedule's rollout ranks generate batch i+k while the trainer ranks update on batch i; with
rollout.partial the trainer's first rank posts a notice right before it broadcasts version i
(spmdrl/rl/weight_notice.py), and a rollout rank polls for it between engine steps: when it is there, the
rank joins the broadcast mid-generation (spmdrl/rollout/interruptible.py) and every unfinished sample
goes on under the new weights, each token keeping the version that sampled it.
"""

from __future__ import annotations

from typing import Protocol

from spmdrl.data.prompts import PromptExample
from spmdrl.rl.job import RLJob, sync_actor_weights
from spmdrl.rl.weight_notice import Notice
from spmdrl.rollout.engine import Generation, SamplingSpec


class Versioned(Protocol):
    version: int  # the policy version the engine serves


def generate_partial(
    job: RLJob,
    notice: Notice,
    engine: Versioned,
    prompts: list[PromptExample],
    spec: SamplingSpec,
) -> list[Generation]:
    """``prompts``' generation by ``engine.version``, interrupted when ``notice`` arrives by version
    ``notice.version``'s sync (which then counts as the step's, and is ``engine``'s version from then on);
    each Generation holds its tokens' versions. It runs through the job's Rollout
    (Rollout.generate_interruptible), so what a launcher wrapped it in sees it too."""

    def poll() -> bool:
        return not notice.synced and notice.arrived()  # once: the switch syncs this notice's version

    def switch() -> int:
        notice.wait()  # here already; checks it names the version expected
        sync_actor_weights(job, check_seed=notice.version)
        notice.synced = True
        engine.version = notice.version
        return notice.version

    out = job.rollout.generate_interruptible(
        prompts, spec, version=engine.version, poll=poll, switch=switch, mode=job.cfg.rollout.partial
    )
    return out.generations
