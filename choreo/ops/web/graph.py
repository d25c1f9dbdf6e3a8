"""The flow as a picture: nodes placed in columns, drawn as SVG by the server.

The arrows are ``flowdoc.flow_edges`` (the services' declarations, what ``choreo ops
topology doc`` draws). The supervisor's requeues into the ``retry.*`` topics are folded
into one dotted arrow from the supervisor to the service that reads them. The layout is
computed once: columns by longest path from the entry points (arrows that close a cycle,
such as compensation, are drawn back below), rows ordered by their upstream neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from choreo.ops.flowdoc import FlowEdge
from choreo.topology import OPERATOR

COLUMN = 250  # px between columns
ROW = 74  # px between rows
NODE_W = 200
SERVICE_H, TOPIC_H = 56, 40
MARGIN = 24
NAME_CHARS = 28  # longer names keep their tail ("…livery.requested"); the full one is the tooltip


@dataclass
class Node:
    id: str
    kind: str  # service | topic
    name: str
    column: int = 0
    row: int = 0
    x: float = 0.0
    y: float = 0.0

    @property
    def width(self) -> int:
        return NODE_W

    @property
    def height(self) -> int:
        return SERVICE_H if self.kind == "service" else TOPIC_H

    @property
    def label(self) -> str:
        return self.name if len(self.name) <= NAME_CHARS else "…" + self.name[-(NAME_CHARS - 1):]


@dataclass
class Arrow:
    source: str
    target: str
    kind: str  # publish | consume | requeue
    service: str  # the publishing or consuming service
    topics: list[str] = field(default_factory=list)  # whose offsets measure it
    label: str = ""  # the consuming step, from the declarations
    path: str = ""
    mid: tuple[float, float] = (0.0, 0.0)
    back: bool = False


@dataclass
class Layout:
    nodes: dict[str, Node]
    arrows: list[Arrow]
    width: int
    height: int


def arrows_of(edges: list[FlowEdge]) -> list[Arrow]:
    """The drawn arrows: one per declared edge, the requeues folded per (supervisor, service)."""
    requeuers = {e.topic: e.service for e in edges if e.requeue}
    arrows: list[Arrow] = []
    folded: dict[tuple[str, str], Arrow] = {}
    for edge in edges:
        if edge.topic in requeuers:
            if edge.publishes:
                continue
            key = (requeuers[edge.topic], edge.service)
            if key not in folded:
                folded[key] = Arrow(f"s:{key[0]}", f"s:{key[1]}", "requeue", key[1], label="requeues")
                arrows.append(folded[key])
            folded[key].topics.append(edge.topic)
        elif edge.publishes:
            arrows.append(Arrow(f"s:{edge.service}", f"t:{edge.topic}", "publish", edge.service, [edge.topic]))
        else:
            arrows.append(Arrow(f"t:{edge.topic}", f"s:{edge.service}", "consume", edge.service, [edge.topic],
                                edge.label))
    return arrows


def layout(edges: list[FlowEdge]) -> Layout:
    arrows = arrows_of(edges)
    nodes: dict[str, Node] = {}
    for arrow in arrows:
        for end in (arrow.source, arrow.target):
            kind, _, name = end.partition(":")
            nodes.setdefault(end, Node(end, "service" if kind == "s" else "topic", name))
    _columns(nodes, arrows)
    _rows(nodes, arrows)
    rows = max((n.row for n in nodes.values()), default=0) + 1
    columns = max((n.column for n in nodes.values()), default=0) + 1
    per_column = {c: sum(1 for n in nodes.values() if n.column == c) for c in range(columns)}
    for node in nodes.values():
        offset = (rows - per_column[node.column]) * ROW / 2  # each column centred
        node.x = MARGIN + node.column * COLUMN
        node.y = MARGIN + offset + node.row * ROW + (SERVICE_H - node.height) / 2
    bottom = MARGIN + rows * ROW
    ports = _ports(nodes, arrows)
    for i, arrow in enumerate(arrows):
        _route(arrow, nodes[arrow.source], nodes[arrow.target], bottom, ports[(i, "out")], ports[(i, "in")])
    width = MARGIN * 2 + (columns - 1) * COLUMN + NODE_W
    height = bottom + (ROW if any(a.back for a in arrows) else 0) + MARGIN
    return Layout(nodes, arrows, width, height)


def _columns(nodes: dict[str, Node], arrows: list[Arrow]) -> None:
    """Each node's column is its distance from the entry points (the services nothing
    feeds, e.g. ingestion, but not the operators' tools), so the forward flow reads left to
    right and what loops back (requeues, compensation) is drawn back. A node the entry
    points do not reach (the recovery topic, the operators' decisions) sits just before the
    first node it feeds."""
    out: dict[str, list[str]] = {n: [] for n in nodes}
    fed = {a.target for a in arrows}
    for a in arrows:
        out[a.source].append(a.target)
    roots = sorted(n for n in nodes if n not in fed and nodes[n].kind == "service" and nodes[n].name != OPERATOR) \
        or sorted(n for n in nodes if n not in fed) or sorted(nodes)[:1]
    column = {root: 0 for root in roots}
    frontier = list(roots)
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(out[node]):
                if target not in column:
                    column[target] = column[node] + 1
                    following.append(target)
        frontier = following
    placed = True
    while placed:
        placed = False
        for name in sorted(nodes):
            ahead = [column[t] for t in out[name] if t in column]
            if name not in column and ahead:
                column[name] = max(0, min(ahead) - 1)
                placed = True
    for name, placed_node in nodes.items():
        placed_node.column = column.get(name, 0)


def _rows(nodes: dict[str, Node], arrows: list[Arrow]) -> None:
    """Order each column by the mean row of what feeds it (two sweeps), then by name."""
    columns: dict[int, list[Node]] = {}
    for node in sorted(nodes.values(), key=lambda n: (n.kind, n.name)):
        columns.setdefault(node.column, []).append(node)
    for members in columns.values():
        for i, node in enumerate(members):
            node.row = i
    feeders: dict[str, list[str]] = {}
    for a in arrows:
        if nodes[a.source].column < nodes[a.target].column:
            feeders.setdefault(a.target, []).append(a.source)
    for _ in range(2):
        for column in sorted(columns):
            members = columns[column]

            def weight(node: Node) -> float:
                rows = [nodes[f].row for f in feeders.get(node.id, [])]
                return sum(rows) / len(rows) if rows else node.row

            members.sort(key=lambda n: (weight(n), n.name))
            for i, node in enumerate(members):
                node.row = i


def _ports(nodes: dict[str, Node], arrows: list[Arrow]) -> dict[tuple[int, str], float]:
    """Where each arrow leaves its source and enters its target (keyed by (arrow index,
    "out" or "in")): spread over the node's side in the order of the other ends, so
    arrows meeting at one node do not share a point."""
    ports: dict[tuple[int, str], float] = {}
    for side, mine, other in (("out", "source", "target"), ("in", "target", "source")):
        by_node: dict[str, list[int]] = {}
        for i, arrow in enumerate(arrows):
            by_node.setdefault(getattr(arrow, mine), []).append(i)
        for node_id, indexes in by_node.items():
            node = nodes[node_id]
            indexes.sort(key=lambda i: nodes[getattr(arrows[i], other)].y)
            for rank, i in enumerate(indexes, 1):
                ports[(i, side)] = node.y + node.height * rank / (len(indexes) + 1)
    return ports


def _route(arrow: Arrow, source: Node, target: Node, bottom: float, y1: float, y2: float) -> None:
    """A cubic curve from the source's right side to the target's left side; an arrow that
    goes back (or stays in its column) loops below the picture."""
    x1, x2 = source.x + NODE_W, target.x
    if target.column > source.column:
        c1, c2 = (x1 + (x2 - x1) / 2, y1), (x2 - (x2 - x1) / 2, y2)
    else:
        arrow.back = True
        low = bottom + ROW / 2
        c1, c2 = (x1 + 140, low), (x2 - 140, low)
    arrow.path = f"M{x1:.0f},{y1:.0f} C{c1[0]:.0f},{c1[1]:.0f} {c2[0]:.0f},{c2[1]:.0f} {x2:.0f},{y2:.0f}"
    # the curve's point at t = 1/2, where its label goes
    arrow.mid = ((x1 + 3 * c1[0] + 3 * c2[0] + x2) / 8, (y1 + 3 * c1[1] + 3 * c2[1] + y2) / 8)
