"""`vlm-assets run` and `vlm-assets worker` on top of the code location: the instance, which runs to
launch and when, where they execute (local worker processes or Celery workers), and the report.

Imports nothing itself: the CLI starts its worker processes (orchestration.workers) before it
imports Dagster.
"""
