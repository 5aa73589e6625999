"""The generation check's room: which submissions are drawn, their queue, the checker thread and what
follows a verdict (``checker``), the re-run of a drawn submission's completions with the claimed
version's weights and the weights it keeps (``rerun``), what it judges at each position (``positions``)
and its turns with the update (``turns``). What a *task* checks of every submission stays in
``tasks/verify.py``, below this package: the layer contract (pyproject.toml) puts ``check`` above
``tasks`` and beside the trainer, and only the processes import it."""
