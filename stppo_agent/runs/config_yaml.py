"""Reading the YAML of config files and of a run's config.yaml."""

from __future__ import annotations

import re

import yaml


class NumberLoader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads ``1e-6`` as a string (its floats need a dot); this loader reads every common
    spelling of a number as one: 1e-6, 1E+3, .5, 5., -2.5e-3, as YAML 1.2 and JSON do."""


NumberLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))
