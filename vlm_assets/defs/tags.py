"""Every run tag and asset tag the code sets or reads, one spelling each (values are built where used)."""

# Run tags.
# Who launched the run: "cli" (`vlm-assets run`), a sensor's or a schedule's name.
LAUNCHED_BY_TAG = "vlm_assets/launched_by"
LAUNCHED_BY_CLI = "cli"
# The asset a `vlm-assets run` run materialises (one per run).
ASSET_TAG = "vlm_assets/asset"
# "true" on the runs of `vlm-assets run --force`: sample_length_chunk measures its rows again instead
# of reusing what an earlier build measured.
FORCE_TAG = "vlm_assets/force"
# The liveness file (vlm_assets.locks.process_token) of the process executing the run, so a run
# whose process died can be told from one that is still working.
ALIVE_TAG = "vlm_assets/alive_token"
# What the inbox sensor reads back from the runs it launched: whose they are, for which files, which try.
INBOX_ENTRY_TAG = "vlm_assets/inbox_entry"
INBOX_FINGERPRINT_TAG = "vlm_assets/inbox_fingerprint"
INBOX_ATTEMPT_TAG = "vlm_assets/inbox_attempt"
# Dagster's own: the partition a run of a partitioned job covers.
PARTITION_TAG = "dagster/partition"

# Dagster's own event tag for an observation's data version: what an observable asset's
# `DataVersion` becomes (vlm_assets.defs.catalog.source_files reports observations itself).
DATA_VERSION_TAG = "dagster/data_version"

# Asset tags.
# The asset's step splits its work into chunks over several processes (vlm_assets.parallel);
# `vlm-assets run` gives such steps the workers no other run takes.
CHUNKED_TAG = "vlm_assets/chunked"
