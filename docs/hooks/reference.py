"""mkdocs hooks: the reference pages, generated from the code at every build, so they cannot drift.

A page asks for generated text with a marker on a line of its own::

    <!-- generated: app-config -->

and ``on_page_markdown`` replaces it. The generators:

- ``app-config``: every ``AppConfig`` field (dspark_ray/serve/config.py, pydantic ``model_fields``):
  name, type, constraints, default, description.
- ``engine-config``: every ``EngineConfig`` field (dspark_ray/engine/config.py, a dataclass). Its
  descriptions are the comments beside or above each field in the source, read with ``ast`` and
  ``tokenize``. A field without one takes the description of the ``AppConfig`` field of the same
  name, and says so; a field with neither fails the build.
- ``cli``: the ``dspark`` command's ``--help`` for the command and each subcommand, the subcommands
  found from the help itself (``dspark_ray.cli.main([..., "--help"])``, its output captured).
- ``request-fields``: the request fields of the OpenAI routes and the handle API
  (dspark_ray/openai/protocol.py and dspark_ray/serve/protocol.py, pydantic).

The texts are made once per build by this file run as a script (``on_pre_build``): a fresh process
sees the code as it is now, also on each rebuild of ``mkdocs serve``.

``on_files`` adds the runbooks (runbooks/*.md) to the site under operations/runbooks/, as they are.

Every failure raises ``PluginError``: an unknown marker, an undocumented field, a subcommand whose
help does not run. ``mkdocs build --strict`` (tests/test_docs.py) then fails.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import html
import io
import json
import os
import re
import subprocess
import sys
import tokenize
import types
import typing
from pathlib import Path

import yaml
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
RUNBOOKS_URI = "operations/runbooks"
# Source files the generated text comes from: `mkdocs serve` rebuilds when one changes.
SOURCES = ("dspark_ray/serve/config.py", "dspark_ray/engine/config.py", "dspark_ray/cli.py",
           "dspark_ray/openai/protocol.py", "dspark_ray/serve/protocol.py", "runbooks")
HELP_COLUMNS = "100"  # argparse wraps --help to $COLUMNS: a fixed width keeps the pages stable
# `dspark bench --served` is a mode of `bench` (bench/served.py) with options of its own.
CLI_MODES = (("bench", "--served"),)


# -- hooks --------------------------------------------------------------------------------------


def on_files(files, config):
    """Add each runbooks/*.md as operations/runbooks/<name>.md (README.md as the section's index)."""
    for path in sorted((REPO / "runbooks").glob("*.md")):
        name = "index.md" if path.name == "README.md" else path.name
        files.append(File.generated(config, f"{RUNBOOKS_URI}/{name}", content=path.read_text(encoding="utf-8")))
    return files


_generated: dict[str, str] = {}


def on_pre_build(config):
    """Generate every reference text in one fresh Python process: the code as it is now (also on each
    rebuild of `mkdocs serve`), torch imported once, nothing of it left in mkdocs' process."""
    env = {**os.environ, "COLUMNS": HELP_COLUMNS}
    try:
        done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        raise PluginError("generating the reference pages ran over 600 s") from None
    if done.returncode != 0:
        raise PluginError(f"generating the reference pages failed:\n{done.stderr[-4000:]}")
    _generated.clear()
    _generated.update(json.loads(done.stdout))


def on_page_markdown(markdown, page, config, files):
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in _generated:
            raise PluginError(f"{page.file.src_uri}: unknown marker 'generated: {name}'; "
                              f"known: {', '.join(GENERATORS)}")
        return _generated[name]

    return MARKER.sub(replace, markdown)


def on_serve(server, config, builder):
    for source in SOURCES:
        server.watch(str(REPO / source))
    return server


# -- formatting helpers -------------------------------------------------------------------------


def _escape(text: str) -> str:
    """Markdown text safe in a table cell and free of raw HTML: outside `code spans`, escape <, >, &
    and | (Python-Markdown's tables do not split on a | inside a code span)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1
                   else html.escape(p, quote=False).replace("|", "\\|") for p in parts)


def _yaml_value(value) -> str:
    """A default as it is written in a deploy YAML (None is null, True is true)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _type_name(tp) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, typing.ForwardRef):  # a model named before it was defined, as written
        return tp.__forward_arg__
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if tp is typing.Any:
        return "Any"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


CONSTRAINTS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥"),
               ("max_length", "length ≤"))


def _constraints(info) -> str:
    found = []
    for item in info.metadata:
        for attr, sign in CONSTRAINTS:
            value = getattr(item, attr, None)
            if value is not None:
                big = isinstance(value, int) and value >= 2**32 and value & (value - 1) == 0
                found.append(f"{sign} 2^{value.bit_length() - 1}" if big else f"{sign} {value}")
    return ", ".join(found)


def _pydantic_default(info) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    return f"`{_yaml_value(value)}`"


def _field_entry(name: str, type_text: str, default: str, description: str, extra: str = "") -> str:
    facts = f"**Type** `{type_text}`" + (f" ({extra})" if extra else "") + f" · **Default** {default}"
    return f"### `{name}` {{#{name}}}\n\n{facts}\n\n{_escape(description)}\n"


# -- AppConfig ----------------------------------------------------------------------------------


def app_config() -> str:
    from dspark_ray.serve.config import AppConfig

    entries = []
    for name, info in AppConfig.model_fields.items():
        if not info.description:
            raise PluginError(f"AppConfig.{name} has no description (dspark_ray/serve/config.py): give its Field "
                              "a description")
        entries.append(_field_entry(name, _type_name(info.annotation), _pydantic_default(info), info.description,
                                    _constraints(info)))
    return f"{len(entries)} fields, in the order of dspark_ray/serve/config.py.\n\n" + "\n".join(entries)


# -- EngineConfig -------------------------------------------------------------------------------


def engine_comments(source: str, class_name: str) -> dict[str, str]:
    """Each field of the dataclass ``class_name`` in ``source`` -> its comment: the comment lines
    right above the field, then the comment at the end of its line(s), joined."""
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][: tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    comments = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        beside = [trailing[r] for r in range(node.lineno, node.end_lineno + 1) if r in trailing]
        comments[node.target.id] = " ".join(above + beside).strip()
    return comments


def engine_description(name: str, comments: dict[str, str], app_fields: dict) -> str:
    """EngineConfig field ``name``'s description: its comment, else the AppConfig field of that name's
    description (said so); neither fails the build."""
    if comments.get(name):
        return comments[name]
    app_field = app_fields.get(name)
    if app_field is None or not app_field.description:
        raise PluginError(f"EngineConfig.{name} has no comment in dspark_ray/engine/config.py and no AppConfig "
                          "field of that name describes it: write a comment above the field")
    return f"{app_field.description} (No comment in dspark_ray/engine/config.py: this is AppConfig.{name}'s.)"


def engine_config() -> str:
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.serve.config import AppConfig

    source_path = REPO / "dspark_ray" / "engine" / "config.py"
    comments = engine_comments(source_path.read_text(encoding="utf-8"), "EngineConfig")
    entries = []
    for field in dataclasses.fields(EngineConfig):
        description = engine_description(field.name, comments, AppConfig.model_fields)
        if field.default is not dataclasses.MISSING:
            default = f"`{_yaml_value(field.default)}`"
        elif field.default_factory is not dataclasses.MISSING:
            default = f"`{_yaml_value(field.default_factory())}`"
        else:
            default = "required"
        type_text = field.type if isinstance(field.type, str) else _type_name(field.type)
        entries.append(_field_entry(field.name, type_text, default, description))
    return f"{len(entries)} fields, in the order of dspark_ray/engine/config.py.\n\n" + "\n".join(entries)


# -- the CLI ------------------------------------------------------------------------------------


def _help(args: tuple[str, ...]) -> str:
    """What `dspark <args> --help` prints (argparse exits after printing it)."""
    from dspark_ray import cli as dspark_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            dspark_cli.main([*args, "--help"])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise PluginError(f"`dspark {' '.join(args)} --help` exited with {exc.code}") from None
    if not out.getvalue().strip():
        raise PluginError(f"`dspark {' '.join(args)} --help` printed nothing")
    return out.getvalue().rstrip().replace(f"{REPO}/", "")  # defaults under the checkout, as relative paths


def subcommands(help_text: str) -> list[str]:
    """The subcommand names of an argparse help: the `{a,b,c}` line under "positional arguments"."""
    section = help_text.partition("positional arguments:")[2].partition("\noptions:")[0]
    match = re.search(r"^\s+\{([\w,-]+)\}", section, re.MULTILINE)
    return match.group(1).split(",") if match else []


def cli() -> str:
    top = _help(())
    commands = [(name,) for name in subcommands(top)]
    if not commands:
        raise PluginError("`dspark --help` lists no subcommands; dspark_ray/cli.py changed its help's shape")
    helps = {c: _help(c) for c in commands}
    nested = [(*c, sub) for c in commands for sub in subcommands(helps[c])]
    helps.update({c: _help(c) for c in [*nested, *(m for m in CLI_MODES if m[:1] in helps)]})
    parts = ["## dspark\n", f"```text\n{top}\n```\n"]
    for args in sorted(helps, key=lambda a: (commands.index(a[:1]), a)):
        title = " ".join(("dspark", *args))
        anchor = "-".join(a.lstrip("-") for a in args)
        level = "###" if len(args) > 1 else "##"
        parts.append(f"{level} `{title}` {{#{anchor}}}\n\n```text\n{helps[args]}\n```\n")
    return "\n".join(parts)


# -- request fields -----------------------------------------------------------------------------


def _fields_table(model, names) -> str:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name in names:
        info = model.model_fields[name]
        key = info.alias or name
        extra = _constraints(info)
        rows.append(f"| `{key}` | `{_type_name(info.annotation)}`{' (' + extra + ')' if extra else ''} | "
                    f"{_escape(_pydantic_default(info))} | {_escape(info.description or '')} |")
    return "\n".join(rows) + "\n"


def _redefined(model, base, name: str) -> bool:
    """Whether ``model`` gives the field ``name`` of ``base`` another default or description."""
    mine, theirs = model.model_fields[name], base.model_fields[name]
    return (mine.default, mine.description) != (theirs.default, theirs.description)


def request_fields() -> str:
    from dspark_ray.openai import protocol as p
    from dspark_ray.serve.protocol import GenerateRequest

    shared = list(p.SamplingFields.model_fields)
    openai = [n for n in p._OpenAIRequest.model_fields if n not in shared]
    sections = [
        ("Every request (completions, chat, handle)", p.SamplingFields, shared),
        ("Both OpenAI routes", p._OpenAIRequest, openai),
        ("`POST /v1/completions`", p.CompletionRequest,
         [n for n in p.CompletionRequest.model_fields if n not in shared + openai]),
        ("`POST /v1/chat/completions`", p.ChatCompletionRequest,
         [n for n in p.ChatCompletionRequest.model_fields if n not in shared + openai]),
        ("Handle API: `GenerateRequest`", GenerateRequest,
         [n for n in GenerateRequest.model_fields if n not in shared or _redefined(GenerateRequest, p.SamplingFields, n)]),
    ]
    return "\n".join(f"### {title}\n\n{_fields_table(model, names)}" for title, model, names in sections)


GENERATORS = {"app-config": app_config, "engine-config": engine_config, "cli": cli,
              "request-fields": request_fields}


if __name__ == "__main__":  # the child process of on_pre_build: every generated text, as JSON
    os.environ["COLUMNS"] = HELP_COLUMNS
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
        texts = {name: generate() for name, generate in GENERATORS.items()}
    json.dump(texts, sys.stdout)
