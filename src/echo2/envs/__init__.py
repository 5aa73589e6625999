"""Multi-turn text environments of the data plane (SPEC §8) behind one protocol (``envs/base.py``)."""
