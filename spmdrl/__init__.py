"""spmdrl: RL post-training for language models as one SPMD PyTorch program."""
