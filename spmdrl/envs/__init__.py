"""Environments from the ecosystem as spmdrl's prompts and reward (the ``env`` config section).

``env.source=verifiers:<name>`` loads an installed verifiers environment, of either generation
(:mod:`spmdrl.envs.load`): its tasks become the job's prompts (:mod:`spmdrl.envs.rows`) and its rubric or
reward methods the reward (:mod:`spmdrl.envs.reward`), scored in the reward workers like any reward.fn.
:mod:`spmdrl.envs.setup` is what the RL job and ``--check`` call.
"""
