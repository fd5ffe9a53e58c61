-- preload.conf points multiregion.sidecar_socket at a path where no pgmr listens: every
-- function that needs pgmr fails at once with SQLSTATE 08001 and a hint, and never hangs.
SELECT * FROM multiregion.node_info();
\echo :SQLSTATE
SELECT * FROM multiregion.network_latency();
\echo :SQLSTATE
SELECT * FROM multiregion.cluster_regions();
\echo :SQLSTATE
-- A connection failure does not wait for the timeout, and can be caught by condition name.
SET multiregion.sidecar_timeout = '60s';
DO $$
DECLARE
    started timestamptz := clock_timestamp();
BEGIN
    PERFORM multiregion.node_info();
EXCEPTION WHEN sqlclient_unable_to_establish_sqlconnection THEN
    RAISE NOTICE 'failed within 5 s: %', clock_timestamp() - started < interval '5 s';
END
$$;
RESET multiregion.sidecar_timeout;
