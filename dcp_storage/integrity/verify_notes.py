"""What every format's checksum checks share: the piece size they read in, and the note for no checksums.

A deep check reads each file sequentially in pieces of at most :data:`PIECE_BYTES`, so memory stays
bounded whatever the file size; a checkpoint whose writer recorded no checksums gets one note saying that
bit flips in its tensor data cannot be detected (naming the writer when the checkpoint says who it was).
"""

from __future__ import annotations

__all__ = ["PIECE_BYTES", "no_checksums_note"]

PIECE_BYTES = 16 * 1024 * 1024


def no_checksums_note(writer: str | None) -> str:
    who = f"its writer ({writer})" if writer else "its writer (not dcp-storage, e.g. torch's)"
    return f"no checksums recorded: {who} recorded none, so bit flips inside tensor data cannot be detected"
