"""Task adapters (SPEC §1): ``base`` (the protocol and shared helpers), one module per task that
imports only ``base``, and ``registry`` (``build_task``), which imports the adapters and maps a task
config to one. The imports run one way, ``base`` <- adapters <- ``registry`` <- callers: no circle.
"""
