-- Database regions, survival goals, placement and table localities on a three-region cluster
-- (us-east1, us-west1, europe-west1; this session's gateway is us-east1). Tables are created
-- through multiregion.execute, which replicates them to every node.
\set VERBOSITY default
SELECT * FROM multiregion.cluster_regions();

-- Not multi-region yet.
SELECT * FROM multiregion.survival_goal;
SELECT multiregion.execute('ALTER DATABASE regress_mr ADD REGION "us-west1"');
SELECT multiregion.execute('ALTER TABLE t SET LOCALITY GLOBAL');
SELECT multiregion.execute('CREATE TABLE early (id int PRIMARY KEY) LOCALITY GLOBAL');
SELECT multiregion.execute('ALTER DATABASE regress_mr SURVIVE REGION FAILURE');

-- Only the database owner changes regions.
CREATE ROLE regress_mr_alice;
SET ROLE regress_mr_alice;
SELECT multiregion.execute('ALTER DATABASE regress_mr PRIMARY REGION "us-east1"');
RESET ROLE;

-- Regions must exist in the cluster.
SELECT multiregion.execute('ALTER DATABASE regress_mr PRIMARY REGION "mars"');
SELECT multiregion.execute('ALTER DATABASE regress_mr PRIMARY REGION "us-east1"');
SELECT * FROM multiregion.regions;
SELECT multiregion.execute('ALTER DATABASE regress_mr SET PRIMARY REGION "us-west1"');
SELECT multiregion.add_region('us-west1');
SELECT multiregion.execute('ALTER DATABASE regress_mr ADD REGION "us-west1"');
SELECT multiregion.execute('ALTER DATABASE regress_mr ADD REGION IF NOT EXISTS "us-west1"');
SELECT * FROM multiregion.regions;

-- The region type holds exactly the database's regions.
SELECT 'us-west1'::crdb_internal_region;
SELECT 'mars'::crdb_internal_region;

-- Survival and placement.
SELECT multiregion.execute('ALTER DATABASE regress_mr SURVIVE REGION FAILURE');
SELECT multiregion.execute('ALTER DATABASE regress_mr PLACEMENT RESTRICTED');
SELECT * FROM multiregion.survival_goal;
SELECT multiregion.set_placement('default');
SELECT multiregion.set_placement('sometimes');
SELECT multiregion.execute('ALTER DATABASE regress_mr ADD REGION "europe-west1"');
SELECT multiregion.execute('ALTER DATABASE regress_mr SURVIVE REGION FAILURE');
SELECT * FROM multiregion.execute('SHOW SURVIVAL GOAL FROM DATABASE regress_mr');
SELECT multiregion.execute('ALTER DATABASE regress_mr DROP REGION "us-west1"');
SELECT multiregion.execute('ALTER DATABASE regress_mr PLACEMENT RESTRICTED');
SELECT multiregion.set_survival_goal('zone');

-- Dropping regions.
SELECT multiregion.execute('ALTER DATABASE regress_mr DROP REGION "us-east1"');
SELECT multiregion.execute('ALTER DATABASE regress_mr DROP REGION IF EXISTS "mars"');
SELECT multiregion.execute('ALTER DATABASE other PRIMARY REGION "us-east1"');

-- Table localities.
SELECT multiregion.execute('CREATE TABLE promo_codes (code text PRIMARY KEY, description text) LOCALITY GLOBAL');
SELECT multiregion.execute('CREATE TABLE west (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1"');
SELECT multiregion.execute('CREATE TABLE plain (id int PRIMARY KEY)');
SELECT multiregion.execute('ALTER TABLE plain SET LOCALITY REGIONAL BY TABLE IN "asia"');
SELECT * FROM multiregion.tables;
SELECT multiregion.execute('ALTER DATABASE regress_mr DROP REGION "us-west1"');
SELECT multiregion.set_locality('west', 'REGIONAL BY TABLE IN PRIMARY REGION');
SET ROLE regress_mr_alice;
SELECT multiregion.set_locality('west', 'GLOBAL');
RESET ROLE;
-- A schema change's fence (docs/ARCHITECTURE.md §8.6) locks with the caller's privileges:
-- a role that may not lock a table cannot lock it through multiregion.fence_range.
SET ROLE regress_mr_alice;
SELECT multiregion.fence_range('public', 'west', NULL);
RESET ROLE;
BEGIN;
SELECT multiregion.fence_range('public', 'west', NULL);
SELECT mode FROM pg_catalog.pg_locks
 WHERE relation = 'west'::regclass AND pid = pg_backend_pid() AND mode = 'ShareLock';
ROLLBACK;

-- REGIONAL BY ROW with the system-provided crdb_region.
SELECT multiregion.execute('CREATE TABLE accounts (id int PRIMARY KEY, email text UNIQUE, note text) LOCALITY REGIONAL BY ROW');
INSERT INTO accounts (id, email) VALUES (1, 'a@x'), (2, 'b@x');
INSERT INTO accounts (id, email, crdb_region) VALUES (3, 'c@x', 'europe-west1');
SELECT id, email, crdb_region FROM accounts ORDER BY id;
SELECT tableoid::regclass, id FROM accounts ORDER BY id;
-- Unique across regions, though the partitions' own keys start with the region.
INSERT INTO accounts (id, email, crdb_region) VALUES (1, 'd@x', 'us-west1');
INSERT INTO accounts (id, email, crdb_region) VALUES (4, 'a@x', 'us-west1');
-- Rehoming keeps the key.
UPDATE accounts SET crdb_region = 'us-west1' WHERE id = 2;
SELECT tableoid::regclass, id FROM accounts ORDER BY id;
INSERT INTO accounts (id, email) VALUES (2, 'e@x');
-- Foreign keys to the REGIONAL BY ROW table added afterwards, by its keys without the region
-- (PostgreSQL alone refuses them: the partitioned table's keys all lead with the region):
-- checked against the key tables that keep those keys unique across regions.
CREATE TABLE notes (id int PRIMARY KEY, account_id int REFERENCES accounts (id), email text);
ALTER TABLE notes ADD CONSTRAINT notes_email_fkey FOREIGN KEY (email) REFERENCES accounts (email);
CREATE TABLE notes2 (id int PRIMARY KEY, account_id int REFERENCES accounts);
INSERT INTO notes VALUES (1, 2, 'a@x');
INSERT INTO notes VALUES (2, 99, NULL);
INSERT INTO notes VALUES (3, NULL, 'zz@x');
INSERT INTO notes2 VALUES (1, 3);
SELECT conname, confrelid::regclass FROM pg_constraint
 WHERE conrelid IN ('notes'::regclass, 'notes2'::regclass) AND contype = 'f' ORDER BY 1;
SELECT * FROM multiregion.execute('SHOW CREATE TABLE notes');
DROP TABLE notes, notes2;
-- A region with rows cannot be dropped; nothing changes.
SELECT multiregion.execute('ALTER DATABASE regress_mr DROP REGION "europe-west1"');
SELECT region FROM multiregion.regions ORDER BY 1;
DELETE FROM accounts WHERE crdb_region = 'europe-west1';
SELECT multiregion.execute('ALTER DATABASE regress_mr DROP REGION "europe-west1"');
SELECT region FROM multiregion.regions ORDER BY 1;
SELECT count(*) FROM pg_inherits WHERE inhparent = 'accounts'::regclass;
SELECT multiregion.execute('ALTER DATABASE regress_mr ADD REGION "europe-west1"');
SELECT count(*) FROM pg_inherits WHERE inhparent = 'accounts'::regclass;
SELECT * FROM multiregion.execute('SHOW ZONE CONFIGURATION FROM TABLE accounts');
SELECT * FROM multiregion.execute('SHOW CREATE TABLE accounts');
SELECT * FROM multiregion.execute('SHOW INDEXES FROM accounts');
SELECT * FROM multiregion.execute('SHOW CREATE DATABASE regress_mr');
SELECT target FROM multiregion.zone_configurations;

-- Back to REGIONAL BY TABLE: the hidden column goes, keys and rows stay.
SELECT multiregion.execute('ALTER TABLE accounts SET LOCALITY REGIONAL BY TABLE');
\d accounts
SELECT * FROM accounts ORDER BY id;
SELECT count(*) FROM multiregion_keys.accounts;

-- REGIONAL BY ROW AS a column, which must be of the region type and NOT NULL.
SELECT multiregion.execute('CREATE TABLE t2 (id int PRIMARY KEY, r text)');
SELECT multiregion.execute('ALTER TABLE t2 SET LOCALITY REGIONAL BY ROW AS r');
SELECT multiregion.execute('ALTER TABLE t2 ADD COLUMN r2 crdb_internal_region');
SELECT multiregion.execute('ALTER TABLE t2 SET LOCALITY REGIONAL BY ROW AS r2');
SELECT multiregion.execute('ALTER TABLE t2 SET LOCALITY REGIONAL BY ROW AS nope');

-- Syntax errors carry a position.
SELECT multiregion.execute('ALTER DATABASE regress_mr ADD REGION');
SELECT * FROM multiregion.execute('SHOW REGIONS FROM DATABASE');
SELECT multiregion.schema_version() > 0 AS versioned;
DROP ROLE regress_mr_alice;
