"""Pins of ``Trainer.__init__``'s wiring with every collaborator stubbed in the trainer module (fast: no model is
built, the training state is a linear one): the defaults of ``resume``/``overwrite``, the order of the config's
resolutions, the multiple-of-world check, the seeds of rank 0 and of another rank, what each stage, resume, the
logger, config.yaml, the recorder and the guard receive, and what a non-main process leaves unset."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from stppo_agent.training import trainer as trainer_module
from stppo_agent.training.live_rollouts import RolloutContext
from stppo_agent.training.state import Restore

from .training_states import linear_state


def _section(**values):
    return dataclasses.field(default_factory=lambda: SimpleNamespace(**values))


@dataclasses.dataclass
class FakeConfig:
    output_dir: str = "run"
    device: str = "cpu"
    seed: int = 7
    critic_model: str | None = None
    stage: str = "raw"
    rollout: SimpleNamespace = _section(prompts_per_iteration=4)
    optimizer: SimpleNamespace = _section(mini_batch_size=2)
    distributed: SimpleNamespace = _section(strategy="ddp")
    logging: SimpleNamespace = _section(tensorboard=True, wandb_project="wb", save_rollouts=False,
                                        step_diagnostics=False)
    monitor: SimpleNamespace = _section(on_collapse="none")

    def validate(self):
        CALLS.append(("validate", self.stage))

    def algorithm_config(self):
        return f"algo<{self.stage}>"

    def to_yaml(self, resolved):
        return f"yaml {self.stage} {resolved}"


CALLS: list = []
STATE = linear_state()


@dataclasses.dataclass
class Source:
    """What the stubbed rollout source was built from."""

    name: str
    context: RolloutContext
    env_kwargs: list | None = None


class Logger:
    def __init__(self, run_dir, **kwargs):
        CALLS.append(("logger", run_dir, kwargs))

    def truncate_after(self, iteration, report):
        CALLS.append(("truncate_after", iteration, report))


def _stub(monkeypatch, *, rank=0, world=1, checkpoint=None):
    CALLS.clear()

    def record(name, result=None):
        return lambda *args, **kwargs: CALLS.append((name, args, kwargs)) or result

    monkeypatch.setattr(trainer_module, "resolve_device", lambda d: f"dev<{d}>")
    monkeypatch.setattr(trainer_module, "with_resolved_precision",
                        lambda c, d: dataclasses.replace(c, stage=f"{c.stage}+prec({d})"))
    monkeypatch.setattr(trainer_module, "with_training_split",
                        lambda c, ck, report: dataclasses.replace(c, stage=f"{c.stage}+split({ck},{report.__name__})"))
    monkeypatch.setattr(trainer_module, "process_group", SimpleNamespace(
        ensure_process_group=record("ensure_process_group"), rank=lambda: rank, world_size=lambda: world,
        seed_everything=record("seed"), rank_seed=lambda seed, r: seed * 100 + r, is_main=lambda: rank == 0))
    monkeypatch.setattr(trainer_module, "run_folder",
                        SimpleNamespace(prepare_on_all_ranks=record("prepare", checkpoint)))
    monkeypatch.setattr(trainer_module, "trainer_state", SimpleNamespace(
        checkpoint_config=lambda ck: f"cfg<{ck}>", check_resume_settings=record("check_resume")))
    global STATE
    STATE = linear_state()
    STATE.load = record("load")
    monkeypatch.setattr(trainer_module, "build_state", record("build_state", STATE))
    monkeypatch.setattr(trainer_module, "weights_folder", lambda config, ck: f"weights<{ck}>")
    monkeypatch.setattr(trainer_module, "generation_backend", record("backend", "the backend"))
    monkeypatch.setattr(trainer_module, "PPOUpdate", lambda *args, **kwargs: ("updater", args, kwargs))
    monkeypatch.setattr(trainer_module, "LiveRollouts", lambda context: Source("live", context))
    monkeypatch.setattr(trainer_module, "LearnerProbe", SimpleNamespace(for_run=lambda *args: ("probe", args)))
    monkeypatch.setattr(trainer_module, "MetricsLogger", Logger)
    monkeypatch.setattr(trainer_module, "drop_recordings_after", record("drop"))
    monkeypatch.setattr(trainer_module, "RolloutRecorder", SimpleNamespace(
        for_run=lambda *args, **kwargs: ("recorder", args, kwargs)))
    monkeypatch.setattr(trainer_module, "StepDiagnostics", SimpleNamespace(
        for_run=lambda *args, **kwargs: ("diag", args, kwargs)))
    monkeypatch.setattr(trainer_module, "CollapseGuard", lambda *args: ("guard", args))
    monkeypatch.setattr(trainer_module, "LearningSignalNotice", lambda *args: ("signal", args))


def report(message):
    pass


def _calls(name):
    return [c[1:] for c in CALLS if c[0] == name]


def test_defaults_and_wiring_of_a_new_run(monkeypatch, tmp_path):
    _stub(monkeypatch)
    t = trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)), report=report)
    assert _calls("prepare") == [((tmp_path,), {"resume": False, "overwrite": False, "report": report})]
    assert t.device == "dev<cpu>" and t.run_dir == tmp_path and t.rank == 0 and t.world == 1
    assert t.config.stage == "raw+prec(dev<cpu>)+split(None,report)" and t.algo == "algo<raw+prec(dev<cpu>)>"
    assert _calls("validate") == [("raw",)]
    assert t.state is STATE and (STATE.iteration, STATE.optimizer_steps, STATE.actor_lr_scale) == (0, 0, 1.0)
    assert t._bar is None and t.sharded is False
    assert t.report is report and t.batch_hook is None
    assert _calls("ensure_process_group") == [] and _calls("seed") == [((7,), {})]
    assert _calls("check_resume") == [((t.config, t.algo, None, report), {})]
    assert _calls("build_state") == [((t.config, t.algo, "dev<cpu>", False, None, report), {})]
    assert _calls("backend") == [((t.config, STATE.stale_policy.model, STATE.tokenizer, 0, "weights<None>"), {})]
    names = [call[0] for call in CALLS]
    assert names.index("check_resume") < names.index("build_state")  # a refused change fails before the models load
    assert t.backend == "the backend"
    assert t.source == Source("live", RolloutContext(t.config, t.algo, tmp_path, STATE.tokenizer, "the backend", 0,
                                                     1, t.phase))
    assert STATE.sampler is t.source and t.probe == ("probe", (t.config, STATE.tokenizer, None))
    assert t.updater == ("updater", (STATE, t.config, t.algo), dict(
        device="dev<cpu>", rank=0, world=1, sharded=False, diagnostics=t.diagnostics, run_dir=tmp_path, report=report,
        phase=t.phase))
    assert t.learning_signal == ("signal", (t.config, t.algo, report, 1, "dev<cpu>"))
    assert _calls("load") == [] and _calls("drop") == []
    config = dataclasses.asdict(t.config)
    assert _calls("logger") == [(tmp_path, {"tensorboard": True, "wandb_project": "wb", "config": config})]
    assert _calls("truncate_after") == [(0, report)]
    assert (tmp_path / "config.yaml").read_text() == f"yaml {t.config.stage} algo<raw+prec(dev<cpu>)>"
    assert t.recorder is None and t.guard is None
    assert t.diagnostics == ("diag", (tmp_path, t.algo), dict(step_diagnostics=False, on_collapse="none",
                                                              sharded=False, iteration=0))


def test_resume_source_recorder_guard_and_sharding(monkeypatch, tmp_path):
    _stub(monkeypatch, checkpoint="CK")
    source = lambda context: Source("mine", context)  # noqa: E731
    config = FakeConfig(output_dir=str(tmp_path), critic_model="critic0")
    config.distributed.strategy, config.logging.save_rollouts, config.monitor.on_collapse = "fsdp2", True, "stop"
    t = trainer_module.Trainer(config, resume=True, overwrite=True, report=report, rollout_source=source)
    assert _calls("prepare")[0][1] == {"resume": True, "overwrite": True, "report": report}
    assert t.sharded is True and len(_calls("ensure_process_group")) == 1
    assert t.config.stage.endswith("+split(cfg<CK>,report)")
    assert _calls("check_resume") == [((t.config, t.algo, "CK", report), {})]
    assert _calls("build_state") == [((t.config, t.algo, "dev<cpu>", True, "CK", report), {})]
    assert _calls("backend")[0][0][-1] == "weights<CK>"
    assert _calls("load") == [(("CK", t.config, t.algo, Restore.RESUME, report), {})]
    names = [call[0] for call in CALLS]
    assert names.index("load") > names.index("backend")  # the sampler's position needs the source built
    assert _calls("drop") == [((tmp_path, 0), {})]
    assert t.source.name == "mine" and t.state.sampler is t.source and t.guard == ("guard", (t.config, tmp_path))
    kind, args, kwargs = t.recorder
    assert (kind, args) == ("recorder", (tmp_path, STATE.tokenizer, 0, 1))
    assert {k: kwargs[k] for k in ("iteration", "actor", "critic", "critic_model")} == dict(
        iteration=0, actor=STATE.actor, critic=None, critic_model="critic0")
    actor_full, critic_full = kwargs["full_states"]()  # gathered, as the run is sharded (None, None unsharded)
    assert set(actor_full) == {"weight", "bias"} and critic_full is None
    assert t.updater[2]["sharded"] is True and t.diagnostics[2]["sharded"] is True


def test_another_rank_reseeds_and_writes_nothing(monkeypatch, tmp_path):
    _stub(monkeypatch, rank=1, world=2, checkpoint="CK")
    t = trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)), report=report)
    assert _calls("seed") == [((7,), {}), ((701,), {})]
    assert t.logger is None and not (tmp_path / "config.yaml").exists()
    assert _calls("logger") == [] and _calls("drop") == []
    assert _calls("load") == [(("CK", t.config, t.algo, Restore.RESUME, report), {})]
    assert (t.source.context.rank, t.source.context.world) == (1, 2)
    assert t.updater[2]["rank"] == 1 and t.updater[2]["world"] == 2


def test_rank_two_reseeds_too(monkeypatch, tmp_path):
    _stub(monkeypatch, rank=2, world=2)
    trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)), report=report)
    assert _calls("seed") == [((7,), {}), ((702,), {})]


@pytest.mark.parametrize("prompts,mini", [(3, 2), (4, 3), (3, 3)])
def test_sizes_must_be_multiples_of_the_world(monkeypatch, tmp_path, prompts, mini):
    _stub(monkeypatch, world=2)
    config = FakeConfig(output_dir=str(tmp_path))
    config.rollout.prompts_per_iteration, config.optimizer.mini_batch_size = prompts, mini
    with pytest.raises(ValueError, match=rf"rollout.prompts_per_iteration \({prompts}\) and optimizer.mini_batch_size "
                                         rf"\({mini}\) must be multiples of the number of processes \(2\)"):
        trainer_module.Trainer(config, report=report)
    assert _calls("prepare") == []


def test_print_is_the_default_report(monkeypatch, tmp_path):
    _stub(monkeypatch)
    t = trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)))
    assert t.report is print and _calls("prepare")[0][1]["report"] is print
