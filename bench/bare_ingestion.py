"""The ingestion benchmark's baseline: the same HTTP server with no admission, Redis or Kafka.

    python -m bench.bare_ingestion --host 127.0.0.1 --port 8001

uvicorn as ``choreo serve`` runs it (``producers.http_server``), FastAPI with the same body
limit, and a ``POST /deliveries`` that validates the body as the real endpoint does
(``producers.model.parse_request``) and answers 202 with a fresh delivery id. What the real
endpoint costs beyond this is the work of accepting: admission, the state table, the Avro
event and the broker's confirmation.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from choreo.memory import settle_garbage_collector
from producers.http_server import run_http
from producers.ingestion import BodyLimit, error
from producers.model import InvalidRequest, parse_request
from producers.settings import IngestionSettings
from producers.submit import new_delivery_id


def create_bare_app(max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="bare ingestion (benchmark baseline)", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.post("/deliveries", status_code=202)
    async def submit(request: Request) -> Response:
        try:
            parse_request(await request.body())
        except InvalidRequest as exc:
            return error(422, "invalid_request", f"{len(exc.errors)} invalid field(s)")
        delivery_id = new_delivery_id()
        return JSONResponse({"delivery_id": delivery_id, "status": "accepted"}, status_code=202,
                            headers={"Location": f"/deliveries/{delivery_id}"})

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_ingestion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    settle_garbage_collector()  # as ``choreo serve`` does once started: like for like
    run_http(create_bare_app(IngestionSettings().max_body_bytes), args.host, args.port)


if __name__ == "__main__":
    main()
