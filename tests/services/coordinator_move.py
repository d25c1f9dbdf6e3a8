"""Read a group's committed offset, move the group's coordinator, and read it again.

Run as its own process by ``test_stack_three_nodes``: the failure it guards against is a
segmentation fault (librdkafka #5040, reading offsets through the admin client when the
coordinator has moved), which would take a test process down with it.

    python -m tests.services.coordinator_move <bootstrap> <group> <topic> <offsets partition>

Prints one JSON line: the offsets read before and after, and the coordinator's broker
before and after the preferred-leader election.
"""

from __future__ import annotations

import json
import sys
import time

from confluent_kafka import ElectionType, TopicPartition
from confluent_kafka.admin import AdminClient

from choreo.kafka import CommittedOffsets

OFFSETS_TOPIC = "__consumer_offsets"


def offsets_partition(admin: AdminClient, group: str) -> int:
    """The ``__consumer_offsets`` partition whose leader coordinates ``group`` (Kafka's
    ``abs(group.hashCode()) % partitions``)."""
    count = len(admin.list_topics(OFFSETS_TOPIC, timeout=10).topics[OFFSETS_TOPIC].partitions)
    h = 0
    for ch in group:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return (h & 0x7FFFFFFF) % count


def offsets_leadership(admin: AdminClient, partition: int) -> tuple[int, int, int]:
    """(leader, preferred replica, in-sync replicas) of a ``__consumer_offsets`` partition."""
    meta = admin.list_topics(OFFSETS_TOPIC, timeout=10).topics[OFFSETS_TOPIC].partitions[partition]
    return meta.leader, meta.replicas[0], len(meta.isrs)


def main(bootstrap: str, group: str, topic: str, partition: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    # the first read may take a minute: a broker of this cluster was just restarted, and on a
    # loaded machine the first lookup of the coordinator has taken over ten seconds. The reads
    # after the move, the ones under test, have the ten seconds they always had
    committed = CommittedOffsets(timeout_s=60, bootstrap=bootstrap)
    before = committed.on_topic(group, topic, [0])[0]  # the coordinator is now known (cached)
    committed.timeout_s = 10
    was = offsets_leadership(admin, partition)[0]
    admin.elect_leaders(ElectionType.PREFERRED, [TopicPartition(OFFSETS_TOPIC, partition)]).result(30)
    deadline = time.monotonic() + 30
    while offsets_leadership(admin, partition)[0] == was and time.monotonic() < deadline:
        time.sleep(0.2)
    after = []
    for _ in range(5):  # the first reads go to the old coordinator, which answers NOT_COORDINATOR
        after.append(committed.on_topic(group, topic, [0])[0])
        time.sleep(0.2)
    committed.close()
    print(json.dumps({"before": before, "after": after, "coordinator_was": was,
                      "coordinator_now": offsets_leadership(admin, partition)[0]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
