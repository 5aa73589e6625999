"""What a published version is, as the nodes that move it agree on: for now the typed frames of the
TCP broadcast (``frames.py``: one strict, frozen pydantic model per control or data frame, the one
parser every received header goes through, and the one way back to the dict ``wire.write_frame``
sends). The manifest, its lineage and the full / patch codecs are to move here too; ``broadcast``
imports this package and only moves verified bytes."""
