"""The building blocks of an RL step, which the recipes (recipes/grpo.py, recipes/ppo.py) call phase by
phase; a forked recipe imports them from here.

- job.py         what the phases work with (RLJob: data, models, engine, ...), built once; resume,
                 validation, checkpoints and the end of the run
- samples.py     rollout and reward: this rank's prompts -> ScoredSamples; DAPO's additions; validation
- experience.py  ScoredSamples -> the rows the update trains on: old and reference logprobs, the KL in the
                 reward, the rollout correction, the advantages
- update.py      the trainer-side math: no-grad passes (logprobs, values) and the actor's and critic's updates
- models.py      the actor, the reference and the critic on their ranks
- reference.py   the KL term's reference: a frozen model, or under LoRA the actor with its adapters off
- role_rows.py   where a step's rows live for each role, and the moves that put them there
- metrics.py     the step's metrics, reduced over ranks

"rollout" means one thing here: generating responses with the in-process engine (the ``rollout.*``
settings, spmdrl.rollout.Rollout, the step's first phase).
"""
