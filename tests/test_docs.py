"""The documentation: the site builds strictly, its references cover the code, its paths exist.

- ``mkdocs build --strict`` succeeds: a broken link or anchor, or a page left out of the
  navigation, is a warning and fails the build (mkdocs.yml ``validation``).
- The generated references (docs/hooks/reference.py) hold every AppConfig field, every
  EngineConfig field and every ``dspark`` subcommand, each found here independently of the hook:
  the fields from the classes, the subcommands from the argparse parser itself.
- Every repository path the docs, the README and the deploy YAMLs' comments name
  (``dspark_ray/...``, ``deploy/...``, ``bench/...``, ``runbooks/...``, ...) exists, so a later
  change of layout must update them.
- The README stays short.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

HOOK = REPO / "docs" / "hooks" / "reference.py"
# Paths that name outputs of a run, not files of the repository: benchmark results, the drafter
# recipe's scratch and output folders, vLLM's venv, optional downloaded data.
OUTPUTS = ("bench/out/", "bench/.vllm-venv", "models/.work", "models/.data", "models/smollm2-dspark")
PATH = re.compile(r"(?<![\w/.-])((?:dspark_ray|kernels|deploy|bench|runbooks|dashboards|models|tests|docs)/"
                  r"[\w./*<>-]*)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_page(site):
    for name in ("getting-started", "reference/configuration", "reference/engine-config", "reference/cli",
                 "reference/request-fields", "operations/runbooks/slots", "performance/history"):
        assert (site / name / "index.html").is_file(), name
    assert "generated:" not in page(site, "reference/configuration"), "a marker was left unreplaced"


@pytest.mark.slow
def test_every_appconfig_field_is_in_the_configuration_reference(site):
    from dspark_ray.serve.config import AppConfig

    html = page(site, "reference/configuration")
    missing = [name for name in AppConfig.model_fields if f'id="{name}"' not in html]
    assert not missing, f"AppConfig fields missing from docs/reference/configuration.md: {missing}"
    for name, info in AppConfig.model_fields.items():  # the description is there, not only the name
        first_words = re.escape(info.description.split()[0])
        assert re.search(first_words, html), name


@pytest.mark.slow
def test_every_engineconfig_field_is_in_the_engine_reference(site):
    from dspark_ray.engine.config import EngineConfig

    html = page(site, "reference/engine-config")
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f'id="{f.name}"' not in html]
    assert not missing, f"EngineConfig fields missing from docs/reference/engine-config.md: {missing}"


def cli_commands() -> list[tuple[str, ...]]:
    """Every subcommand path of `dspark`, read from the argparse parser that cli.main builds."""
    from dspark_ray import cli

    class Built(Exception):
        pass

    def capture(parser, *args, **kwargs):
        raise Built(parser)

    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = capture
    try:
        cli.main([])
    except Built as built:
        parser = built.args[0]
    finally:
        argparse.ArgumentParser.parse_known_args = original

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        found = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += [(*path, name), *walk(sub, (*path, name))]
        return found

    return walk(parser, ())


@pytest.mark.slow
def test_every_cli_subcommand_is_in_the_cli_reference(site):
    html = page(site, "reference/cli")
    commands = cli_commands()
    assert ("generate",) in commands and ("dashboards", "push") in commands  # the walk itself works
    missing = [c for c in commands if f'id="{"-".join(c)}"' not in html or f"usage: dspark {' '.join(c)}" not in html]
    assert not missing, f"subcommands missing from docs/reference/cli.md: {missing}"


def documented_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "deploy").glob("*.yaml"))]


def test_every_path_the_docs_name_exists():
    missing = []
    for file in documented_files():
        text = file.read_text(encoding="utf-8")
        in_site = file.is_relative_to(REPO / "docs")
        for match in PATH.finditer(text):
            path = match.group(1).rstrip(".")
            if "<" in path or path.startswith(OUTPUTS):
                continue
            if in_site and text[:match.start()].endswith("]("):  # a link between pages: mkdocs checks it
                continue
            if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(f"{file.relative_to(REPO)}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the detail into docs/"


def load_hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_field_descriptions_come_from_the_comments_and_a_missing_one_fails():
    from mkdocs.exceptions import PluginError

    hook = load_hook()
    source = '''
@dataclass(frozen=True)
class Settings:
    # Above the field,
    # on two lines.
    first: int = 1  # and beside it
    second: str = "x"  # beside only
    third: bool = False
'''
    comments = hook.engine_comments(source, "Settings")
    assert comments == {"first": "Above the field, on two lines. and beside it", "second": "beside only", "third": ""}
    assert hook.engine_description("second", comments, {}) == "beside only"
    with pytest.raises(PluginError, match="EngineConfig.third has no comment"):
        hook.engine_description("third", comments, {})
