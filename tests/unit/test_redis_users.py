"""Each principal's Redis user and key prefixes come from the workflow's declarations: a
service's record or pool is its own, a new service (tests/customs) gets a user without an
edit to the tools, and the ACL file gives each user exactly its prefixes."""

from __future__ import annotations

import pytest

from consumers.workflow import WORKFLOW
from infra.redis_server import acl_file_text, key_rules
from infra.security import derive_policy, redis_key_prefixes
from tests.customs.workflow import WORKFLOW as CUSTOMS

STEP_STATE = {"dl", "deadlines", "layout", "seen", "fx"}


def test_every_principal_has_a_user_and_owns_only_what_it_declares() -> None:
    users = redis_key_prefixes(WORKFLOW, derive_policy(WORKFLOW))
    assert set(users) == set(derive_policy(WORKFLOW).users)
    assert set(users["package"]) == STEP_STATE | {"pkg"}
    assert set(users["drone-scheduler"]) == STEP_STATE | {"fleet"}
    assert set(users["notifier"]) == STEP_STATE | {"notified"}
    assert set(users["delivery"]) == STEP_STATE
    # the supervisor's lease, release queue and list of undos awaiting an operator, the records
    # released with a delivery, and the fleet it gives a shipped delivery's drone back to
    assert set(users["supervisor"]) == STEP_STATE | {"lease", "release", "awaiting-operator", "pkg", "notified",
                                                     "fleet"}
    assert set(users["ingestion"]) == {"dl", "deadlines", "layout", "ingestion", "owner", "idem"}
    assert users["schema-registry"] == ["registry"] and users["ops"] == ["*"]


def test_a_new_service_gets_its_own_user_and_records() -> None:
    users = redis_key_prefixes(CUSTOMS, derive_policy(CUSTOMS))
    assert set(users["customs"]) == STEP_STATE | {"clearance"}
    assert "clearance" not in users["package"]


def test_the_acl_file_scopes_each_user_to_its_prefixes() -> None:
    text = acl_file_text({"package": "p", "ops": "o"}, {"package": ["dl", "pkg"]})
    package = next(line for line in text.splitlines() if line.startswith("user package "))
    assert "~dl ~dl:* ~pkg ~pkg:*" in package and "~*" not in package.replace("~dl:*", "").replace("~pkg:*", "")
    assert "-@admin -@dangerous" in package and "&" not in package
    ops = next(line for line in text.splitlines() if line.startswith("user ops "))
    assert " ~* " in ops
    for bad in ([""], ["a b"], ["a?"], ["a[b]"]):
        with pytest.raises(ValueError):
            key_rules(bad)
