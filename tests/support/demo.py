"""Recorders standing in for the demo's trainer, agents and evaluations."""

from __future__ import annotations

import io

from stppo_agent.training.demo_progress import DemoProgress


class Recorder(DemoProgress):
    def __init__(self):
        super().__init__(stream=io.StringIO(), out=lambda text: self.calls.append(("say", text)), clock=lambda: 0.0)
        self.calls = []

    def phase(self, name, total=0):
        self.calls.append(("phase", name, total))
        super().phase(name, total)

    def step(self, done, detail=""):
        self.calls.append(("step", done, detail))
        super().step(done, detail)

    def note(self, detail):
        self.calls.append(("note", detail))
        super().note(detail)


class CountingAgent:
    def __init__(self):
        self.generated = {}

    def act(self, episodes):
        for episode in episodes:
            if episode.turn == 0:  # as the hf: agent does, a new episode's count starts again
                self.generated[episode.episode_id] = 0
            self.generated[episode.episode_id] = self.generated.get(episode.episode_id, 0) + 10
        return ["a"] * len(episodes)

    def generated_tokens(self, episode_id):
        return self.generated.get(episode_id, 0)
