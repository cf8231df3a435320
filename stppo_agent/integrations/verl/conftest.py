# These modules import verl, so without it (the project's default install) pytest's --doctest-modules cannot import
# them; tests/test_verl_bridge.py tests them where verl is installed. data.py and reward.py need no verl.
import importlib.util

collect_ignore = [] if importlib.util.find_spec("verl") else ["agent_loop.py", "engine.py", "losses.py", "plugin.py",
                                                              "tool.py"]
