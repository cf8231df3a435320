"""What a run leaves on disk: checkpoints, the run folder, trainer state, recorded rollouts, the metrics log."""
