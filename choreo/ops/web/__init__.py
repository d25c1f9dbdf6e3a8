"""The operators' live view (``choreo ops web``): the flow drawn from the services'
declarations with its rates and lag, deliveries in flight, stuck, failed and compensating,
dead letters with a redrive, and one delivery's timeline; FastAPI, Jinja and htmx, every
asset served from this package."""
