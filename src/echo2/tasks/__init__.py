"""The task package: what a task *does* in a run, behind one protocol (``base.Task``).

A task's data and reward live in its adapter (``echo2.data.tasks``: prompts, splits, grading,
token masks) and, for a multi-turn environment, in ``echo2.envs``. This package puts each kind of
task behind the same verbs: roll out a group (:meth:`Task.collect`), evaluate on held-out prompts
(:meth:`Task.evaluate`), verify a stranger's submission (:meth:`Task.verifier`, ``verify.py``), warm
up the embedded model (:meth:`Task.warm_start`, ``warm_cache.py``), and name the score it reports.
``registry.py`` is the one place a task name becomes a task. Nothing outside this package, the
adapters and the environments asks which kind of task it holds (``tests/unit/test_architecture.py``).
"""
