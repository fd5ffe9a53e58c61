//! What the SQL gateway's translations call, and the CockroachDB builtins that drivers and
//! ORMs call on connect (schema `crdb_internal`, as CockroachDB names it).

use pgrx::prelude::*;

extension_sql!(
    r#"
-- The gateway's form of a multi-region DDL statement: a procedure, so the statement returns
-- no rows over either protocol, only the command tag the gateway replaces with CockroachDB's.
CREATE PROCEDURE multiregion.exec(statement text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM multiregion.execute(statement);
END
$$;
COMMENT ON PROCEDURE multiregion.exec(text) IS
    'multiregion.execute for a statement without rows (the SQL gateway''s DDL form)';

-- Raises an error the gateway found in a statement (a CockroachDB form it refuses, a syntax
-- error), in the statement's place, so PostgreSQL aborts the transaction as for its own.
CREATE FUNCTION multiregion.raise_error(sqlstate text, message text, hint text DEFAULT NULL)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF hint IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = message;
    END IF;
    RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = message, HINT = hint;
END
$$;
GRANT EXECUTE ON PROCEDURE multiregion.exec(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION multiregion.raise_error(text, text, text) TO PUBLIC;

CREATE SCHEMA crdb_internal;
GRANT USAGE ON SCHEMA crdb_internal TO PUBLIC;

-- CockroachDB hashes the name into a telemetry counter and returns true; there is no
-- telemetry here, so only the answer remains.
CREATE FUNCTION crdb_internal.increment_feature_counter(feature text) RETURNS boolean
LANGUAGE sql VOLATILE AS $$ SELECT true $$;
COMMENT ON FUNCTION crdb_internal.increment_feature_counter(text) IS
    'Reports the use of a feature (CockroachDB telemetry); always true';

CREATE FUNCTION crdb_internal.is_admin() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user
$$;
COMMENT ON FUNCTION crdb_internal.is_admin() IS 'Retrieves the current user''s admin status.';

-- PL/pgSQL, so the bodies are resolved when called rather than when the script runs.
CREATE FUNCTION crdb_internal.node_id() RETURNS bigint
LANGUAGE plpgsql STABLE AS $$ BEGIN RETURN (SELECT node_id FROM multiregion.node_info()); END $$;
COMMENT ON FUNCTION crdb_internal.node_id() IS 'Returns the node ID.';

CREATE FUNCTION crdb_internal.cluster_id() RETURNS uuid
LANGUAGE plpgsql STABLE AS $$ BEGIN RETURN (SELECT cluster_id::uuid FROM multiregion.node_info()); END $$;
COMMENT ON FUNCTION crdb_internal.cluster_id() IS 'Returns the cluster ID.';

CREATE FUNCTION crdb_internal.locality_value(key text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT split_part(tier, '=', 2)
      FROM unnest(string_to_array(current_setting('multiregion.locality', true), ',')) AS t(tier)
     WHERE split_part(tier, '=', 1) = key
$$;
COMMENT ON FUNCTION crdb_internal.locality_value(text) IS
    'Returns the value of the specified locality key.';
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA crdb_internal TO PUBLIC;
"#,
    name = "gateway_support",
    requires = [multiregion]
);
