"""Observability: the run directory, the metrics catalog, sinks and trackers, the terminal view, the live
dashboard and Prometheus endpoint, the run report. The learner process (``runtime/``) feeds it; nothing
here imports the process back."""
