"""Bridges from this project to other training frameworks. Each is optional: nothing else in ``stppo_agent`` or
``stppo_envs`` imports them, and each needs its framework installed (``verl``: docs/verl.md; ``trl``, whose
adapter imports nothing of TRL but is only useful with it: docs/trl.md)."""
