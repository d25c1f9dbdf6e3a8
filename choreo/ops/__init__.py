"""Operator tooling for incidents: replay, state rebuild, trace, dead-letter redrive, status,
and the topology as data (check + generated docs).

Kafka is the record: every command here reads topics as a ``read_committed`` client that
never commits offsets, unless its whole purpose is to move a consumer group.
"""
