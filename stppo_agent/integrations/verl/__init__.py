"""The verl bridge (docs/verl.md): this project's algorithm presets as verl policy losses, ST-PPO's clip-bias
correction and the hand-over of the turn record in the verl training engine ``stppo``, its env as the verl agent
loop ``stppo_env``, its benchmarks as verl parquet with a reward function that scores like the env, and a Search-R1
search tool with verl's tool agent (``stppo_tool_agent``).

Importing this package imports nothing from verl; ``losses``, ``engine``, ``agent_loop``, ``tool``, ``tool_agent``
and ``plugin`` do, while ``correction``, ``turns``, ``data``, ``reward`` and ``settings`` work without verl. Nothing
else in the project imports it.
"""
