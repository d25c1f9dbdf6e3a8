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


def leader_of(admin: AdminClient, partition: int) -> int:
    return int(admin.list_topics(OFFSETS_TOPIC, timeout=10).topics[OFFSETS_TOPIC].partitions[partition].leader)


def main(bootstrap: str, group: str, topic: str, partition: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    committed = CommittedOffsets(timeout_s=10, bootstrap=bootstrap)
    before = committed.on_topic(group, topic, [0])[0]  # the coordinator is now known (cached)
    was = leader_of(admin, partition)
    admin.elect_leaders(ElectionType.PREFERRED, [TopicPartition(OFFSETS_TOPIC, partition)]).result(30)
    deadline = time.monotonic() + 30
    while leader_of(admin, partition) == was and time.monotonic() < deadline:
        time.sleep(0.2)
    after = []
    for _ in range(5):  # the first reads go to the old coordinator, which answers NOT_COORDINATOR
        after.append(committed.on_topic(group, topic, [0])[0])
        time.sleep(0.2)
    committed.close()
    print(json.dumps({"before": before, "after": after, "coordinator_was": was,
                      "coordinator_now": leader_of(admin, partition)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
