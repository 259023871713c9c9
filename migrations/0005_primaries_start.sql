-- 0005: a crash restart starts a new lease count too.
--
-- When one backend crashes (the OOM killer, a segfault, kill -9), the
-- postmaster stops every process and runs crash recovery, during which
-- the database refuses connections: an outage. Neither
-- pg_postmaster_start_time() nor the timeline changes, so 0004's row
-- for the server, already there, gave an owner that waited out the
-- recovery no lease to come back to, and a retry took its record over.
-- Crash recovery discards the statistics, and so resets the bgwriter's
-- stats_reset; with the postmaster's start it dates the server's start,
-- crash restarts included. A row noted before that start (started older,
-- or NULL: noted by a version without this column) counts as none: the
-- next acquire notes the server again, with first_seen now.
--
-- For a table other than idempotency_keys, replace that name throughout,
-- keeping the _primaries suffix, qualified with the table's schema if it
-- has one. The file is safe to apply to a database that has it already.

ALTER TABLE idempotency_keys_primaries ADD COLUMN IF NOT EXISTS started timestamptz;
