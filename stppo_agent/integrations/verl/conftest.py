# The bridge's modules subclass or import verl's own classes, so without verl (the project's default install)
# pytest's --doctest-modules cannot import them. tests/test_verl_bridge.py tests them where verl is installed.
import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["*.py"]
