"""Every name under a run directory, in one place: what glassloop writes there, and so what
it may replace, prune, upload or refuse a link at. A module that reads or writes one of them
imports its name from here.

::

    RUN_DIR/
      .lock                  the lock held for a whole fit (glassloop.run_dir.lock)
      config.json            the config the run was started with (what a resume compares)
      run.json               status, times, versions, where the checkpoints are
      metrics.csv            one row per epoch (and per step, per mid-epoch validation)
      metrics.jsonl          the same rows as JSON lines, every key
      model.safetensors      the final weights (the EMA's when enabled)
      checkpoints/
        step-00000120/       a complete checkpoint (CHECKPOINT_FILES, or SHARDS/ under FSDP)
        latest               the newest complete checkpoint's name
      best/                  the checkpoint with the best monitored metric
      report/                index.html and the plots
      tensorboard/, tracking.json, wandb/, profile/   when enabled
      .lease.json, .generations/   a run on object storage: who writes it (run_dir.lease)
"""

from __future__ import annotations

import re

LOCK = ".lock"
CONFIG = "config.json"
STATUS = "run.json"
METRICS_CSV = "metrics.csv"
METRICS_JSONL = "metrics.jsonl"
WEIGHTS = "model.safetensors"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
REPORT = "report"
TENSORBOARD = "tensorboard"
TRACKING = "tracking.json"
WANDB = "wandb"
PROFILE = "profile"
# In a run on object storage only: the writing job's lease (glassloop.run_dir.lease), and each
# job's generation (its fencing token): GENERATIONS/00000007/RECORD names the checkpoints the
# run is made of, with that job's copies of the run's files beside it (run_dir.fsspec_store).
LEASE = ".lease.json"
GENERATIONS = ".generations"
RECORD = "record.json"
GENERATION_DIR = re.compile(r"^\d{8}$")

# What glassloop writes in a run directory (checkpoints/ and report/ are checked inside too).
OWN_NAMES = (
    LOCK,
    CONFIG,
    STATUS,
    METRICS_CSV,
    METRICS_JSONL,
    WEIGHTS,
    CHECKPOINTS,
    BEST,
    REPORT,
    TENSORBOARD,
    TRACKING,
    WANDB,
    PROFILE,
)
# The run's own files a remote run copies at each checkpoint and at the end (those that
# exist); run.json last: a bucket whose run.json says "finished" has the final weights.
RUN_FILES = (CONFIG, METRICS_CSV, METRICS_JSONL, WEIGHTS, STATUS)
RUN_FOLDERS = (REPORT,)

# Inside a checkpoint: its files (and its manifest, manifest.json, written last), and a sharded
# (FSDP) checkpoint's folder of tensors instead of model.safetensors.
MANIFEST = "manifest.json"
META = "meta.json"
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
CHECKPOINT_FILES = (WEIGHTS, STATE_TENSORS, STATE_JSON, META)
SHARDS = "shards"
STEP_DIR = re.compile(r"^step-(\d{8})$")
