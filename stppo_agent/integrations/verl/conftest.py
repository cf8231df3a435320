# These modules import verl, so without it (the project's default install) pytest's --doctest-modules cannot import
# them; tests/integrations/verl/ tests them where verl is installed. The other modules need no verl.
import importlib.util

collect_ignore = [] if importlib.util.find_spec("verl") else ["agent_loop.py", "engine.py", "losses.py", "plugin.py",
                                                              "tool.py", "tool_agent.py"]
