-- DROP EXTENSION removes the functions, the views and the schema; the extension can be
-- created again.
DROP EXTENSION pg_multiregion;
SELECT count(*) FROM pg_namespace WHERE nspname = 'multiregion';
SELECT count(*) FROM pg_proc
WHERE proname IN ('gateway_region', 'node_info', 'network_latency', 'cluster_regions',
                  'nodes_info', 'meta_group_info', 'set_cluster_setting',
                  'cluster_settings_info', 'eventlog_info');
SELECT count(*) FROM pg_class
WHERE relname IN ('nodes', 'meta_group', 'cluster_settings', 'eventlog') AND relkind = 'v';
CREATE EXTENSION pg_multiregion;
SELECT multiregion.gateway_region();
DROP EXTENSION pg_multiregion;
SELECT count(*) FROM pg_namespace WHERE nspname = 'multiregion';
