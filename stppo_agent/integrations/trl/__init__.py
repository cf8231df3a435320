"""The TRL adapter (docs/trl.md): the ``stppo/*`` search envs as environments of TRL's ``GRPOTrainer``
(``environment_factory``, one env or a dict of them), with the env's retriever behind a ``search`` tool and its
score behind ``get_reward``.

Nothing here imports TRL: an environment is a plain class TRL inspects (``reset``, ``get_reward``, and its other
public methods as tools), so the adapter works, and is tested, without TRL installed. Nothing else in the project
imports it.
"""

from .environment import TOOL_MCQ_TEMPLATE, TOOL_TEMPLATE, SearchEnvironment
from .factory import SearchEnvironmentFactory, search_environment, training_dataset

__all__ = ["SearchEnvironment", "SearchEnvironmentFactory", "TOOL_MCQ_TEMPLATE", "TOOL_TEMPLATE",
           "search_environment", "training_dataset"]
