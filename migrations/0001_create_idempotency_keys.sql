-- 0001: the table of idempotency records.
--
-- Caddy applies this file at start unless the store says `migrate off`.
-- To apply it by hand instead:
--
--     psql "$DATABASE_URL" --single-transaction -f 0001_create_idempotency_keys.sql
--
-- For a table other than idempotency_keys, replace that name throughout,
-- in the index's name too (qualify only the table names with a schema,
-- never the index's: it is created in its table's schema). The file is
-- safe to apply to a database that has it already.

CREATE TABLE IF NOT EXISTS idempotency_keys (
    -- HMAC-SHA-256 of the client's credential (see 0003): the raw credential is never stored.
    credential_hash  bytea       NOT NULL CHECK (octet_length(credential_hash) = 32),
    -- The client's Idempotency-Key.
    key              text        NOT NULL,
    -- SHA-256 of the request's method, path, query and body.
    fingerprint      bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    method           text        NOT NULL,
    path             text        NOT NULL,
    status           text        NOT NULL CHECK (status IN ('in_progress', 'completed')),
    -- The owner of an in_progress record and when it last proved alive;
    -- both NULL once completed.
    lock_token       bytea       CHECK (octet_length(lock_token) = 16),
    locked_at        timestamptz,
    created_at       timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    -- The recorded response, set when completed. response_body is NULL
    -- when the body was too large to keep (replayable = false);
    -- response_size is the size of the original body either way.
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    replayable       boolean,
    response_size    bigint,
    PRIMARY KEY (credential_hash, key),
    CHECK (status <> 'in_progress' OR (lock_token IS NOT NULL AND locked_at IS NOT NULL)),
    CHECK (status <> 'completed' OR (response_status IS NOT NULL AND replayable IS NOT NULL))
);

-- Pruning finds expired records through this index.
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
