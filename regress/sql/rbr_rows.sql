-- Rows of REGIONAL BY ROW tables: the hidden crdb_region column, computed region columns,
-- auto-rehoming, and plain DDL replicated to every node. Its own database, on the cluster
-- the regions test uses (node 1: us-east1; node 2: us-west1 on port 17533).
\set VERBOSITY default
CREATE DATABASE regress_rbr;
\c regress_rbr
SELECT multiregion.execute('ALTER DATABASE regress_rbr PRIMARY REGION "us-east1"');
SELECT multiregion.execute('ALTER DATABASE regress_rbr ADD REGION "us-west1"');

-- The hidden column: not in a star, readable, writable and filterable by name.
CREATE TABLE accounts (id int PRIMARY KEY, owner text);
SELECT multiregion.set_locality('accounts', 'REGIONAL BY ROW');
INSERT INTO accounts VALUES (1, 'ann');
INSERT INTO accounts VALUES (2, 'bob') RETURNING *;
INSERT INTO accounts (id, owner, crdb_region) VALUES (3, 'cy', 'us-west1') RETURNING *, crdb_region;
SELECT * FROM accounts ORDER BY id;
TABLE accounts ORDER BY id;
SELECT a.* FROM accounts a ORDER BY id;
SELECT * FROM (SELECT * FROM accounts) s ORDER BY id;
WITH w AS (SELECT * FROM accounts) SELECT * FROM w ORDER BY id;
SELECT *, crdb_region FROM accounts ORDER BY id;
SELECT id, crdb_region FROM accounts WHERE crdb_region = 'us-west1';
SELECT DISTINCT * FROM accounts ORDER BY 1;
SELECT count(*) FROM accounts a JOIN accounts b USING (id);
-- A rehome by UPDATE moves the row to the other partition and keeps its key.
UPDATE accounts SET crdb_region = 'us-west1' WHERE id = 2 RETURNING *;
SELECT tableoid::regclass AS partition, id, crdb_region FROM accounts ORDER BY id;
DELETE FROM accounts WHERE id = 3 RETURNING *;
-- A duplicate in the row's own region, reported as CockroachDB reports it: the table's index,
-- the declared key (not the partition's index over the region-prefixed key).
INSERT INTO accounts VALUES (1, 'dup');
-- In another region too: the key is unique across partitions.
INSERT INTO accounts VALUES (1, 'dup', 'us-west1');
-- A view over the star does not see it either.
CREATE VIEW account_names AS SELECT * FROM accounts;
SELECT * FROM account_names ORDER BY id;
\d account_names

-- A computed region column (CockroachDB's AS (expr) STORED) is computed on every write.
CREATE TABLE users (id int PRIMARY KEY, city text NOT NULL, name text);
INSERT INTO users VALUES (1, 'boston', 'ann'), (2, 'seattle', 'bob');
SELECT multiregion.execute($$ALTER TABLE users ADD COLUMN region crdb_internal_region AS (
  CASE WHEN city = 'boston' THEN 'us-east1' WHEN city = 'seattle' THEN 'us-west1' END) STORED$$);
SELECT multiregion.execute('ALTER TABLE users ALTER COLUMN region SET NOT NULL');
SELECT multiregion.execute('ALTER TABLE users SET LOCALITY REGIONAL BY ROW AS "region"');
INSERT INTO users VALUES (3, 'seattle', 'cy');
INSERT INTO users (id, city) VALUES (4, 'boston'), (5, 'seattle') RETURNING *;
INSERT INTO users (id, city, name) SELECT 6, 'seattle', 'dee';
INSERT INTO users VALUES (7, 'boston', 'eve', DEFAULT) RETURNING *;
PREPARE ins(int, text) AS INSERT INTO users (id, city) VALUES ($1, $2) RETURNING region;
EXECUTE ins(8, 'seattle');
SELECT tableoid::regclass AS partition, * FROM users ORDER BY id;
-- Moving a user to another city moves the row to that city's region.
UPDATE users SET city = 'seattle' WHERE id = 7 RETURNING *;
UPDATE users SET name = 'EVE' WHERE id = 7 RETURNING *;
INSERT INTO users VALUES (8, 'seattle', 'fay') ON CONFLICT (region, id) DO UPDATE SET name = excluded.name RETURNING *;
-- Rows for a partition leased on another node (seattle's, on node 2) carry the statement's
-- ON CONFLICT clause there: the conflict is decided where the row is leased.
INSERT INTO users AS u VALUES (8, 'seattle', 'FAY'), (1, 'boston', 'ANN'), (20, 'seattle', 'hal')
  ON CONFLICT (region, id) DO UPDATE SET name = excluded.name || ' (was ' || u.name || ')'
  RETURNING id, city, name;
INSERT INTO users VALUES (8, 'seattle', 'not me'), (21, 'boston', 'ivy'), (22, 'seattle', 'jo')
  ON CONFLICT DO NOTHING RETURNING id, name;
INSERT INTO users (id, city, name) SELECT 20 + g, CASE WHEN g % 2 = 0 THEN 'seattle' ELSE 'boston' END, 'kim'
  FROM generate_series(0, 3) g
  ON CONFLICT (region, id) DO UPDATE SET name = users.name || '+' WHERE users.city = 'seattle';
SELECT id, city, name FROM users WHERE id IN (1, 8, 20, 21, 22, 23) ORDER BY id;
-- A clause with parameters cannot go with the rows (their INSERT has parameters of its own).
PREPARE ups(text) AS INSERT INTO users VALUES (8, 'seattle', 'x'), (1, 'boston', 'y')
  ON CONFLICT (region, id) DO UPDATE SET name = $1;
EXECUTE ups('z');
\echo :SQLSTATE
DEALLOCATE ups;
DELETE FROM users WHERE id >= 20;
-- By the declared key (CockroachDB's ON CONFLICT (id), and its UPSERT): the row is found in
-- whichever region holds it — here seattle's, leased on node 2, through node 1 — and updated
-- there. Values whose computed region is another one: DO NOTHING leaves the row alone, a DO
-- UPDATE that assigns the city moves the row first (at seattle's leaseholder, node 2, into
-- boston's partition, leased here) and then updates it, one that does not is refused.
INSERT INTO users AS u VALUES (8, 'seattle', 'fay!'), (31, 'boston', 'new')
  ON CONFLICT (id) DO UPDATE SET name = excluded.name || ' (was ' || u.name || ')' RETURNING *;
INSERT INTO users VALUES (8, 'seattle', 'x'), (30, 'seattle', 'new') ON CONFLICT (id) DO NOTHING
  RETURNING *;
INSERT INTO users AS u VALUES (8, 'boston', 'fay?') ON CONFLICT (id) DO UPDATE
  SET name = excluded.name RETURNING *;
\echo :SQLSTATE
INSERT INTO users VALUES (8, 'boston', 'no') ON CONFLICT (id) DO NOTHING RETURNING *;
SELECT tableoid::regclass AS partition, * FROM users WHERE id IN (8, 30, 31) ORDER BY id;
INSERT INTO users AS u VALUES (8, 'boston', 'fay'), (30, 'boston', 'new, moved')
  ON CONFLICT (id) DO UPDATE SET city = excluded.city, name = excluded.name || ' (was ' || u.name || ')'
  RETURNING *;
SELECT tableoid::regclass AS partition, * FROM users WHERE id IN (8, 30, 31) ORDER BY id;
-- Moved back in a transaction that rolls back: nothing moved.
BEGIN;
INSERT INTO users VALUES (8, 'seattle', 'fay') ON CONFLICT (id) DO UPDATE SET city = excluded.city;
SELECT tableoid::regclass AS partition, id, city FROM users WHERE id = 8;
ROLLBACK;
SELECT tableoid::regclass AS partition, id, city FROM users WHERE id = 8;
INSERT INTO users VALUES (8, 'seattle', 'fay') ON CONFLICT (id) DO UPDATE
  SET city = excluded.city, name = excluded.name;
DELETE FROM users WHERE id IN (30, 31);
UPDATE users SET name = lower(substr(name, 1, 3)) WHERE id IN (1, 8);
-- The column itself cannot be written, as in CockroachDB.
INSERT INTO users VALUES (9, 'boston', 'gus', 'us-west1');
\echo :SQLSTATE
UPDATE users SET region = 'us-west1' WHERE id = 1;
\echo :SQLSTATE
-- A city without a region has none: the row is refused.
INSERT INTO users VALUES (9, 'paris', 'gus');
\echo :SQLSTATE
SELECT count(*) FROM users;

-- Statements that fix every column a computed region is made of read one partition: the
-- region filter is derived before planning (as CockroachDB derives it), so they are routed to
-- one leaseholder.
EXPLAIN (COSTS OFF) SELECT * FROM users WHERE city = 'seattle' AND id = 3;
EXPLAIN (COSTS OFF) UPDATE users SET name = 'x' WHERE id = 3 AND 'seattle' = city;
EXPLAIN (COSTS OFF) DELETE FROM users WHERE city = 'boston' AND id = 99;
SELECT id, name FROM users WHERE city = 'seattle' AND id IN (3, 5) ORDER BY id;
-- A city no region has: no partition at all.
EXPLAIN (COSTS OFF) SELECT * FROM users WHERE city = 'paris';
-- Parameters of a custom plan count; a filter that does not fix the city does not.
PREPARE by_city(text) AS SELECT id FROM users WHERE city = $1 ORDER BY id;
EXPLAIN (COSTS OFF) EXECUTE by_city('boston');
EXECUTE by_city('boston');
EXPLAIN (COSTS OFF) SELECT * FROM users WHERE city = 'seattle' OR id = 1;
EXPLAIN (COSTS OFF) SELECT * FROM users WHERE city LIKE 'sea%';
-- Joins and subqueries get it per table; a view keeps its own text.
EXPLAIN (COSTS OFF) SELECT u.id FROM users u JOIN accounts a ON a.id = u.id WHERE u.city = 'boston';
CREATE VIEW boston_users AS SELECT id, name FROM users WHERE city = 'boston';
SELECT pg_get_viewdef('boston_users');
EXPLAIN (COSTS OFF) SELECT * FROM boston_users;
DROP VIEW boston_users;

-- Auto-rehoming: tables created while multiregion.enable_auto_rehoming is on move a row to
-- the gateway's region whenever it is updated, unless the UPDATE sets the region itself.
SET multiregion.enable_auto_rehoming = on;
SELECT multiregion.execute('CREATE TABLE sessions (id int PRIMARY KEY, hits int) LOCALITY REGIONAL BY ROW');
RESET multiregion.enable_auto_rehoming;
INSERT INTO sessions VALUES (1, 0, 'us-west1'), (2, 0, 'us-west1');
UPDATE sessions SET hits = hits + 1 WHERE id = 1;
UPDATE sessions SET hits = hits + 1, crdb_region = 'us-west1' WHERE id = 2;
SELECT id, hits, crdb_region FROM sessions ORDER BY id;
-- accounts was created with the setting off: it stays put.
UPDATE accounts SET owner = 'BOB' WHERE id = 2;
SELECT id, crdb_region FROM accounts WHERE id = 2;

-- A UNIQUE index or constraint added later is unique across regions on its own columns: the
-- rows are checked first (at the leaseholders' copies), then a key table keeps the key; its
-- range starts on every node from the keys of each partition, read at its leaseholder.
SELECT multiregion.execute('CREATE TABLE members (id int PRIMARY KEY, email text, nick text) LOCALITY REGIONAL BY ROW');
INSERT INTO members VALUES (1, 'a@x', 'a', 'us-east1'), (2, 'b@x', 'b', 'us-west1'),
  (3, 'a@x', 'c', 'us-west1'), (4, NULL, NULL, 'us-east1'), (5, NULL, NULL, 'us-west1');
CREATE UNIQUE INDEX members_email ON members (email);
UPDATE members SET email = 'c@x' WHERE id = 3;
CREATE UNIQUE INDEX members_email ON members (email);
ALTER TABLE members ADD UNIQUE (nick);
INSERT INTO members VALUES (6, 'a@x', 'z', 'us-west1');
INSERT INTO members VALUES (7, 'd@x', 'b', 'us-east1');
INSERT INTO members VALUES (8, NULL, NULL, 'us-west1'), (9, 'd@x', 'd', 'us-west1');
UPDATE members SET email = 'b@x' WHERE id = 9;
DELETE FROM members WHERE id = 1;
INSERT INTO members VALUES (10, 'a@x', 'a', 'us-west1');
INSERT INTO members (id, email, nick) VALUES (11, 'a@x', 'k') ON CONFLICT (email) DO UPDATE
  SET nick = excluded.nick RETURNING id, email, nick, crdb_region;
SELECT id, email, nick, crdb_region FROM members ORDER BY id;
SELECT indexname FROM pg_indexes WHERE tablename = 'members' ORDER BY 1;
SELECT constraint_name, key_table, columns FROM multiregion.global_key
 WHERE relid = 'members'::regclass ORDER BY 1;

-- Plain DDL typed here reached every node; the other node sees the same tables and regions.
CREATE INDEX users_name ON users (name);
CREATE INDEX CONCURRENTLY users_city ON users (city);
\echo :SQLSTATE
\c regress_rbr - - 17533
SELECT pg_catalog.current_setting('multiregion.locality');
SELECT schema_name, table_name, locality FROM multiregion.tables;
SELECT schemaname, indexname FROM pg_indexes WHERE tablename = 'users' ORDER BY 1, 2;
SELECT * FROM multiregion.regions;
SELECT count(*) FROM pg_views WHERE viewname = 'account_names';
-- The keys added later, on this node: the same as on node 1.
SELECT email FROM multiregion_keys.members_members_email ORDER BY 1;
SELECT nick FROM multiregion_keys.members_members_nick_key ORDER BY 1;
INSERT INTO members VALUES (12, 'c@x', 'x', 'us-west1');
-- Dropping the key drops its key table: the value may repeat again.
ALTER TABLE members DROP CONSTRAINT members_nick_key;
INSERT INTO members VALUES (13, 'e@x', 'k', 'us-east1');
SELECT constraint_name FROM multiregion.global_key WHERE relid = 'members'::regclass ORDER BY 1;
SELECT pg_catalog.to_regclass('multiregion_keys.members_members_nick_key') AS dropped;
-- A renamed key keeps its key table, under the new name; dropped, it takes the key table.
ALTER INDEX members_email RENAME TO members_mail;
INSERT INTO members VALUES (14, 'a@x', 'm', 'us-east1');
SELECT constraint_name FROM multiregion.global_key WHERE relid = 'members'::regclass ORDER BY 1;
DROP INDEX members_mail;
SELECT pg_catalog.to_regclass('multiregion_keys.members_members_email') AS dropped;
INSERT INTO members VALUES (14, 'a@x', 'm', 'us-east1');
-- A partition truncated by itself releases its rows' keys: the key is free in every region.
CREATE TABLE tickets (id int PRIMARY KEY, v text);
SELECT multiregion.set_locality('tickets', 'REGIONAL BY ROW');
INSERT INTO tickets (crdb_region, id, v) VALUES ('us-west1', 1, 'a'), ('us-east1', 2, 'b');
TRUNCATE tickets_us_west1;
INSERT INTO tickets (crdb_region, id, v) VALUES ('us-east1', 1, 'c');
INSERT INTO tickets (crdb_region, id, v) VALUES ('us-west1', 2, 'd');
\echo :SQLSTATE
SELECT crdb_region, * FROM tickets ORDER BY id;
SELECT id FROM multiregion_keys.tickets ORDER BY 1;
DROP TABLE tickets;

-- An UPDATE over both nodes' partitions that also reads another table (here through node 2)
-- runs on each leaseholder over its own partition, each reading the other table from its
-- node's copy after a read barrier there (it was refused at commit: "not the leaseholder").
CREATE TABLE flags (id int PRIMARY KEY);
DO $$
BEGIN
  FOR i IN 1..300 LOOP
    EXIT WHEN (SELECT count(*) = 1 FROM multiregion.ranges
                WHERE database_name = 'regress_rbr' AND table_name = 'flags'
                  AND lease_holder IS NOT NULL
                  AND 2 = ANY (voting_replicas || non_voting_replicas));
    PERFORM pg_catalog.pg_sleep(0.1);
  END LOOP;
END $$;
INSERT INTO flags VALUES (1), (2);
UPDATE accounts SET owner = owner || '!' WHERE id IN (SELECT id FROM flags);
UPDATE accounts a SET owner = a.owner || '?' FROM flags f WHERE f.id = a.id AND f.id > 1;
SELECT id, owner, crdb_region FROM accounts ORDER BY id;
-- In a transaction that changed `flags` at its leaseholder (node 1), this node's share would
-- read its copy without that change: refused (0A000), nothing run.
BEGIN;
INSERT INTO flags VALUES (3);
\set VERBOSITY sqlstate
UPDATE accounts SET owner = 'x' WHERE id IN (SELECT id FROM flags);
\set VERBOSITY default
ROLLBACK;
-- A read after a change to a row leased elsewhere sees it: the table is read through its
-- leaseholders, in this transaction's sessions there (it was refused).
BEGIN;
UPDATE accounts SET owner = 'ANN' WHERE id = 1;
SELECT string_agg(owner, ',' ORDER BY id) FROM accounts;
SELECT count(*) FROM accounts a JOIN flags f USING (id);
ROLLBACK;
SELECT string_agg(owner, ',' ORDER BY id) FROM accounts;
DROP TABLE flags;

-- SERIALIZABLE over both leaseholders, through node 2: a read of node 1's row, then a write
-- of node 2's, commits; each node's turn travels with the statement that goes there (it was
-- refused). A statement over both is read or written through each leaseholder (also
-- refused before), except a split write whose shares would read copies (0A000).
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT owner FROM accounts WHERE crdb_region = 'us-east1' AND id = 1;
UPDATE accounts SET owner = owner || '+' WHERE crdb_region = 'us-west1' AND id = 2;
COMMIT;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT count(*), string_agg(owner, ',' ORDER BY id) FROM accounts;
UPDATE accounts SET owner = upper(owner);
SELECT id, owner FROM accounts ORDER BY id;
\set VERBOSITY sqlstate
UPDATE accounts SET owner = 'x' WHERE id IN (SELECT id FROM accounts WHERE owner > 'A');
\set VERBOSITY default
ROLLBACK;
SELECT id, owner, crdb_region FROM accounts ORDER BY id;
