"""Malformed records in the registry's store topic are skipped and reported: the registry
keeps working, and a restarted one starts.

Real registry processes (own port, own store topic), started as the stack starts them; the
records are written straight into the topic, as a foreign or broken writer would.
"""

from __future__ import annotations

import json

import httpx
import pytest
from confluent_kafka import Producer

from choreo.config import settings
from tests.integration.test_registry_instances import Starter, instances  # noqa: F401 (fixture)
from tests.integration.test_registry_lock import CT, SMALL, big

pytestmark = pytest.mark.integration

DEEP = b"[" * 100_000 + b"]" * 100_000
MALFORMED: list[tuple[str, bytes, bytes]] = [
    ("key nested too deeply", DEEP, b"{}"),
    ("value nested too deeply", b'{"keytype":"CONFIG","subject":null,"magic":0}', DEEP),
    ("version 1e999 (infinite)", b'{"keytype":"SCHEMA","subject":"bad","version":1e999,"magic":1}',
     b'{"subject":"bad","version":1,"id":1,"deleted":false}'),
    ("id 1e400 (infinite)", b'{"keytype":"SCHEMA","subject":"bad","version":1,"magic":1}',
     b'{"subject":"bad","version":1,"id":1e400,"deleted":false}'),
    ("schema id 1e999", b'{"keytype":"SCHEMA_ID","id":7,"magic":0}',
     b'{"id":1e999,"schema":"\\"int\\"","schemaType":"AVRO"}'),
    ("id of 5,000 digits", b'{"keytype":"SCHEMA_ID","id":7,"magic":0}',
     b'{"id":' + b"9" * 5000 + b',"schema":"\\"int\\"","schemaType":"AVRO"}'),
    ("id past 32 bits", b'{"keytype":"SCHEMA","subject":"bad","version":2,"magic":1}',
     b'{"subject":"bad","version":2,"id":2147483648000,"deleted":false}'),
    ("subject of the wrong type", b'{"keytype":"SCHEMA","subject":["x"],"version":3,"magic":1}',
     b'{"id":1,"deleted":false}'),
    ("version of the wrong type", b'{"keytype":"SCHEMA","subject":"bad","version":"4","magic":1}',
     b'{"id":1,"deleted":false}'),
    ("mode of the wrong type", b'{"keytype":"MODE","subject":null,"magic":0}', b'{"mode":{"a":1}}'),
    ("schema text of the wrong type", b'{"keytype":"SCHEMA_ID","id":9,"magic":0}',
     b'{"id":9,"schema":["int"],"schemaType":"AVRO"}'),
    ("key not UTF-8", b"\xff\xfe\xfd", b"{}"),
    ("value not UTF-8", b'{"keytype":"SCHEMA_ID","id":8,"magic":0}', b'{"id":8,"schema":"\xff\xfe"}'),
]


def write_raw(topic: str, records: list[tuple[str, bytes, bytes]]) -> None:
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all"})
    for _, key, value in records:
        producer.produce(topic, key=key, value=value, partition=0)
    assert producer.flush(30) == 0


def test_malformed_records_in_the_store_are_skipped_and_reported(instances: Starter, unique: str) -> None:
    proc, url = instances("bad")
    topic = f"_schemas_test_{unique}"  # the instances fixture's store topic
    with httpx.Client(base_url=url, timeout=60) as http:
        first = http.post("/subjects/before/versions", json={"schema": SMALL}, headers=CT).json()["id"]
        skipped_before = http.get("/_health").json()["skipped_records"]
        write_raw(topic, MALFORMED)

        registered = http.post("/subjects/after/versions", json={"schema": big(3)}, headers=CT)
        assert registered.status_code == 200, registered.text
        assert registered.json()["id"] == first + 1  # no junk id moved the next one
        assert http.get(f"/schemas/ids/{first}").status_code == 200
        assert http.get("/mode").json() == {"mode": "READWRITE"}
        assert http.get("/subjects").json() == ["after", "before"]
        health = http.get("/_health").json()
        assert health["skipped_records"] - skipped_before == len(MALFORMED), health
    logged = [json.loads(line) for line in proc.log_file.read_text().splitlines()
              if '"record_skipped"' in line]
    assert len({entry["offset"] for entry in logged}) >= len(MALFORMED)

    proc.stop()
    proc.start(60)  # the port opens only after the store was read to its end
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/subjects").json() == ["after", "before"]
        assert http.post("/subjects/after", json={"schema": big(3)}, headers=CT).json()["id"] == first + 1
        assert http.get("/_health").json()["skipped_records"] == skipped_before + len(MALFORMED)
