"""The customs step added in tests/customs/ reaches every derived artefact without an edit to
the tools: the generated AsyncAPI and Mermaid docs, the secured stack's ACLs, the supervisor's
policies (the behaviour on the real stack: tests/integration/test_customs.py)."""

from __future__ import annotations

from choreo.ops import flowdoc
from choreo.supervisor import policies_of
from infra.security import Acl, derive_policy
from tests.customs.workflow import WORKFLOW


def test_the_generated_docs_show_customs() -> None:
    flow = flowdoc.flow_markdown(WORKFLOW)
    assert "customs.cleared" in flow and "undo.customs" in flow and "revoke_customs" in flow
    assert "| customs | customs | delivery.requested | 5 s |" in flow
    channels = flowdoc.asyncapi(WORKFLOW)["channels"]
    assert {flowdoc.channel_id(t) for t in ("customs.cleared", "customs.refused", "customs.revoked",
                                            "undo.customs")} <= set(channels)


def test_the_secured_stack_grants_customs_what_it_reads_and_writes() -> None:
    acls = set(derive_policy(WORKFLOW).acls)
    assert {Acl("customs", "topic", "delivery.requested", "READ"),
            Acl("customs", "topic", "customs.cleared", "WRITE"),
            Acl("customs", "topic", "customs.refused", "WRITE"),
            Acl("customs", "topic", "undo.customs", "READ"),
            Acl("customs", "topic", "customs.revoked", "WRITE"),
            Acl("delivery", "topic", "customs.cleared", "READ"),
            Acl("supervisor", "topic", "undo.customs", "WRITE"),
            Acl("supervisor", "topic", "customs.revoked", "READ")} <= acls
    assert Acl("customs", "topic", "delivery.shipped", "WRITE") not in acls


def test_the_supervisor_knows_customs_from_its_declarations() -> None:
    policies = policies_of(WORKFLOW)
    assert policies.steps["delivery"].waits_for == ("package", "drone", "customs")
    assert "customs" in policies.compensable and policies.steps["revoke_customs"].target == "customs"
    assert WORKFLOW.compensations()["customs"][0] == "revoke_customs"
