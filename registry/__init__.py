"""A schema registry speaking the Confluent Schema Registry REST API, stored in a Kafka topic.

No Confluent artifact can be installed here, so the project ships this small registry (the
design Karapace uses: the registry is stateless, its only store is the compacted ``_schemas``
topic). confluent-kafka's ``SchemaRegistryClient``, ``AvroSerializer`` and
``AvroDeserializer`` work against it unchanged; in production ``SCHEMA_REGISTRY_URL`` points
at Confluent, Karapace, Apicurio or Redpanda instead.
"""
