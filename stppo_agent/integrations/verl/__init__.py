"""The verl bridge (docs/verl.md): this project's algorithm presets as verl policy losses, its benchmarks as verl
parquet with a reward function that scores like the env, and a Search-R1 search tool for verl's tool agent.

Importing this package imports nothing from verl; its modules do (``losses``, ``plugin``, ``tool``), except
``data`` and ``reward``, which work without verl. Nothing else in the project imports it.
"""
