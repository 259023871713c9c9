-- 0006: the rows of a batch, counted as one by the planner.
--
-- A batch of requests reaches Postgres as arrays, one per column, and its
-- statement turns them back into rows. unnest would do, but the planner
-- counts its rows from the arrays: a plan made for given arrays (each
-- execution's, in a pooled exec mode; the first five of a prepared
-- statement) then costs less than the plan kept for any arrays, which
-- counts ten, and a prepared statement is planned again at every
-- execution. And with ten rows, a lookup of each through the primary key
-- costs more on paper than one scan of a new, nearly empty table, a plan
-- that a connection would then keep while the table grows. These
-- functions give the same rows, but the planner knows only their ROWS 1:
-- every plan costs the same, so a prepared statement keeps the one made
-- for any arrays, and every plan looks the rows up through the primary
-- key, whatever the table's size when it was made. The store sets no
-- planner setting on its connections, which keeps them usable through
-- any pooler.
--
-- The names carry a version: a later change to one is a new function,
-- next to which the old one stays for the instances not yet upgraded.
--
-- For a table other than idempotency_keys, replace that name throughout,
-- keeping each function's suffix, qualified with the table's schema if
-- it has one. The file is safe to apply to a database that has it
-- already.

-- The acquire's rows (in_hash, in_key, in_fingerprint, in_method,
-- in_path, in_token, in_retention_us, in_lock_us, n).
CREATE OR REPLACE FUNCTION idempotency_keys_acquire_rows_v1(
    bytea[], text[], bytea[], text[], text[], bytea[], bigint[], bigint[])
RETURNS TABLE (in_hash bytea, in_key text, in_fingerprint bytea, in_method text, in_path text,
    in_token bytea, in_retention_us bigint, in_lock_us bigint, n bigint)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE ROWS 1 AS $$
BEGIN
    RETURN QUERY SELECT * FROM unnest($1, $2, $3, $4, $5, $6, $7, $8) WITH ORDINALITY;
END
$$;

-- The rows of a renewal or a release (in_hash, in_key, in_token, n).
CREATE OR REPLACE FUNCTION idempotency_keys_owned_rows_v1(bytea[], text[], bytea[])
RETURNS TABLE (in_hash bytea, in_key text, in_token bytea, n bigint)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE ROWS 1 AS $$
BEGIN
    RETURN QUERY SELECT * FROM unnest($1, $2, $3) WITH ORDINALITY;
END
$$;

-- The rows of a completion (in_hash, in_key, in_token, in_status,
-- in_headers, in_body, in_replayable, in_size, in_retention_us, n).
CREATE OR REPLACE FUNCTION idempotency_keys_complete_rows_v1(
    bytea[], text[], bytea[], integer[], bytea[], bytea[], boolean[], bigint[], bigint[])
RETURNS TABLE (in_hash bytea, in_key text, in_token bytea, in_status integer, in_headers bytea,
    in_body bytea, in_replayable boolean, in_size bigint, in_retention_us bigint, n bigint)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE ROWS 1 AS $$
BEGIN
    RETURN QUERY SELECT * FROM unnest($1, $2, $3, $4, $5, $6, $7, $8, $9) WITH ORDINALITY;
END
$$;
