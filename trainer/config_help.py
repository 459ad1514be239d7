"""``python train.py --help``: the option table, generated from the structured configs of trainer/config.py
(each key, its value in the composed config, the comment on its line there), so the help has one source.
``trainer.config.register_configs`` registers ``option_table`` (bound to its ``Config`` dataclass) as the
resolver used in conf/config.yaml's ``hydra.help.template``. This module imports nothing of trainer/: the
schema comes in as an argument, so trainer.config can import it without an import cycle."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf


def _field_comments(schema: type) -> dict[str, dict[str, str]]:
    """{dataclass name: {field: the comment on its line}} for every dataclass in the module defining ``schema``."""
    source = inspect.getsource(inspect.getmodule(schema))
    lines = source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                item.target.id: lines[item.lineno - 1].partition("#")[2].strip()
                for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return out


def _rows(root: DictConfig, schema: type) -> list[tuple[str, str, str]]:
    comments = _field_comments(schema)
    rows = []
    top = comments[schema.__name__]
    sections = {f.name: f.type for f in dataclasses.fields(schema)}
    for name in top:
        section_class = sections[name] if isinstance(sections[name], str) else sections[name].__name__
        if section_class in comments:  # a section: one row per key
            values = OmegaConf.to_container(root[name], resolve=False)
            rows += [(f"{name}.{key}", _show(values.get(key)), comment)
                     for key, comment in comments[section_class].items()]
        else:
            rows.append((name, _show(root[name]), top[name]))
    return rows


def _show(value: Any) -> str:
    if isinstance(value, str) and value.startswith("${"):  # e.g. run.name's default, made at start
        return "<computed>"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def option_table(*, _root_: DictConfig, schema: type) -> str:
    """Aligned 'key  value  comment' lines of ``schema`` (the top-level config dataclass) with the values of
    ``_root_``; '$' doubled for the help template (string.Template)."""
    rows = _rows(_root_, schema)
    width = [max(len(r[i]) for r in rows) for i in (0, 1)]
    text = "\n".join(f"  {k:<{width[0]}}  {v:<{width[1]}}  {c}".rstrip() for k, v, c in rows)
    return text.replace("$", "$$")
