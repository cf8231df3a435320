"""``stppo demo`` (stppo_agent/cli/demo.py): its defaults are the demo's own settings, every
option reaches them, and what makes no sense is refused. The library calls are replaced by recorders."""

from __future__ import annotations

from tests.support.cli_calls import Calls, run, usage_error

# ---------------------------------------------------------------- demo


def _demo(monkeypatch):
    from stppo_agent.training import demo

    monkeypatch.setattr(demo, "run_demo", Calls())
    return demo.run_demo


def test_demo_defaults_are_demo_settings_own(monkeypatch, capsys):
    from stppo_agent.cli.demo import DEMO_DEFAULTS
    from stppo_agent.training.demo import DemoSettings

    recorded = _demo(monkeypatch)
    assert run(capsys, "demo") == (0, "", "")
    (settings,), _ = recorded.only
    assert settings == DemoSettings()
    assert DEMO_DEFAULTS == {"iterations": 1, "sft_steps": 8, "limit": 8, "lr": 1.5e-5, "seed": 0,
                             "autocast_dtype": "auto"}
    assert (settings.model, settings.output_dir, settings.on_collapse) == ("smollm2", "runs/demo", "warn")
    assert (settings.seed, settings.autocast_dtype) == (0, "auto")


def test_demo_every_option_reaches_the_settings(monkeypatch, capsys):
    from stppo_agent.training.demo import DemoSettings

    recorded = _demo(monkeypatch)
    assert run(capsys, "demo", "--iterations", "3", "--sft-steps", "0", "--limit", "2", "--model", "tiny",
               "--output-dir", "out", "--lr", "3e-6", "--on-collapse", "rollback", "--seed", "7",
               "--autocast-dtype", "bfloat16")[0] == 0
    assert recorded.only[0][0] == DemoSettings(model="tiny", output_dir="out", iterations=3, sft_steps=0, limit=2,
                                               lr=3e-6, on_collapse="rollback", seed=7, autocast_dtype="bfloat16")
    for choice in ("auto", "none"):
        run(capsys, "demo", "--autocast-dtype", choice)
        assert recorded.calls[-1][0][0].autocast_dtype == choice
    for choice in ("none", "warn", "stop"):
        run(capsys, "demo", "--on-collapse", choice)
        assert recorded.calls[-1][0][0].on_collapse == choice


def test_demo_refuses_what_makes_no_sense(monkeypatch, capsys):
    _demo(monkeypatch)
    assert "must be >= 1" in usage_error(capsys, "demo", "--iterations", "0")
    assert "must be >= 1" in usage_error(capsys, "demo", "--limit", "0")
    assert "invalid int" in usage_error(capsys, "demo", "--sft-steps", "1.5")
    assert "invalid float" in usage_error(capsys, "demo", "--lr", "fast")
    assert "invalid choice" in usage_error(capsys, "demo", "--on-collapse", "panic")
    assert "invalid choice" in usage_error(capsys, "demo", "--autocast-dtype", "float16")
    assert "invalid int" in usage_error(capsys, "demo", "--seed", "one")
