-- A statement that runs at another node's leaseholder runs there as the role that runs it
-- here: a SECURITY DEFINER function's as the function's owner, the caller's own as the
-- caller, even in one transaction (the remote transaction began as one of them).
\set VERBOSITY default
CREATE DATABASE regress_roles;
\c regress_roles
SELECT multiregion.execute($$ALTER DATABASE regress_roles PRIMARY REGION "us-east1"$$);
SELECT multiregion.execute($$ALTER DATABASE regress_roles ADD REGION "us-west1"$$);
CREATE ROLE mr_caller;
-- Leased by the us-west1 node: writes through this node are forwarded there.
CREATE TABLE west_owned (k int PRIMARY KEY);
CREATE TABLE west_mine (k int PRIMARY KEY);
CREATE TABLE west_rls (k int PRIMARY KEY);
SELECT multiregion.execute($$ALTER TABLE west_owned SET LOCALITY REGIONAL BY TABLE IN "us-west1"$$);
SELECT multiregion.execute($$ALTER TABLE west_mine SET LOCALITY REGIONAL BY TABLE IN "us-west1"$$);
SELECT multiregion.execute($$ALTER TABLE west_rls SET LOCALITY REGIONAL BY TABLE IN "us-west1"$$);
ALTER TABLE west_mine OWNER TO mr_caller;
-- mr_caller may delete only the negative rows of west_rls; its owner (postgres) all of them.
ALTER TABLE west_rls ENABLE ROW LEVEL SECURITY;
CREATE POLICY negative ON west_rls TO mr_caller USING (k < 0);
GRANT SELECT, DELETE ON west_rls TO mr_caller;
INSERT INTO west_rls VALUES (-1), (1), (2);
CREATE FUNCTION add_owned(int) RETURNS void SECURITY DEFINER LANGUAGE sql
    AS 'INSERT INTO public.west_owned VALUES ($1)';
-- Each table's lease moves to the us-west1 node after its locality changed, within seconds:
-- a transaction begun before its move fails with "the lease ... moved" (retryable).
DO $$
BEGIN
  FOR i IN 1..300 LOOP
    EXIT WHEN (SELECT count(*) = 3 AND bool_and(lease_holder_region = 'us-west1')
                 FROM multiregion.ranges WHERE database_name = 'regress_roles'
                  AND table_name IN ('west_owned', 'west_mine', 'west_rls'));
    PERFORM pg_catalog.pg_sleep(0.1);
  END LOOP;
END $$;
SELECT table_name, lease_holder_region FROM multiregion.ranges
 WHERE database_name = 'regress_roles' AND table_name LIKE 'west%' ORDER BY 1;
SET ROLE mr_caller;
-- The caller's statement first (the remote transaction begins as mr_caller), then the
-- function's, which only its owner may run.
BEGIN;
INSERT INTO west_mine VALUES (1);
SELECT add_owned(1);
COMMIT;
-- The function's statement first (the remote transaction begins as postgres), then the
-- caller's, which row-level security limits to the caller's rows there too.
BEGIN;
SELECT add_owned(2);
DELETE FROM west_rls RETURNING k;
COMMIT;
-- Not the caller's to write, wherever it runs.
INSERT INTO west_owned VALUES (3);
RESET ROLE;
SELECT k FROM west_owned ORDER BY k;
SELECT k FROM west_rls ORDER BY k;
-- A SQL function's statement that names its parameters cannot travel as text (the names
-- mean nothing at the leaseholder; it failed there with "column k does not exist"): refused
-- with the way round. With $1 it is forwarded.
CREATE FUNCTION add_named(k int) RETURNS void LANGUAGE sql
    AS 'INSERT INTO public.west_owned VALUES (k)';
SELECT add_named(10);
SELECT add_owned(11);
SELECT k FROM west_owned ORDER BY k;
\c postgres
DROP DATABASE regress_roles WITH (FORCE);
DROP ROLE mr_caller;
