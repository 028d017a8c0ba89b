"""What every format's checksum checks share: the piece size they read in, and the note for no checksums.

A deep check reads each file sequentially in pieces of at most :data:`PIECE_BYTES`, so memory stays
bounded whatever the file size; a checkpoint whose writer recorded no checksums gets one note saying that
bit flips in its tensor data cannot be detected (naming the writer when the checkpoint says who it was).
"""

from __future__ import annotations

__all__ = ["PIECE_BYTES", "no_checksums_note"]

PIECE_BYTES = 16 * 1024 * 1024


def no_checksums_note(writer: str | None, zip_crcs: bool = False) -> str:
    """The note for a checkpoint without checksums of ours; ``zip_crcs``: its records carry zip CRC-32s."""
    who = f"its writer ({writer})" if writer else "its writer (not dcp-storage, e.g. torch's)"
    if zip_crcs:
        return (
            f"no checksums recorded: {who} recorded none; the zip CRC-32 of each record is checked by --deep and by "
            "loads that read a whole tensor or record, but a slice read alone (resharding) is not checked"
        )
    return (
        f"no checksums recorded: {who} recorded none, and the format carries none: bit flips inside tensor data "
        "cannot be detected (loads check the header only)"
    )
