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
DROP EXTENSION pg_multiregion;
