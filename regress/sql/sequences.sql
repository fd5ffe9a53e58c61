-- Sequences: with row replication on, every permanent sequence is one counter for the
-- cluster, kept in the meta group. Calls of nextval, currval, setval and lastval — typed,
-- or in a column default or an identity column — go to the extension's functions in schema
-- multiregion, which behave as PostgreSQL's own (values, errors, privileges) while drawing
-- from that counter. Node 1 of the three-node cluster runs this file; the cluster tests
-- (coordinator/tests/data_plane.rs) draw through every node.
\set VERBOSITY default
CREATE DATABASE regress_sequences;
\c regress_sequences

CREATE SEQUENCE s;
SELECT nextval('s'), nextval('s'), currval('s'), lastval();
-- The call is pointed at the cluster-wide counter, in statements and in defaults.
EXPLAIN (VERBOSE, COSTS OFF) SELECT nextval('s');
CREATE TABLE t (id serial PRIMARY KEY, v text);
CREATE TABLE ti (id smallint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text);
EXPLAIN (VERBOSE, COSTS OFF) INSERT INTO t (v) VALUES ('a');
EXPLAIN (VERBOSE, COSTS OFF) INSERT INTO ti (v) VALUES ('a');
INSERT INTO t (v) VALUES ('a'), ('b') RETURNING id, v;
INSERT INTO ti (v) VALUES ('a'), ('b') RETURNING id, v;
SELECT currval('t_id_seq'), lastval();
-- Many rows in one statement take their values in growing blocks: all distinct, in order.
INSERT INTO t (v) SELECT 'bulk' FROM generate_series(1, 1000);
SELECT count(*), count(DISTINCT id), min(id), max(id) FROM t;
-- This node's copy of the sequence is moved past what it drew.
SELECT last_value >= 1002 AS copy_moved FROM t_id_seq;

-- setval, RESTART, renames and drops reach the counter.
SELECT setval('s', 100), nextval('s');
SELECT setval('s', 7, false), nextval('s'), currval('s');
ALTER SEQUENCE s RESTART WITH 40;
SELECT nextval('s');
BEGIN;
ALTER SEQUENCE s RENAME TO s_renamed;
SELECT nextval('s_renamed');
COMMIT;
SELECT nextval('s_renamed');
SELECT nspname, relname FROM multiregion.sequence_keys ORDER BY relname;
DROP SEQUENCE s_renamed;
CREATE SEQUENCE s_renamed;
SELECT nextval('s_renamed');
-- A rolled-back restart leaves the counter where it was.
BEGIN;
ALTER SEQUENCE s_renamed RESTART WITH 500;
ROLLBACK;
SELECT nextval('s_renamed');
-- COPY evaluates defaults without the planner: its rows' keys are drawn again from the
-- counter, so they continue where the INSERTs left off.
COPY t (v) FROM STDIN;
copy 1
copy 2
\.
INSERT INTO t (v) VALUES ('after copy') RETURNING id;
SELECT id, v FROM t WHERE id > 1002 ORDER BY id;
TRUNCATE t RESTART IDENTITY;
INSERT INTO t (v) VALUES ('after truncate') RETURNING id;
-- The transaction that restarts a sequence draws from the restarted one.
BEGIN;
TRUNCATE t RESTART IDENTITY;
INSERT INTO t (v) VALUES ('same transaction') RETURNING id;
COMMIT;
INSERT INTO t (v) VALUES ('next') RETURNING id;

-- CACHE, INCREMENT, bounds and CYCLE as PostgreSQL has them.
CREATE SEQUENCE down INCREMENT BY -5 MINVALUE -12 MAXVALUE -1 CACHE 3 CYCLE;
SELECT nextval('down'), nextval('down'), nextval('down'), nextval('down');
CREATE SEQUENCE lim MAXVALUE 2;
SELECT nextval('lim'), nextval('lim');
SELECT nextval('lim');
SELECT setval('lim', 3);

-- Errors are PostgreSQL's.
SELECT nextval('t');
SELECT currval('down_never');
CREATE SEQUENCE fresh;
SELECT currval('fresh');
CREATE ROLE regress_seq_user;
GRANT USAGE ON SCHEMA public TO regress_seq_user;
SET ROLE regress_seq_user;
SELECT nextval('fresh');
RESET ROLE;
GRANT USAGE ON SEQUENCE fresh TO regress_seq_user;
SET ROLE regress_seq_user;
SELECT nextval('fresh');
SELECT setval('fresh', 10);
RESET ROLE;
BEGIN READ ONLY;
SELECT nextval('fresh');
ROLLBACK;

-- Temporary sequences stay this session's own, drawn by PostgreSQL.
CREATE TEMP SEQUENCE tmp;
EXPLAIN (VERBOSE, COSTS OFF) SELECT nextval('tmp');
SELECT nextval('tmp'), nextval('tmp');

REVOKE ALL ON SEQUENCE fresh FROM regress_seq_user;
REVOKE ALL ON SCHEMA public FROM regress_seq_user;
DROP ROLE regress_seq_user;
