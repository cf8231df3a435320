"""A call recorder standing in for the transformers loaders."""

from __future__ import annotations


class Recorder:
    """Stands for a transformers ``from_pretrained`` (or any callable): records its calls, returns ``result``."""

    def __init__(self, result=None, error: BaseException | None = None):
        self.calls, self.result, self.error = [], result, error

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return self.result
