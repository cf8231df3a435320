"""``stppo_agent.plugins.name_checks``: algorithm, env, model and retriever names and
env keyword arguments checked before any model loads, a config's plugins imported first."""

from __future__ import annotations

from types import SimpleNamespace

import gymnasium as gym
import pytest

from stppo_agent.plugins import name_checks
from tests.support.fakes import Calls


# -- plugins: the names typed on the command line --------------------------------------------------------------------
def test_name_checks_algorithm_env_and_model_names(tmp_path, monkeypatch):
    name_checks.check_algorithm("st_ppo")
    with pytest.raises(ValueError, match=r"^unknown algorithm 'st_ppp' \(did you mean st_ppo\?\); known: .*; a "
                                         r"plugin's own: --import myrule.py$"):
        name_checks.check_algorithm("st_ppp")
    assert name_checks.check_env_ids(" stppo/Toy-v0 ,, stppo/Toy-v0") == ["stppo/Toy-v0", "stppo/Toy-v0"]
    listing = ", ".join(sorted(i for i in gym.registry if i.startswith("stppo/")))
    with pytest.raises(ValueError) as error:
        name_checks.check_env_ids("stppo/Toy-v0,stppo/Toy-v1")
    assert str(error.value) == ("unknown env id 'stppo/Toy-v1' (did you mean stppo/Toy-v0?); Registered stppo envs: "
                                + listing) and "stppo/Toy-v0, stppo/" in listing
    with pytest.raises(ValueError, match=r"^unknown env id 'CartPole-v9'"):
        name_checks.check_env_ids("CartPole-v9")
    for fine in ("", "smollm2", "hf:SmolLM2", "TINY", "org/smolm2", str(tmp_path), "completely-different-name"):
        name_checks.check_model(fine)
    (tmp_path / "smolm2").mkdir()
    with pytest.raises(ValueError, match=r"^model 'smolm2' is neither a folder nor a known alias \(did you mean "
                                         r"smollm2\?\); aliases: smollm2, tiny; or give a Hugging Face folder or hub "
                                         r"name$"):
        name_checks.check_model("hf:smolm2")
    monkeypatch.chdir(tmp_path)
    name_checks.check_model("smolm2")  # a folder of that name here
    name_checks.check_model("hf:smolm2")


def test_name_checks_retriever_kinds():
    assert name_checks.RETRIEVER_KINDS == ("demo", "bm25", "bm25-prebuilt", "dense", "http", "https")
    for fine in ("demo", " demo ", "bm25:/i", "bm25-prebuilt:wiki", "dense:/d", "http://h:1", "https://h"):
        name_checks.check_retriever(fine)
    with pytest.raises(ValueError, match=r"^bad retriever spec 'bm52' \(did you mean bm25\?\): expected demo, "
                                         r"bm25:INDEX_DIR, bm25-prebuilt:NAME, dense:INDEX_DIR or http://HOST:PORT$"):
        name_checks.check_retriever(" bm52 ")
    with pytest.raises(ValueError, match=r"^unknown retriever kind 'bm52' \(did you mean bm25\?\); known: bm25, "
                                         r"bm25-prebuilt, demo, dense, http, https \(in 'bm52:/i'\)$"):
        name_checks.check_retriever("bm52:/i")
    with pytest.raises(ValueError, match=r"^unknown retriever kind 'Demo' \(did you mean demo\?\)"):
        name_checks.check_retriever("Demo:x")


class _Env(gym.Env):
    def __init__(self, turns: int = 2, *extra, retriever=None):
        pass


class _OpenEnv(gym.Env):
    def __init__(self, **kwargs):
        pass


def test_name_checks_env_kwargs_against_the_constructor(monkeypatch):
    registry = dict(gym.registry)
    monkeypatch.setattr(gym.envs.registration, "registry", registry)
    monkeypatch.setattr(gym, "registry", registry)
    gym.register("m27/Closed-v0", entry_point=_Env)
    gym.register("m27/Open-v0", entry_point=_OpenEnv)
    gym.register("m27/ByName-v0", entry_point=f"{__name__}:_Env")
    gym.register("m27/Broken-v0", entry_point="m27_no_such_module:Env")
    name_checks.check_env_kwargs(["m27/Closed-v0", "m27/ByName-v0"], {"turns": 3, "render_mode": None})
    name_checks.check_env_kwargs(["m27/Open-v0", "m27/Broken-v0"], {"anything": 1})
    for first in ("m27/Open-v0", "m27/Broken-v0"):  # an env that cannot be checked does not end the checks
        with pytest.raises(ValueError, match=r"^env 'm27/Closed-v0' does not accept env_kwargs 'anything'"):
            name_checks.check_env_kwargs([first, "m27/Closed-v0"], {"anything": 1})
    for env_id in ("m27/Closed-v0", "m27/ByName-v0"):
        with pytest.raises(ValueError, match=r"^env '" + env_id + r"' does not accept env_kwargs 'turn' \(did you "
                                             r"mean turns\?\); it accepts: retriever, turns$"):
            name_checks.check_env_kwargs([env_id], {"turns": 1, "turn": 2})
    with pytest.raises(ValueError, match=r"^env 'm27/Closed-v0' does not accept env_kwargs 'extra'"):
        name_checks.check_env_kwargs(["m27/Closed-v0"], {"extra": 1})
    with pytest.raises(ValueError, match=r"^bad retriever spec 'bm52'"):
        name_checks.check_env_kwargs(["m27/Open-v0"], {"retriever": "bm52"})
    name_checks.check_env_kwargs(["m27/Closed-v0"], {"retriever": object()})


def test_name_checks_a_train_config_imports_its_plugins_first(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(name_checks, "load_plugins", calls.fn("plugins"))
    monkeypatch.setattr(name_checks, "check_algorithm", calls.fn("algorithm"))
    monkeypatch.setattr(name_checks, "check_env_ids", calls.fn("env", ["e1", "e2"]))
    monkeypatch.setattr(name_checks, "check_env_kwargs", calls.fn("kwargs"))
    monkeypatch.setattr(name_checks, "check_model", calls.fn("model"))
    config = SimpleNamespace(plugins=["p.py"], algo="a", env="e1,e2", env_kwargs=None, model="m")
    name_checks.check_train_config(config)
    assert calls == [("plugins", (["p.py"],), {}), ("algorithm", ("a",), {}), ("env", ("e1,e2",), {}),
                     ("kwargs", (["e1", "e2"], {}), {}), ("model", ("m",), {})]
    calls.clear()
    name_checks.check_train_config(SimpleNamespace(plugins=[], algo="a", env="e", env_kwargs={"k": 1}, model=""))
    assert [c[0] for c in calls] == ["plugins", "algorithm", "env", "kwargs"] and calls[3][1][1] == {"k": 1}
