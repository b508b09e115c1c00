"""Supervised training of one model on every rank: the SFT stage (recipes/sft.py, and the RL jobs'
warm-start) and what the reward model (recipes/rm.py) shares with it. Their loops stand on spmdrl/loop.py's
skeleton, as the RL recipes' do.

- model.py        one trained model on every rank: built, its update, its checkpoint role
- sft.py          the SFT stage: train_sft, the whole run on an initialized Run
- sft_batches.py  the SFT data and its loss: the dataset, micro-batches, the masked cross-entropy
- sft_eval.py     the SFT validation: the held-out loss and greedy samples
- warmstart.py    the SFT stage inside another job (warmstart.*), before RL or the reward model
"""
