"""Lifecycle of the real local stack: Kafka (KRaft), Redis and the schema registry."""
