"""``stppo_agent.algorithms.registry``: the registries of policy losses, whole-batch
statistics and advantage estimators -- names, refusals, listings, registration as decorators -- and the keyword
check that lets a registered function be called with or without an optional keyword."""

from __future__ import annotations

import pytest

from stppo_agent.algorithms import losses as losses_module
from stppo_agent.algorithms.losses import (
    POLICY_LOSSES,
    WHOLE_BATCH_STATISTICS,
    get_policy_loss,
    register_policy_loss,
    register_whole_batch_statistic,
)
from stppo_agent.algorithms.registry import Registry


def test_policy_loss_and_whole_batch_statistic_registries():
    assert get_policy_loss("ppo_clip") is losses_module.ppo_clip_loss
    assert {"ppo_clip", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po"} <= set(POLICY_LOSSES)
    assert set(WHOLE_BATCH_STATISTICS) == {"m2po"}
    with pytest.raises(KeyError, match="unknown policy loss 'nope'; known: cispo, "):
        get_policy_loss("nope")

    def loss(**kwargs):
        return None

    try:
        assert register_policy_loss("pin_loss", loss) is loss
        assert register_policy_loss("pin_loss_2")(loss) is loss
        assert register_whole_batch_statistic("pin_loss", loss) is loss
        assert register_whole_batch_statistic("pin_loss_2")(loss) is loss
        assert POLICY_LOSSES["pin_loss_2"] is loss and WHOLE_BATCH_STATISTICS["pin_loss_2"] is loss
        with pytest.raises(ValueError, match="^policy loss 'pin_loss' is already registered; choose another name$"):
            register_policy_loss("pin_loss", loss)
    finally:
        for name in ("pin_loss", "pin_loss_2"):
            POLICY_LOSSES._items.pop(name, None)
            WHOLE_BATCH_STATISTICS._items.pop(name, None)


def test_registry_names_errors_and_listing():
    registry = Registry("widget")
    assert registry.register("b", 2) == 2
    assert registry.decorator("a")(1) == 1
    assert list(registry) == ["b", "a"] and len(registry) == 2 and registry["a"] == 1
    assert repr(registry) == "Registry(widget: a, b)"
    with pytest.raises(KeyError, match="unknown widget 'c'; known: a, b"):
        registry["c"]
    with pytest.raises(ValueError, match="^widget 'a' is already registered; choose another name$"):
        registry.register("a", 3)
    with pytest.raises(ValueError, match="^widget names must be non-empty strings, got ''$"):
        registry.register("", 3)
    with pytest.raises(ValueError, match="^widget names must be non-empty strings, got 5$"):
        registry.register(5, 3)
    assert registry["a"] == 1


def test_losses_and_estimators_register_as_decorators_too():
    from stppo_agent.algorithms import (
        ADVANTAGE_ESTIMATORS,
        POLICY_LOSSES,
        get_advantage_estimator,
        get_policy_loss,
        register_advantage_estimator,
        register_policy_loss,
    )

    for registry, name in ((POLICY_LOSSES, "test_pin_loss"), (ADVANTAGE_ESTIMATORS, "test_pin_adv")):
        registry._items.pop(name, None)

    @register_policy_loss("test_pin_loss")
    def loss(**kwargs):
        return kwargs

    def estimator(**kwargs):
        return kwargs

    assert register_advantage_estimator("test_pin_adv", estimator) is estimator
    assert get_policy_loss("test_pin_loss") is loss and get_advantage_estimator("test_pin_adv") is estimator
