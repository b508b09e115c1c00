"""A multi-turn verifiers 0.4 environment (a verifiers.v1 Env beside its taskset) is refused when it loads,
with the reason (its agents run in Env.run, through a harness that takes the model's calls over HTTP) and
what to use instead: tests/envs/vf_tiny_v1's taskset with an Env exported beside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spmdrl.envs.config import EnvConfig
from spmdrl.envs.setup import forget_loaded, load_env
from spmdrl.errors import ConfigError
from tests.vf_envs import ENVS_DIR, V1_ENV

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (the envs extra)")


@pytest.fixture(autouse=True)
def agents_env_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The tiny taskset with an Env beside it: a multi-turn 0.4 environment.
    (tmp_path / "vf_tiny_v1_agents.py").write_text(
        "import verifiers.v1 as vf\n"
        "from vf_tiny_v1 import TinyTaskset\n\n\n"
        "class GameEnv(vf.Env):\n"
        "    pass\n\n\n"
        '__all__ = ["TinyTaskset", "GameEnv"]\n'
    )
    monkeypatch.syspath_prepend(str(ENVS_DIR / V1_ENV))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    forget_loaded()


def test_a_multi_turn_v1_env_is_refused_with_the_reason_and_what_to_use() -> None:
    with pytest.raises(ConfigError) as e:
        load_env(EnvConfig(source="verifiers:vf_tiny_v1_agents"))
    message = str(e.value)
    assert "multi-turn verifiers 0.4 environment (it exports the Env GameEnv)" in message
    assert "HTTP" in message and "0.3.x MultiTurnEnv" in message and "rollout.multi_turn.tools" in message
