-- A preloaded library on a server that pgmr does not manage: no locality, no socket.
CREATE EXTENSION pg_multiregion;
SHOW multiregion.locality;
SHOW multiregion.sidecar_socket;
SELECT multiregion.gateway_region();
\echo :SQLSTATE
SELECT * FROM multiregion.node_info();
\echo :SQLSTATE
SELECT * FROM multiregion.network_latency();
\echo :SQLSTATE
SELECT * FROM multiregion.cluster_regions();
\echo :SQLSTATE
SELECT * FROM multiregion.nodes;
\echo :SQLSTATE
SELECT * FROM multiregion.meta_group;
\echo :SQLSTATE
SELECT * FROM multiregion.cluster_settings;
\echo :SQLSTATE
SELECT * FROM multiregion.eventlog;
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', '5m');
\echo :SQLSTATE
DROP EXTENSION pg_multiregion;
