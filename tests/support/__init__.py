"""What tests share that is not a pytest fixture (fixtures live in the conftest.py files): test doubles, small
configs and batches, in-process command runners, the 2-process gloo harness, the verl and TRL helpers.

Tiny Hugging Face models and the toy train command are not here: they live in :mod:`stppo_agent.models.tiny`, which
benchmarks/ imports too (nothing outside tests/ imports ``tests``)."""
