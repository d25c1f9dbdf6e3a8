"""requirements.lock pins every dependency pyproject.toml names, at the same version, with hashes.

``infra/setup.sh`` installs from the lock alone (``--require-hashes``), so a pin changed in
pyproject.toml without regenerating the lock would silently not be installed:
``pip-compile --generate-hashes --allow-unsafe --strip-extras --extra test
--no-emit-index-url --no-emit-find-links -o requirements.lock pyproject.toml`` regenerates it.
"""

from __future__ import annotations

import re
import tomllib

from choreo.config import REPO_ROOT

PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    text = (REPO_ROOT / "requirements.lock").read_text()
    return {canonical(m.group(1)): m.group(2) for line in text.splitlines() if (m := PIN.match(line))}


def test_every_pyproject_pin_is_in_the_lock_at_the_same_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    pins = lock_pins()
    stale = []
    for requirement in wanted:
        match = PIN.match(requirement)
        assert match, f"{requirement!r} is not pinned exactly in pyproject.toml"
        name, version = canonical(match.group(1)), match.group(2)
        if pins.get(name) != version:
            stale.append(f"{requirement} (lock: {pins.get(name, 'missing')})")
    assert not stale, "requirements.lock is stale; regenerate it (see this module's doc): " + ", ".join(stale)


def test_every_locked_package_has_hashes() -> None:
    text = (REPO_ROOT / "requirements.lock").read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 1)[1])
    pinned = [b for b in blocks if PIN.match(b)]
    assert len(pinned) == len(lock_pins()) > 20
    assert all("--hash=sha256:" in block for block in pinned)
