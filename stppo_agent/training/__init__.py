"""The training loop and its configuration: the trainer, live rollouts, replay, SFT warm start."""
