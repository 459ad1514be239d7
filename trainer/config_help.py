"""``python train.py --help``: usage, the config groups, and the option table generated from the structured
configs of trainer/config.py (each key, its value in the composed config, the comment on its line there), so
the help has one source. This module imports nothing of trainer/: the schema and the conf folder come in as
arguments, so trainer.config can import it without an import cycle."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
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


HELP = """Train a GPT: python train.py [-m] [group=option ...] [key=value ...]   (README.md has more)

  python train.py                                  tiny char-level GPT on Shakespeare (CPU ok)
  python train.py attn=fa2 model=gpt2 data=shakespeare_bpe trainer.compile=true
  python train.py run.name=exp1 trainer.max_steps=5000   resumes runs/exp1 if it has checkpoints
  python train.py -m attn=sdpa,fa2 run.name=cmp          one job per value: runs/cmp/0, runs/cmp/1

== Config groups (group=option) ==
{groups}

== Options (key, value with these arguments, meaning) ==
{options}

Ctrl-C or SIGTERM saves a checkpoint and exits 130/143; a run folder belongs to one running process."""


def help_text(root: DictConfig, schema: type, conf_dir: str | Path) -> str:
    """The text of ``--help``: usage, each config group of ``conf_dir`` with its options, and
    ``option_table(root, schema)``."""
    groups = [f"{d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}"
              for d in sorted(Path(conf_dir).iterdir()) if d.is_dir()]
    return HELP.format(groups="\n".join(groups), options=option_table(root, schema))


def option_table(root: DictConfig, schema: type) -> str:
    """Aligned 'key  value  comment' lines of ``schema`` (the top-level config dataclass) with the values of
    ``root`` (a composed config)."""
    rows = _rows(root, schema)
    width = [max(len(r[i]) for r in rows) for i in (0, 1)]
    return "\n".join(f"  {k:<{width[0]}}  {v:<{width[1]}}  {c}".rstrip() for k, v, c in rows)
