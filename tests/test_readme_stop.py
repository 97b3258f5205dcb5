"""The README's stop commands, run as a newcomer runs them: ``serve run deploy/dspark.yaml`` in one
shell, then, from a second shell with a clean environment, the two commands the README gives, read
from the README itself. The server must stop answering and ``serve run`` must end.

The YAML is the shipped pair's (deploy/shakespeare.yaml: it starts in seconds, where the real model
takes minutes; what is tested is how the server stops) with only its HTTP port moved (a free one),
the model paths made absolute and the model left eager; it sits at ``deploy/dspark.yaml`` of a scratch folder (with
``.venv`` linked in), so the command lines are exactly the README's.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import httpx
import pytest
import yaml

from conftest import REPO
from dspark_ray.ops.processes import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def readme_commands() -> tuple[str, str]:
    """The README's two stop commands (in backticks in the Quick start's paragraph)."""
    text = (REPO / "README.md").read_text()
    shutdown = re.search(r"`(RAY_AUTH_MODE=token \.venv/bin/serve shutdown -y)`", text)
    pkill = re.search(r"`(pkill -f 'serve run deploy/dspark\.yaml')`", text)
    assert shutdown and pkill, "the README no longer gives the stop commands this test runs"
    return shutdown.group(1), pkill.group(1)


def clean_env() -> dict[str, str]:
    """A second shell's environment: nothing of this test process's Ray or Python settings."""
    return {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def test_the_readme_stop_commands_stop_the_server(tmp_path):
    import ray

    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    port = free_port()
    config = yaml.safe_load((REPO / "deploy" / "shakespeare.yaml").read_text())
    args = config["applications"][0]["args"]
    args["http_port"] = port
    args["compile_model"] = False  # seconds less to start; how it stops is the same
    for key in ("model", "draft"):
        args[key] = str(REPO / args[key])
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "dspark.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    shutdown, pkill = readme_commands()
    log = open(tmp_path / "serve-run.log", "wb")
    proc = subprocess.Popen([".venv/bin/serve", "run", "deploy/dspark.yaml"], cwd=tmp_path, env=clean_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve-run.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve run did not come up"
            time.sleep(1)

        done = subprocess.run(["bash", "-c", shutdown], cwd=tmp_path, env=clean_env(), capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

        def answering() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + 60
        while answering():
            assert time.monotonic() < deadline, "the API still answers after `serve shutdown -y`"
            time.sleep(0.5)

        subprocess.run(["bash", "-c", pkill], cwd=tmp_path, env=clean_env(), timeout=30)
        assert proc.wait(timeout=90) is not None  # serve run ended, and with it its local Ray cluster
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        log.close()
