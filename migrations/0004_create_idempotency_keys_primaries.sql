-- 0004: when each server was first seen as the primary.
--
-- Time during which the database could not be reached must not count
-- against a lease: an owner that waits for the database to store its
-- answer would otherwise lose its record to the first retry after a
-- failover or a restart, and the request would execute twice. So a lease
-- ends no sooner than its length after the server became the primary it
-- is now: after pg_postmaster_start_time() for a restart, and for a
-- promotion, which no function reports, after the first_seen of the
-- server's row here. The first acquire on a server adds that row, one per
-- (system identifier, timeline): every promotion starts a new timeline.
-- Until the row exists, no lease ends.
--
-- For a table other than idempotency_keys, replace that name throughout,
-- keeping the _primaries suffix, qualified with the table's schema if it
-- has one. The file is safe to apply to a database that has it already.

CREATE TABLE IF NOT EXISTS idempotency_keys_primaries (
    system_identifier bigint      NOT NULL,
    timeline          integer     NOT NULL,
    first_seen        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (system_identifier, timeline)
);
