"""The code location's executor: Celery workers when $VLM_ASSETS_CELERY_BROKER is set, else in-process."""

from __future__ import annotations

import os
import warnings

import dagster as dg

CELERY_BROKER_ENV = "VLM_ASSETS_CELERY_BROKER"


def broker_url() -> str | None:
    return os.environ.get(CELERY_BROKER_ENV) or None


def code_location_executor() -> dg.ExecutorDefinition:
    """Celery when $VLM_ASSETS_CELERY_BROKER is set, so runs the daemon launches use the workers too.

    dagster-celery's executor then sends each step of those runs as a task, and the worker
    (`vlm-assets worker`) rebuilds the job from the code location.
    """
    if not broker_url():
        return dg.in_process_executor
    from celery.exceptions import DuplicateTaskNameWarning
    from dagster_celery import celery_executor

    # dagster-celery registers its step task again for every step it sends; the task is the same.
    warnings.filterwarnings("ignore", "Task name 'execute_plan' is already registered", DuplicateTaskNameWarning)
    # Environment references, resolved in each run's process: a URL with a password is never stored in a run.
    broker = {"env": CELERY_BROKER_ENV}
    return celery_executor.configured({"broker": broker, "backend": broker}, name="celery")
