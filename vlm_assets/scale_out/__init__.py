"""Scaling out: `vlm-assets worker`, a Celery worker on any machine that shares storage.root and the Dagster
instance, with Redis as the broker named by $VLM_ASSETS_CELERY_BROKER (the runs it executes:
vlm_assets.orchestration.celery_runs; the steps: vlm_assets.defs.executor)."""
