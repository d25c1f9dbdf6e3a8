"""Entry points that start a delivery's story: the HTTP ingestion service, the Python
producer API (``producers.client``) and the ``emit``/``serve`` commands (``producers.cli``).

All three share one submit path (``producers.submit``): the same validation, the same
admission control, the same idempotency and the same publish confirmation.
"""
