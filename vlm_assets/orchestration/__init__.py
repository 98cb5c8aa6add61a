"""`vlm-assets run` and `vlm-assets worker` on top of the code location: the instance, which runs to
launch and when, where they execute (local worker processes or Celery workers), and the report.

Imports nothing itself: the CLI reads its arguments and its config before it imports Dagster.
"""
