"""The trajectory store's SQLite schema and the migrations of the stores earlier versions wrote
(``data/store.py`` documents each table and column)."""

from __future__ import annotations

import sqlite3

# 6: leases of a run epoch; 5: groups held for a check; 4: late answers; 3: seed and version; 2: without;
# 1: positional
SCHEMA_VERSION = 6
READABLE_VERSIONS = (0, 2, 3, 4, 5, SCHEMA_VERSION)  # 0: a new file

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    worker_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('open', 'expired', 'submitted')),
    issued_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    submitted_at REAL,
    n_prompts INTEGER NOT NULL,
    prompts TEXT NOT NULL,
    seed INTEGER NOT NULL DEFAULT 0,
    installed_version INTEGER NOT NULL DEFAULT -1,
    late INTEGER NOT NULL DEFAULT 0,
    epoch INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS leases_by_state ON leases (state, expires_at);
CREATE TABLE IF NOT EXISTS rollout_groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL UNIQUE,
    lease_id TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    n_traj INTEGER NOT NULL,
    consumed_step INTEGER,
    data TEXT NOT NULL,
    held INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS groups_buffered ON rollout_groups (seq) WHERE consumed_step IS NULL;
CREATE INDEX IF NOT EXISTS groups_consumed ON rollout_groups (consumed_step) WHERE consumed_step IS NOT NULL;
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring a store of ``version`` (one of ``READABLE_VERSIONS``) to ``SCHEMA_VERSION``, inside the
    caller's transaction: the columns later versions added, then every table and index."""
    if version == 2:  # leases gain their seed and the worker's version
        db.execute("ALTER TABLE leases ADD COLUMN seed INTEGER NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE leases ADD COLUMN installed_version INTEGER NOT NULL DEFAULT -1")
    if version in (2, 3):  # leases say whether their answer came after they expired
        db.execute("ALTER TABLE leases ADD COLUMN late INTEGER NOT NULL DEFAULT 0")
    leases = {row[1] for row in db.execute("PRAGMA table_info(leases)")}
    if version in (2, 3, 4, 5) and "epoch" not in leases:  # leases of an earlier process: epoch 0
        db.execute("ALTER TABLE leases ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0")
    groups = {row[1] for row in db.execute("PRAGMA table_info(rollout_groups)")}
    if version in (2, 3, 4) and "held" not in groups:  # groups may wait for their check
        db.execute("ALTER TABLE rollout_groups ADD COLUMN held INTEGER NOT NULL DEFAULT 0")
    for stmt in SCHEMA.split(";"):
        if stmt.strip():
            db.execute(stmt)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
