-- 0003: the default credential secret of the table.
--
-- Records are keyed by an HMAC-SHA-256 of the caller's credential under a
-- secret: an unkeyed hash of a Basic credential is a password that a
-- dictionary recovers. Unless the handlers are given credential_secret,
-- they use this table's one row, which the first of them to start fills
-- with 32 random bytes (INSERT ... ON CONFLICT DO NOTHING, so that every
-- instance sharing the table agrees on it). Guard it like the table's
-- data: with it, a dictionary works again on credential_hash.
--
-- For a table other than idempotency_keys, replace that name throughout,
-- keeping the _secret suffix, qualified with the table's schema if it has
-- one. The file is safe to apply to a database that has it already.

CREATE TABLE IF NOT EXISTS idempotency_keys_secret (
    -- Always true: the table holds at most one row.
    id      boolean PRIMARY KEY DEFAULT true CHECK (id),
    secret  bytea   NOT NULL CHECK (octet_length(secret) >= 32),
    created_at timestamptz NOT NULL DEFAULT now()
);
