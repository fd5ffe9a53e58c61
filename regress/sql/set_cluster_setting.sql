-- SET CLUSTER SETTING changes every node, so only superusers may: PUBLIC cannot execute the
-- function, and the function itself refuses a non-superuser who was granted EXECUTE. Both
-- checks, and the check of the name, come before any call to pgmr (none runs here).
-- This server names a pgmr that is not there, so schema changes (GRANT) cannot be replicated:
-- keep them local.
SET multiregion.replicate_ddl = off;
CREATE ROLE regress_mr_user;
GRANT USAGE ON SCHEMA multiregion TO regress_mr_user;
SET ROLE regress_mr_user;
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', '5m');
\echo :SQLSTATE
RESET ROLE;
GRANT EXECUTE ON FUNCTION multiregion.set_cluster_setting(text, text) TO regress_mr_user;
SET ROLE regress_mr_user;
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', '5m');
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', NULL);
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting(NULL, NULL);
\echo :SQLSTATE
RESET ROLE;
-- A superuser must name the setting; a NULL value resets it (and needs pgmr, absent here).
SELECT multiregion.set_cluster_setting(NULL, '5m');
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('', '5m');
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('', NULL);
\echo :SQLSTATE
SELECT multiregion.set_cluster_setting('server.time_until_store_dead', NULL);
\echo :SQLSTATE
-- The check can be caught by condition name.
SET ROLE regress_mr_user;
DO $$
BEGIN
    PERFORM multiregion.set_cluster_setting('server.time_until_store_dead', '5m');
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'refused: %', SQLERRM;
END
$$;
RESET ROLE;
REVOKE ALL ON FUNCTION multiregion.set_cluster_setting(text, text) FROM regress_mr_user;
REVOKE ALL ON SCHEMA multiregion FROM regress_mr_user;
DROP ROLE regress_mr_user;
