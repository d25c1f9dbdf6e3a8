"""Two versions of one contract, for the deploy-gate test: v2 adds a required field."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import ClassVar

from choreo.events import Event
from choreo.service import Context, Service
from choreo.workflow import Workflow
from schemas.models import PackageFailed

TOPIC = os.environ.get("GATE_TOPIC", "t.gate")
_dir = Path(tempfile.mkdtemp(prefix="gate-"))
_v1 = json.loads(PackageFailed.schema_file.read_text())
_v2 = json.loads(PackageFailed.schema_file.read_text())
_v2["fields"].append({"name": "priority", "type": "int", "doc": "v2: required, no default."})
(_dir / "v1.avsc").write_text(json.dumps(_v1))
(_dir / "v2.avsc").write_text(json.dumps(_v2))


class GateV1(PackageFailed):
    schema_file: ClassVar[Path] = _dir / "v1.avsc"
    topic: ClassVar[str] = TOPIC


class GateV2(PackageFailed):
    schema_file: ClassVar[Path] = _dir / "v2.avsc"
    topic: ClassVar[str] = TOPIC
    priority: int = 0


def _service(model: type[Event], name: str) -> Service:
    service = Service(name)

    def handle(event: model, ctx: Context) -> None:  # type: ignore[valid-type]
        del event, ctx

    handle.__annotations__ = {"event": model, "ctx": Context, "return": None}
    service.on(TOPIC)(handle)
    return service


v1 = _service(GateV1, "gate-v1")
v2 = _service(GateV2, "gate-v2")
WORKFLOW_V1 = Workflow("gate-v1", ["tests.services.gate:v1"])
WORKFLOW_V2 = Workflow("gate-v2", ["tests.services.gate:v2"])
