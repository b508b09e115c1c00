"""The sync's fixed cost split into timing phases (SyncStats.phases): each part becomes a
timing/weight_sync_<part>_s metric the step logs (spmdrl.rl.metrics.PHASES); an end-to-end run's values are
in docs/performance.md."""

from __future__ import annotations

from spmdrl.rl.metrics import PHASES
from spmdrl.rollout.engine import LoadSeconds
from spmdrl.rollout.weight_sync import SyncStats


def test_every_part_of_the_sync_is_a_logged_phase() -> None:
    stats = SyncStats(1.0, 10, 1, 2, check_seconds=0.25, load=LoadSeconds(0.125, 0.5, 0.0625))
    assert stats.phases() == {
        "weight_sync_wake": 0.125,
        "weight_sync_load": 0.5,
        "weight_sync_prefix_reset": 0.0625,
        "weight_sync_check": 0.25,
    }
    assert set(stats.phases()) <= set(PHASES)
    # The parts are shares of the whole sync.
    assert sum(stats.phases().values()) <= stats.seconds
    assert SyncStats(0.0, 0, 0, 0).phases() == dict.fromkeys(stats.phases(), 0.0)
