"""``python train.py --help``: the option table, generated from the structured configs in
trainer/config.py (each key, its value in the composed config, the comment on its line there), so
the help has one source. Used through the ``option_table`` resolver in conf/config.yaml's
``hydra.help.template``."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer import config as config_module


def _field_comments() -> dict[str, dict[str, str]]:
    """{dataclass name: {field: the comment on its line}} for every dataclass in trainer/config.py."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                item.target.id: lines[item.lineno - 1].partition("#")[2].strip()
                for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return out


def _rows(root: DictConfig) -> list[tuple[str, str, str]]:
    comments = _field_comments()
    rows = []
    top = comments["Config"]
    sections = {f.name: f.type for f in config_module.Config.__dataclass_fields__.values()}
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


def option_table(*, _root_: DictConfig) -> str:
    """Aligned 'key  value  comment' lines; '$' doubled for the help template (string.Template)."""
    rows = _rows(_root_)
    width = [max(len(r[i]) for r in rows) for i in (0, 1)]
    text = "\n".join(f"  {k:<{width[0]}}  {v:<{width[1]}}  {c}".rstrip() for k, v, c in rows)
    return text.replace("$", "$$")
