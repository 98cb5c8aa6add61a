"""Scaling out: steps executed by Celery workers (`vlm-assets worker`) on any machine that shares storage.root
and the Dagster instance, with Redis as the broker named by $VLM_ASSETS_CELERY_BROKER."""
