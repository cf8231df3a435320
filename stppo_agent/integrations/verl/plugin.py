"""What verl loads in every process at ``import verl`` (entry point group ``verl.plugins``; also usable as
``actor_rollout_ref.model.external_lib=stppo_agent.integrations.verl.plugin``): registers the ``stppo_<preset>``
policy losses, the ``stppo_env`` and ``stppo_tool_agent`` agent loops and the ``stppo`` training engine (selected
with ``VERL_ENGINE_VENDOR=stppo``; :mod:`.engine`). verl loads tools by class path from the tool config, so the
search tool needs nothing here. Presets registered after this ran are added by calling
:func:`stppo_agent.integrations.verl.losses.register_verl_losses` again."""

from . import (
    agent_loop,  # noqa: F401  (registers the stppo_env agent loop)
    engine,  # noqa: F401  (registers the stppo training engine)
    tool_agent,  # noqa: F401  (registers the stppo_tool_agent agent loop)
)
from .losses import register_verl_losses

REGISTERED_LOSSES = register_verl_losses()
