-- preload.conf points multiregion.sidecar_socket at a path where no pgmr listens: every
-- function that needs pgmr fails at once with SQLSTATE 08001 and a hint, and never hangs.
SELECT * FROM multiregion.node_info();
\echo :SQLSTATE
SELECT * FROM multiregion.network_latency();
\echo :SQLSTATE
SELECT * FROM multiregion.cluster_regions();
\echo :SQLSTATE
-- The meta group's functions and the views over them fail the same way.
SELECT * FROM multiregion.nodes_info();
\echo :SQLSTATE
SELECT * FROM multiregion.nodes;
\echo :SQLSTATE
SELECT * FROM multiregion.meta_group_info();
\echo :SQLSTATE
SELECT * FROM multiregion.meta_group;
\echo :SQLSTATE
SELECT * FROM multiregion.cluster_settings_info();
\echo :SQLSTATE
SELECT * FROM multiregion.cluster_settings;
\echo :SQLSTATE
SELECT * FROM multiregion.eventlog_info();
\echo :SQLSTATE
SELECT * FROM multiregion.eventlog;
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', '5m');
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', NULL);
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
-- Nor do the meta group's calls wait for their own, longer timeout.
DO $$
DECLARE
    started timestamptz := clock_timestamp();
BEGIN
    PERFORM * FROM multiregion.nodes;
EXCEPTION WHEN sqlclient_unable_to_establish_sqlconnection THEN
    RAISE NOTICE 'failed within 5 s: %', clock_timestamp() - started < interval '5 s';
END
$$;
RESET multiregion.sidecar_timeout;
