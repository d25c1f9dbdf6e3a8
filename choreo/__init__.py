"""The choreography runtime: services are business rules; Kafka, Avro and Redis plumbing lives here once."""
