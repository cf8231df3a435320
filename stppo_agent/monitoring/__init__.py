"""Watching a training run: collapse rules, the guard that rolls back, per-step diagnostics."""
