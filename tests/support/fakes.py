"""A call recorder shared by the process-group, shared-retrieval and plugin tests."""

from __future__ import annotations


class Calls(list):
    """Records calls as (name, args, kwargs); ``fn(name, result)`` makes a recording stand-in."""

    def fn(self, name, result=None):
        def record(*args, **kwargs):
            self.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result
        return record
