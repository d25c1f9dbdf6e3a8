"""Avro contracts of the drone-delivery pipeline (``*.avsc``) and their pydantic mirrors."""
