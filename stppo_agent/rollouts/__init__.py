"""Turning a policy and envs into token-exact trajectories: the turn loop, generation backends, KV caches, batch
tensors."""
