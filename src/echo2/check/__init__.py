"""The generation check's room: the re-run of a drawn submission's completions with the claimed version's
weights (``rerun``), what it judges at each position (``positions``) and its turns with the update
(``turns``). The draw policy and the checker that queues drawn submissions and acts on the verdict are
the intake's (``runtime/intake.py``); what a *task* checks of every submission stays in
``tasks/verify.py``, which never imports this package (an import contract holds it)."""
