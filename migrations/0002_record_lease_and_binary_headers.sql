-- 0002: leases that belong to the record, headers kept byte for byte, and
-- completions that may be repeated.
--
-- Apply it by hand, after 0001, as that file says (replacing the table
-- name throughout if it is not idempotency_keys). It only adds columns:
-- no row is rewritten, and the table is locked only for an instant.

ALTER TABLE idempotency_keys
    -- When the lease of an in_progress record ends: set by its owner from
    -- its own lock_timeout, at creation, takeover and each renewal. NULL
    -- on rows written before this migration, whose lease a retry judges
    -- by locked_at and its own lock_timeout.
    ADD COLUMN IF NOT EXISTS locked_until timestamptz,
    -- The recorded headers, in a binary encoding that keeps any byte
    -- (jsonb refuses NUL and mangles bytes that are not UTF-8). Records
    -- completed before this migration have response_headers (JSON) instead.
    ADD COLUMN IF NOT EXISTS response_header_bytes bytea,
    -- The lock_token of the request that completed the record, so that a
    -- completion repeated after its reply was lost is known to have
    -- taken effect.
    ADD COLUMN IF NOT EXISTS completed_token bytea CHECK (octet_length(completed_token) = 16);
