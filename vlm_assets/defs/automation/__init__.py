"""Automation: the inbox, configured-source, source-files and frame-cache sensors, the follow-upstream
declarative automation and the nightly integrity schedule (docs/operations.md, "Automation: sensors and schedules")."""
