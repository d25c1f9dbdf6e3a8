"""requirements.lock pins every dependency pyproject.toml names, at the same version, with hashes.

``infra/setup.sh`` installs from the lock alone (``--require-hashes``), so a pin changed in
pyproject.toml without regenerating the lock would silently not be installed:
``pip-compile --generate-hashes --allow-unsafe --extra test --no-emit-index-url
--no-emit-find-links -o requirements.lock pyproject.toml`` regenerates it. Extras stay in
the lock: pip in hash mode takes a dependency's ``pkg[extra]>=x`` as a requirement of its
own, and once the index has a newer ``pkg`` than the pin it asks for that one, unpinned, and
stops the install.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from packaging.requirements import Requirement

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


def test_what_a_locked_package_asks_with_extras_is_locked_with_them() -> None:
    """``pip-audit`` asks for ``CacheControl[filecache]>=0.13.0``: locked as plain
    ``cachecontrol``, a clean install failed the day the index had a newer CacheControl."""
    text = (REPO_ROOT / "requirements.lock").read_text()
    extras = {canonical(m.group(1)): set(m.group(2).split(",")) for line in text.splitlines()
              if (m := re.match(r"^([A-Za-z0-9_.-]+)\[([^\]]*)\]==", line))}
    pins = lock_pins()
    missing = []
    for name in pins:
        try:
            asked = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # not for this platform
            continue
        for spec in asked:
            requirement = Requirement(spec)
            if requirement.marker is not None and "extra" in str(requirement.marker):
                continue  # only with an extra of its own, which nothing here asks for
            wanted = canonical(requirement.name)
            if requirement.extras and wanted in pins and not requirement.extras <= extras.get(wanted, set()):
                missing.append(f"{name} asks for {spec}")
    assert not missing, missing
