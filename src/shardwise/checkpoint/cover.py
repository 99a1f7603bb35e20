"""A tensor's pieces checked against its shape: each inside it, together every element exactly once.

Flat pieces alone are checked as ranges, sorted; any mix with boxes pairwise as boxes. Each failure
is one ``ManifestError`` line naming the tensor and the pieces. No communication happens here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.checkpoint.boxes import Box, first_overlap, intersect
from shardwise.checkpoint.errors import ManifestError

if TYPE_CHECKING:
    from shardwise.checkpoint.format import PieceRecord, TensorRecord


def check_box_piece(box: Box, rec: TensorRecord, version: int, where: str) -> None:
    if version < 3:
        raise ManifestError(f"{where}: box pieces need format_version 3, the manifest says {version}")
    if not box.inside(rec.global_shape):
        raise ManifestError(f"{where}: outside the tensor's global shape {list(rec.global_shape)}")
    if box.volume == 0 and rec.numel > 0:
        raise ManifestError(f"{where}: holds no element")


def check_flat_cover(name: str, rec: TensorRecord) -> None:
    """Flat pieces only: sorted, each must start where the previous one stopped (linear)."""
    cursor = 0
    for p in sorted(rec.pieces, key=lambda p: p.span):
        start, stop = p.span
        if start != cursor:
            what = (
                "overlaps the previous piece" if start < cursor else f"leaves [{cursor}, {start}) uncovered"
            )
            raise ManifestError(f"tensor {name!r} piece [{start}, {stop}) in {p.file}: {what}")
        cursor = stop
    if cursor != rec.numel:
        raise ManifestError(f"tensor {name!r}: elements [{cursor}, {rec.numel}) are in no piece")


def check_box_cover(name: str, rec: TensorRecord) -> None:
    """Any mix of boxes and flat ranges (as boxes): pairwise disjoint, and as many elements as the tensor."""
    boxes: list[Box] = []
    owner: list[PieceRecord] = []
    for p in rec.pieces:
        for box, _ in p.segments(rec.global_shape):
            boxes.append(box)
            owner.append(p)
    clash = first_overlap(boxes)
    if clash is not None:
        a, b = (owner[i] for i in clash)
        common = intersect(boxes[clash[0]], boxes[clash[1]])
        raise ManifestError(
            f"tensor {name!r}: piece {a.describe()} in {a.file} overlaps piece {b.describe()} in {b.file} "
            f"(both hold {common})"
        )
    covered = sum(p.numel for p in rec.pieces)
    if covered != rec.numel:
        raise ManifestError(
            f"tensor {name!r}: its pieces hold {covered} of its {rec.numel} elements; "
            f"{rec.numel - covered} are in no piece"
        )
