"""On the secured broker, the outcome copies' ACL: the services that publish a deciding event
may write under the reply prefix and nowhere else outside their declarations; no other
principal may write there."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient

from choreo.outcomes import reply_prefix
from tests.integration.test_security_kafka import Secured, produce, secured  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def test_only_the_deciding_services_may_write_reply_topics(secured: Secured) -> None:  # noqa: F811
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    unique = uuid.uuid4().hex[:6]
    reply, elsewhere = f"{reply_prefix()}acme.{unique}", f"acme.{reply_prefix()}{unique}"
    admin = AdminClient(secured.cluster.client_config())
    for name in (reply, elsewhere):
        admin.create_topics([NewTopic(name, 1, -1)])[name].result(30)
    for user in ("delivery", "supervisor"):
        assert produce(secured.config(user), reply) is None, user
        err = produce(secured.config(user), elsewhere, timeout_s=10)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, user
    for user in ("package", "drone-scheduler", "notifier"):
        err = produce(secured.config(user), reply, timeout_s=10)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, user
    err = produce(secured.config("ingestion", **{"enable.idempotence": True, "acks": "all"}), reply, timeout_s=10)
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
