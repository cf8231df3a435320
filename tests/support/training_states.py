"""Small :class:`~stppo_agent.training.state.TrainingState` objects for the loop's and its collaborators' wiring
tests (the tiny Hugging Face models themselves live in :mod:`stppo_agent.models.tiny`)."""

from __future__ import annotations


def linear_state(iteration: int = 0):
    """A training state of a linear actor (SGD, a constant rate, no lag) at ``iteration``: for the loop's and its
    collaborators' wiring, where no model needs to compute anything."""
    import torch

    from stppo_agent.training.stale_policy import StalePolicy
    from stppo_agent.training.state import TrainingState

    actor = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
    return TrainingState(tokenizer=None, actor=actor, actor_optimizer=optimizer,
                         actor_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                         stale_policy=StalePolicy(actor, 0), iteration=iteration)
