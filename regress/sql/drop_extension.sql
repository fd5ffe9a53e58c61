-- DROP EXTENSION removes the functions and the schema; the extension can be created again.
DROP EXTENSION pg_multiregion;
SELECT count(*) FROM pg_namespace WHERE nspname = 'multiregion';
SELECT count(*) FROM pg_proc
WHERE proname IN ('gateway_region', 'node_info', 'network_latency', 'cluster_regions');
CREATE EXTENSION pg_multiregion;
SELECT multiregion.gateway_region();
DROP EXTENSION pg_multiregion;
SELECT count(*) FROM pg_namespace WHERE nspname = 'multiregion';
