"""What ``stppo train --help`` adds to the options: every setting of the grouped config with its default, and with
``--algo NAME`` what that algorithm's rules read (:mod:`stppo_agent.algorithms.hyperparameters`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

from stppo_agent.algorithms.hyperparameters import DECLARATIONS, rule_declarations


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (its source's string after ``name: type = ...``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body, docs = tree.body[0].body, {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(following, ast.Expr) \
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def first_sentence(text: str) -> str:
    head = re.split(r"(?<!e\.g)(?<!i\.e)\. ", text)[0]
    return head if len(head) <= 100 else head[:97] + "..."


def describe(algo) -> str:
    """What ``stppo train --algo NAME --help`` prints: the preset's rules, the fields each reads with the preset's
    value, the hyper-parameters they define, and the fields every rule shares."""
    from stppo_agent.algorithms.config import AlgorithmConfig

    docs = field_docs(AlgorithmConfig)
    lines = [f"algorithm {algo.name}: policy loss {algo.policy_loss}, advantage estimator {algo.advantage} "
             "(set with --set algorithm.KEY=VALUE)"]
    read = {"name", "policy_loss", "advantage", "hyperparameters"}
    own_values = dict(algo.hyperparameters)
    for kind, name, declaration in rule_declarations(algo):
        lines.append(f"  {kind} {name} reads:" if declaration.reads or declaration.hyperparameters
                     else f"  {kind} {name} declares no field of its own")
        for field in declaration.reads:
            lines.append(f"    {field} = {getattr(algo, field)!r}  {first_sentence(docs.get(field, ''))}")
            read.add(field)
        for parameter in declaration.hyperparameters:
            value = own_values.get(parameter.name, parameter.default)
            lines.append(f"    {parameter.name} = {value!r}  (its own) {parameter.help}")
    specific = {field for declaration in DECLARATIONS.values() for field in declaration.reads}
    lines.append("  every rule (fields no registered rule claims as its own):")
    for field in dataclasses.fields(AlgorithmConfig):
        if field.name not in read | specific:
            value, doc = getattr(algo, field.name), first_sentence(docs.get(field.name, ""))
            lines.append(f"    {field.name} = {value!r}  {doc}")
    return "\n".join(lines)


def settings_help(algo: str | None = None, imports: list[str] = ()) -> str:
    """Every setting with its default and the first sentence of its documentation, section by section; with
    ``algo``, what that algorithm's rules read (:func:`describe`)."""
    from stppo_agent.algorithms import ALGORITHMS
    from stppo_agent.plugins.loader import load_plugins
    from stppo_agent.training.config import TrainConfig
    from stppo_agent.training.config_sections import SECTIONS

    lines = ["settings (--set KEY=VALUE, or a --config YAML file with one mapping per section):"]
    for name, cls in [("top level", TrainConfig), *SECTIONS.items()]:
        docs = field_docs(cls)
        lines.append(f"  {name}:" if cls is TrainConfig else f"  {name}: {first_sentence(field_docs_of_class(cls))}")
        for field in dataclasses.fields(cls):
            if cls is TrainConfig and (field.name in SECTIONS or field.name == "algorithm_resolved"):
                continue
            key = field.name if cls is TrainConfig else f"{name}.{field.name}"
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            lines.append(f"    {key}={default}  {first_sentence(docs.get(field.name, ''))}")
    if algo:
        load_plugins(list(imports))
        lines += ["", describe(ALGORITHMS[algo])]
    else:
        lines += ["", "stppo train --algo NAME --help adds the settings that algorithm's rules read."]
    return "\n".join(lines)


def field_docs_of_class(cls) -> str:
    return " ".join((cls.__doc__ or "").split())
