"""What a published version is, as the nodes that move it agree on: its signed manifest and lineage
(``manifest.py``), the full and patch codecs of the weights (``delta.py``, with the Rice codes of the
patch positions in ``rice.py``), the learner's chain and the choice of anchor or patch
(``publication.py``), the worker's chain of staged installs and the chain's HTTP body (``chain.py``),
and the typed frames of the TCP broadcast (``frames.py``). ``broadcast`` imports this package for the
manifest and the frames and only moves verified bytes; nothing here imports ``broadcast``, ``runtime``
or ``rollout``."""
