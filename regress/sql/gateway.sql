-- CockroachDB's multi-region statements, verbatim, through pgmr's SQL gateway: psql on node 1's
-- gateway port (region us-east1). psql prints each statement's command tag, which is
-- CockroachDB's; errors keep CockroachDB's texts and SQLSTATEs.
\set VERBOSITY default
\set QUIET off
SELECT gateway_region();
SHOW LOCALITY;
SHOW REGIONS FROM CLUSTER;
SELECT region FROM [SHOW REGIONS FROM CLUSTER] WHERE region LIKE 'us-%' ORDER BY 1;

-- A database with regions, in one statement, and its SHOW forms.
CREATE DATABASE gw PRIMARY REGION "us-east1" REGIONS "us-west1", "europe-west1";
CREATE DATABASE gw_bad PRIMARY REGION "mars";
-- CockroachDB's refusals, before anything is created.
CREATE DATABASE gw_bad SURVIVE REGION FAILURE;
CREATE DATABASE gw_bad REGIONS "us-west1";
CREATE DATABASE gw_bad PRIMARY REGION "us-east1" REGIONS "us-west1", "europe-west1", "us-west1";
SELECT count(*) AS leftovers FROM pg_database WHERE datname = 'gw_bad';
\c gw
SHOW REGIONS FROM DATABASE;
SHOW REGIONS FROM DATABASE gw;
SHOW REGIONS FROM DATABASE defaultdb;
SHOW SURVIVAL GOAL FROM DATABASE;
SELECT region, "primary" FROM [SHOW REGIONS FROM DATABASE] WHERE NOT "primary" ORDER BY region;
SELECT r.region FROM [SHOW REGIONS FROM DATABASE gw] r JOIN [SHOW REGIONS FROM CLUSTER] c
    ON c.region = r.region ORDER BY 1;
SELECT database_name, primary_region FROM [SHOW REGIONS FROM ALL DATABASES]
 WHERE database_name = 'gw';
SELECT count(*) > 0 AS has_regions FROM [SHOW REGIONS];
SHOW SURVIVAL GOAL FROM DATABASE defaultdb;
SHOW REGIONS FROM DATABASE nosuchdb;
\c defaultdb
SHOW REGIONS FROM DATABASE gw;
SHOW SURVIVAL GOAL FROM DATABASE gw;
\c gw
SELECT * FROM [SHOW DATABASES] WHERE database_name IN ('gw', 'defaultdb');
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
SHOW ENUMS;
DROP TYPE mood;
CREATE SEQUENCE gw_seq;
SHOW SEQUENCES;
DROP SEQUENCE gw_seq;
SET CLUSTER SETTING regress.gateway_setting = '5m0s';
SHOW CLUSTER SETTING regress.gateway_setting;
SELECT * FROM [SHOW ALL CLUSTER SETTINGS] WHERE variable LIKE 'regress.%';
RESET CLUSTER SETTING regress.gateway_setting;
SHOW CLUSTER SETTING regress.gateway_setting;
SET CLUSTER SETTING regress.gateway_setting;

-- Region and survival DDL: CockroachDB's command tags.
ALTER DATABASE gw DROP REGION "europe-west1";
ALTER DATABASE gw ADD REGION "europe-west1";
ALTER DATABASE gw ADD REGION IF NOT EXISTS "europe-west1";
ALTER DATABASE gw SURVIVE REGION FAILURE;
ALTER DATABASE gw SURVIVE ZONE FAILURE;
ALTER DATABASE gw SET PRIMARY REGION "us-east1";
ALTER DATABASE gw PRIMARY REGION "mars";
ALTER DATABASE gw ADD REGION;
-- The region type changes only through the region DDL; its owner may change.
DROP TYPE crdb_internal_region;
DROP DOMAIN IF EXISTS public.crdb_internal_region CASCADE;
ALTER TYPE crdb_internal_region RENAME TO regions;
ALTER DOMAIN crdb_internal_region DROP CONSTRAINT crdb_internal_region_valid;
ALTER DOMAIN crdb_internal_region SET SCHEMA pg_catalog;
ALTER TYPE crdb_internal_region OWNER TO CURRENT_USER;
SELECT multiregion.execute('CREATE DATABASE gw_native SURVIVE REGION FAILURE');

-- Tables created with their locality, atomically; CockroachDB's computed columns.
CREATE TABLE accounts (id INT PRIMARY KEY, owner TEXT) LOCALITY REGIONAL BY ROW;
CREATE TABLE settings (k TEXT PRIMARY KEY, v TEXT) LOCALITY GLOBAL;
CREATE TABLE stores (id INT PRIMARY KEY, city TEXT NOT NULL,
    region crdb_internal_region NOT NULL AS (
        CASE WHEN city = 'paris' THEN 'europe-west1' ELSE 'us-east1' END) STORED
) LOCALITY REGIONAL BY ROW AS region;
CREATE TABLE bad (id INT PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "mars";
SELECT to_regclass('bad') AS bad_exists;
CREATE TABLE plain (id INT PRIMARY KEY, twice INT AS (id * 2) STORED);
ALTER TABLE plain ADD COLUMN thrice INT AS (id * 3) STORED;
INSERT INTO plain (id) VALUES (7) RETURNING *;
ALTER TABLE plain SET LOCALITY REGIONAL BY TABLE IN "us-west1";
ALTER TABLE IF EXISTS missing SET LOCALITY GLOBAL;
ALTER TABLE missing SET LOCALITY GLOBAL;
CREATE VIEW plain_view AS SELECT id FROM plain;
ALTER TABLE plain_view SET LOCALITY GLOBAL;
DROP VIEW plain_view;
SHOW TABLES;
INSERT INTO accounts VALUES (1, 'ada');
SELECT crdb_region, * FROM accounts;
INSERT INTO stores (id, city) VALUES (1, 'paris'), (2, 'boston') RETURNING region;
-- SHOW CREATE, SHOW INDEXES, SHOW PARTITIONS: the LOCALITY clause, the hidden and the computed
-- region column, keys as declared (the region prefix PostgreSQL's partitioning needs is
-- implicit), views and sequences.
CREATE INDEX stores_city_idx ON stores (city DESC) INCLUDE (region);
SHOW CREATE TABLE accounts;
SHOW CREATE stores;
SHOW CREATE TABLE settings;
SHOW CREATE TABLE plain;
CREATE VIEW plain_view AS SELECT id FROM plain;
CREATE SEQUENCE plain_seq;
SELECT create_statement FROM [SHOW CREATE plain_view];
SELECT create_statement FROM [SHOW CREATE plain_seq];
DROP VIEW plain_view;
DROP SEQUENCE plain_seq;
SHOW CREATE TABLE nosuch;
SHOW CREATE DATABASE gw;
SHOW CREATE DATABASE defaultdb;
SHOW CREATE DATABASE nosuchdb;
SHOW INDEXES FROM stores;
SELECT index_name, column_name, implicit FROM [SHOW INDEX FROM accounts] ORDER BY 1, 2;
SHOW PARTITIONS FROM TABLE stores;
SELECT table_name, partition_name, index_name FROM [SHOW PARTITIONS FROM DATABASE gw]
 ORDER BY 1, 3, 2;
SELECT count(*) FROM [SHOW PARTITIONS FROM INDEX stores@stores_city_idx];
SHOW PARTITIONS FROM INDEX stores@nosuch_idx;
SHOW PARTITIONS FROM TABLE settings;
\c defaultdb
SELECT table_name, partition_name, index_name FROM [SHOW PARTITIONS FROM DATABASE gw]
 ORDER BY 1, 2;
SHOW CREATE DATABASE gw;
\c gw
-- CockroachDB's table elements: inline indexes, FAMILY, ordered keys, the reused "primary",
-- STRING and BYTES, NOT VISIBLE, VIRTUAL, UNIQUE WITHOUT INDEX.
CREATE TABLE crdb_style (
    id INT NOT NULL,
    name STRING NOT NULL,
    data BYTES,
    code STRING(4) NOT VISIBLE,
    doubled INT AS (id * 2) VIRTUAL,
    CONSTRAINT "primary" PRIMARY KEY (id ASC),
    INDEX crdb_style_by_name (name DESC) STORING (data),
    UNIQUE INDEX (name),
    UNIQUE WITHOUT INDEX (code),
    FAMILY "primary" (id, name, data)
);
CREATE TABLE crdb_style_too (id INT, CONSTRAINT "primary" PRIMARY KEY (id)) LOCALITY GLOBAL;
SHOW CREATE TABLE crdb_style;
SELECT index_name, column_name, direction, storing FROM [SHOW INDEXES FROM crdb_style]
 ORDER BY 1, seq_in_index;
INSERT INTO crdb_style (id, name) VALUES (1, 'a') RETURNING doubled;
INSERT INTO crdb_style (id, name) VALUES (2, 'a');
CREATE TABLE crdb_bad (a STRING, INDEX (a) USING HASH WITH (bucket_count = 1));
CREATE TABLE crdb_bad (a STRING, INDEX (a) USING btree);
SELECT to_regclass('crdb_bad') AS crdb_bad_exists;
-- CockroachDB's CREATE INDEX forms: STORING, INVERTED, CONCURRENTLY.
CREATE INDEX crdb_style_data ON crdb_style (id DESC) STORING (name);
CREATE INVERTED INDEX IF NOT EXISTS crdb_style_tags ON crdb_style (tags);
ALTER TABLE crdb_style ADD COLUMN tags JSONB;
CREATE INVERTED INDEX IF NOT EXISTS crdb_style_tags ON crdb_style (tags);
CREATE UNIQUE INDEX CONCURRENTLY crdb_style_code ON crdb_style (code) STORING (data);
SELECT indexname, indexdef FROM pg_indexes
 WHERE indexname IN ('crdb_style_data', 'crdb_style_tags', 'crdb_style_code') ORDER BY 1;
DROP TABLE crdb_style, crdb_style_too;
-- Hash-sharded keys: CockroachDB's shard column, named as CockroachDB names it.
CREATE TABLE events (id UUID PRIMARY KEY USING HASH, ts TIMESTAMPTZ NOT NULL, v STRING,
    INDEX events_ts (ts) USING HASH WITH (bucket_count = 8) STORING (v));
CREATE INDEX events_v ON events (v) USING HASH WITH BUCKET_COUNT = 4;
INSERT INTO events (id, ts, v)
  SELECT gen_random_uuid(), now() + g * interval '1 second', 'v' || g FROM generate_series(1, 200) g;
SELECT count(DISTINCT crdb_internal_ts_shard_8) AS ts_buckets,
       min(crdb_internal_ts_shard_8) >= 0 AND max(crdb_internal_ts_shard_8) < 8 AS in_range,
       count(DISTINCT crdb_internal_id_shard_16) AS id_buckets
  FROM events;
SHOW CREATE TABLE events;
SELECT index_name, column_name, storing FROM [SHOW INDEXES FROM events] ORDER BY 1, seq_in_index;
INSERT INTO events (id, ts) VALUES ('00000000-0000-0000-0000-00000000000a', now()),
  ('00000000-0000-0000-0000-00000000000a', now());
DROP TABLE events;
CREATE TABLE sharded_rows (id INT PRIMARY KEY USING HASH WITH (bucket_count = 4), v STRING)
  LOCALITY REGIONAL BY ROW;
INSERT INTO sharded_rows (id, v) VALUES (1, 'a'), (2, 'b');
SELECT id, v, crdb_region, crdb_internal_id_shard_4 BETWEEN 0 AND 3 AS sharded FROM sharded_rows ORDER BY id;
SHOW CREATE TABLE sharded_rows;
DROP TABLE sharded_rows;
-- ALTER PRIMARY KEY: the old key stays unique, foreign keys to it stay.
CREATE TABLE pk_users (id INT NOT NULL, email STRING NOT NULL, nick STRING,
    CONSTRAINT "primary" PRIMARY KEY (id));
CREATE TABLE pk_orders (id INT PRIMARY KEY, user_id INT REFERENCES pk_users (id));
INSERT INTO pk_users VALUES (1, 'a@x', NULL), (2, 'b@x', NULL);
INSERT INTO pk_orders VALUES (10, 1);
ALTER TABLE pk_users ALTER PRIMARY KEY USING COLUMNS (nick);
ALTER TABLE pk_users ALTER PRIMARY KEY USING COLUMNS (nope);
ALTER TABLE pk_users ALTER PRIMARY KEY USING COLUMNS (email);
SHOW CREATE TABLE pk_users;
INSERT INTO pk_users VALUES (1, 'c@x', NULL);
INSERT INTO pk_orders VALUES (11, 3);
ALTER TABLE pk_users ALTER PRIMARY KEY USING COLUMNS (email) USING HASH WITH (bucket_count = 4);
ALTER TABLE pk_users ALTER PRIMARY KEY USING COLUMNS (email) USING HASH WITH (bucket_count = 4);
SELECT create_statement FROM [SHOW CREATE TABLE pk_users];
SELECT indexname FROM pg_indexes WHERE tablename = 'pk_users' ORDER BY 1;
ALTER TABLE accounts ALTER PRIMARY KEY USING COLUMNS (id);
DROP TABLE pk_orders, pk_users;
-- A REGIONAL BY ROW table: the new key is unique across regions (the rows checked first), and
-- the old one stays so.
CREATE TABLE pk_members (id INT NOT NULL, email STRING NOT NULL, PRIMARY KEY (id)) LOCALITY REGIONAL BY ROW;
INSERT INTO pk_members (id, email, crdb_region) VALUES (1, 'a@x', 'us-east1'), (2, 'a@x', 'us-west1');
ALTER TABLE pk_members ALTER PRIMARY KEY USING COLUMNS (email);
UPDATE pk_members SET email = 'b@x' WHERE id = 2;
ALTER TABLE pk_members ALTER PRIMARY KEY USING COLUMNS (email);
SHOW CREATE TABLE pk_members;
INSERT INTO pk_members (id, email, crdb_region) VALUES (3, 'a@x', 'us-west1');
INSERT INTO pk_members (id, email, crdb_region) VALUES (1, 'c@x', 'us-west1');
SELECT constraint_name, columns FROM multiregion.global_key
 WHERE relid = 'pk_members'::regclass ORDER BY 1;
DROP TABLE pk_members;
-- unique_rowid(): cluster-unique, CockroachDB's layout (the node's ID in the low 15 bits).
CREATE TABLE rowids (id INT8 DEFAULT unique_rowid() PRIMARY KEY, v STRING);
INSERT INTO rowids (v) SELECT 'x' FROM generate_series(1, 1000);
SELECT count(DISTINCT id) AS distinct_ids, min(id) > (1::bigint << 55) AS time_ordered,
       bool_and(id & 32767 = crdb_internal.node_id()) AS node_bits
  FROM rowids;
DROP TABLE rowids;
-- CockroachDB's integers: INT is 8 bytes, SERIAL is INT8 DEFAULT unique_rowid().
CREATE TABLE serials (id SERIAL PRIMARY KEY, n INT, small INT4, big INTEGER);
ALTER TABLE serials ADD COLUMN later INT, ADD COLUMN other SERIAL;
INSERT INTO serials (n, later) VALUES (3000000000, 3000000000) RETURNING id > 2147483647 AS wide_id, n, later;
SHOW CREATE TABLE serials;
ALTER TABLE serials ALTER COLUMN small TYPE INT;
SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
 WHERE attrelid = 'serials'::regclass AND attnum > 0 ORDER BY attnum;
DROP TABLE serials;
CREATE DATABASE IF NOT EXISTS gw;
CREATE DATABASE IF NOT EXISTS gw_plain;
SELECT count(*) FROM pg_database WHERE datname = 'gw_plain';
DROP DATABASE gw_plain;

-- UPSERT: insert, or overwrite on a primary-key conflict.
UPSERT INTO settings VALUES ('a', '1'), ('b', '2');
UPSERT INTO settings (k, v) VALUES ('a', '3') RETURNING *;
UPSERT INTO settings (k) VALUES ('b');
SELECT * FROM settings ORDER BY k;
-- REGIONAL BY ROW: the key is found in whichever region holds the row, and the row is
-- overwritten there; a new city whose (computed) region is another moves it there first,
-- as in CockroachDB, keeping the columns the UPSERT does not name.
UPSERT INTO stores (id, city) VALUES (1, 'paris'), (3, 'paris');
ALTER TABLE stores ADD COLUMN note TEXT;
UPDATE stores SET note = 'kept' WHERE id = 1;
UPSERT INTO stores (id, city) VALUES (1, 'boston') RETURNING id, city, region;
SELECT tableoid::regclass AS partition, id, city, region, note FROM stores ORDER BY id;
UPSERT INTO stores (id, city) VALUES (1, 'rome'), (3, 'boston'), (5, 'lima');
SELECT tableoid::regclass AS partition, id, city, region, note FROM stores ORDER BY id;
DELETE FROM stores WHERE id = 5;
UPDATE stores SET city = 'paris', note = 'here' WHERE id IN (1, 3);
-- PostgreSQL's forms follow CockroachDB's: DO NOTHING leaves a row of another region alone;
-- a DO UPDATE that leaves the city alone cannot update it where it is (its computed region
-- ties the proposed row to another); one that assigns the city moves it.
INSERT INTO stores (id, city) VALUES (1, 'boston') ON CONFLICT (id) DO NOTHING RETURNING id;
INSERT INTO stores (id, city) VALUES (1, 'boston') ON CONFLICT (id) DO UPDATE SET note = 'x';
INSERT INTO stores AS s (id, city) VALUES (1, 'boston') ON CONFLICT (id)
  DO UPDATE SET city = excluded.city, note = s.note || ', moved' RETURNING id, region, note;
UPDATE stores SET city = 'paris' WHERE id = 1;
ALTER TABLE stores DROP COLUMN note;
SELECT id, city, region FROM stores ORDER BY id;
UPSERT INTO stores (id, city) VALUES (1, 'paris'), (4, 'lima') RETURNING id, city, region;
-- A duplicate in its own region names the table's key, as CockroachDB does.
INSERT INTO stores (id, city) VALUES (1, 'paris');
SELECT id, city, region FROM stores ORDER BY id;
DELETE FROM stores WHERE id = 4;
-- The hidden region: an UPSERT that does not name it updates the row where it lives.
INSERT INTO accounts (id, owner, crdb_region) VALUES (5, 'eve', 'us-west1');
UPSERT INTO accounts (id, owner) VALUES (5, 'EVE'), (6, 'fay');
UPSERT INTO accounts VALUES (5, 'Eve');
SELECT crdb_region, * FROM accounts WHERE id >= 5 ORDER BY id;
-- PostgreSQL's form by the declared key, through either door.
INSERT INTO accounts VALUES (5, 'not eve') ON CONFLICT (id) DO NOTHING;
INSERT INTO accounts AS a VALUES (5, 'eve') ON CONFLICT (id) DO UPDATE
  SET owner = excluded.owner || ' (was ' || a.owner || ')' RETURNING crdb_region, *;
-- Naming another region for a row that lives elsewhere moves it there (UPSERT writes every
-- column it names); PostgreSQL's DO NOTHING and a DO UPDATE that does not assign the region
-- leave it where it is, as CockroachDB does.
UPSERT INTO accounts (crdb_region, id, owner) VALUES ('us-east1', 5, 'moved');
SELECT tableoid::regclass AS partition, crdb_region, * FROM accounts WHERE id >= 5 ORDER BY id;
INSERT INTO accounts (crdb_region, id, owner) VALUES ('europe-west1', 5, 'x')
  ON CONFLICT (id) DO NOTHING;
INSERT INTO accounts (crdb_region, id, owner) VALUES ('europe-west1', 5, 'eve')
  ON CONFLICT (id) DO UPDATE SET owner = excluded.owner RETURNING crdb_region, *;
INSERT INTO accounts (crdb_region, id, owner) VALUES ('us-west1', 5, 'eve')
  ON CONFLICT (id) DO UPDATE SET crdb_region = excluded.crdb_region RETURNING crdb_region, *;
SELECT tableoid::regclass AS partition, crdb_region, * FROM accounts WHERE id >= 5 ORDER BY id;
DELETE FROM accounts WHERE id >= 5;
-- A UNIQUE index added later is unique across regions, and printed as declared.
CREATE UNIQUE INDEX ON accounts (owner);
INSERT INTO accounts (id, owner, crdb_region) VALUES (7, 'ada', 'us-west1');
SHOW CREATE TABLE accounts;
SELECT index_name, column_name, implicit FROM [SHOW INDEX FROM accounts] ORDER BY 1, 2;
DROP INDEX accounts_owner_key;
INSERT INTO accounts (id, owner, crdb_region) VALUES (7, 'ada', 'us-west1');
DELETE FROM accounts WHERE id = 7;
UPSERT INTO nosuch VALUES (1);
UPSERT INTO settings VALUES ('a', '1') ON CONFLICT DO NOTHING;

-- AS OF SYSTEM TIME is refused until historical reads exist, never ignored.
SELECT * FROM settings AS OF SYSTEM TIME '-10s';
BEGIN AS OF SYSTEM TIME '-10s';
BEGIN;
SET TRANSACTION AS OF SYSTEM TIME follower_read_timestamp();
SELECT 1;
ROLLBACK;

-- Several statements in one query string, ours and PostgreSQL's mixed.
SELECT 1 AS one \; SHOW SURVIVAL GOAL FROM DATABASE \; SELECT 2 AS two;
SELECT 1 AS one \; ALTER DATABASE gw PRIMARY REGION "mars" \; SELECT 2 AS never;
-- As sqlalchemy-cockroachdb sends them: inside BEGIN and SAVEPOINT cockroach_restart.
BEGIN;
SAVEPOINT cockroach_restart;
SELECT region FROM [SHOW REGIONS FROM DATABASE] ORDER BY 1;
ALTER TABLE settings SET LOCALITY REGIONAL BY TABLE IN PRIMARY REGION;
RELEASE SAVEPOINT cockroach_restart;
COMMIT;
SELECT table_name, locality FROM [SHOW TABLES] WHERE table_name = 'settings';

-- USE switches the session's database.
USE defaultdb;
SELECT current_database();
USE nosuch;
SET database = gw;
SELECT current_database();
BEGIN;
USE defaultdb;
ROLLBACK;

-- The builtins drivers call.
SELECT crdb_internal.increment_feature_counter('sqlalchemy-cockroachdb 1.4.6');
SELECT crdb_internal.is_admin(), crdb_internal.locality_value('region'),
       crdb_internal.locality_value('zone'), crdb_internal.node_id() > 0 AS has_node_id;

-- SHOW RANGES: one range per region partition of a REGIONAL BY ROW table (the meta leader
-- creates them within a second or so; the leaseholder is whoever won the election).
DO $$ BEGIN FOR i IN 1..100 LOOP
  EXIT WHEN (SELECT count(*) FROM multiregion.ranges WHERE database_name = 'gw' AND table_name = 'stores') >= 3;
  PERFORM pg_catalog.pg_sleep(0.1);
END LOOP; END $$;
SELECT table_name, partition, cardinality(voting_replicas) AS voters
  FROM [SHOW RANGES FROM TABLE stores] ORDER BY partition;
SHOW RANGES FROM TABLE nosuch;
-- CONFIGURE ZONE: overrides laid over the derived configuration, placement included.
ALTER TABLE settings CONFIGURE ZONE USING gc.ttlseconds = 600;
SELECT raw_config_sql FROM [SHOW ZONE CONFIGURATION FOR TABLE settings];
ALTER TABLE settings CONFIGURE ZONE USING num_replicas = 1;
SET override_multi_region_zone_config = true;
SHOW override_multi_region_zone_config;
ALTER TABLE settings CONFIGURE ZONE USING num_replicas = 1;
ALTER TABLE settings CONFIGURE ZONE USING constraints = '[+region=mars]';
ALTER TABLE settings CONFIGURE ZONE USING num_replicas = 1, num_voters = 1,
    constraints = '[+region=us-east1]', lease_preferences = '[[+region=us-east1]]';
-- The range drops its non-voting replicas.
DO $$ BEGIN FOR i IN 1..300 LOOP
  EXIT WHEN (SELECT cardinality(non_voting_replicas) FROM multiregion.ranges
              WHERE database_name = 'gw' AND table_name = 'settings') = 0;
  PERFORM pg_catalog.pg_sleep(0.1);
END LOOP; END $$;
SELECT cardinality(voting_replicas) AS voters, cardinality(non_voting_replicas) AS non_voters
  FROM [SHOW RANGES FROM TABLE settings];
SELECT raw_config_sql FROM [SHOW ZONE CONFIGURATION FOR TABLE settings];
ALTER TABLE settings CONFIGURE ZONE USING gc.ttlseconds = COPY FROM PARENT, bogus = 1;
ALTER TABLE settings CONFIGURE ZONE USING gc.ttlseconds = COPY FROM PARENT;
RESET override_multi_region_zone_config;
-- A rolled-back transaction's override is not kept.
BEGIN;
ALTER TABLE settings CONFIGURE ZONE USING gc.ttlseconds = 7;
ROLLBACK;
SELECT raw_config_sql LIKE '%gc.ttlseconds = 7,%' AS kept FROM [SHOW ZONE CONFIGURATION FOR TABLE settings];
ALTER TABLE settings CONFIGURE ZONE DISCARD;
DO $$ BEGIN FOR i IN 1..300 LOOP
  EXIT WHEN (SELECT cardinality(non_voting_replicas) FROM multiregion.ranges
              WHERE database_name = 'gw' AND table_name = 'settings') = 2;
  PERFORM pg_catalog.pg_sleep(0.1);
END LOOP; END $$;
SELECT cardinality(voting_replicas) AS voters, cardinality(non_voting_replicas) AS non_voters
  FROM [SHOW RANGES FROM TABLE settings];
ALTER PARTITION "us-west1" OF TABLE stores CONFIGURE ZONE USING gc.ttlseconds = 60;
SELECT raw_config_sql FROM [SHOW ZONE CONFIGURATION FOR PARTITION "us-west1" OF TABLE stores];
ALTER PARTITION "mars" OF TABLE stores CONFIGURE ZONE USING gc.ttlseconds = 60;
ALTER PARTITION "us-west1" OF TABLE stores CONFIGURE ZONE DISCARD;
ALTER DATABASE gw CONFIGURE ZONE USING gc.ttlseconds = 1000, range_max_bytes = 1073741824;
SELECT raw_config_sql FROM [SHOW ZONE CONFIGURATION FOR DATABASE gw];
ALTER DATABASE gw CONFIGURE ZONE DISCARD;
ALTER INDEX settings@settings_pkey CONFIGURE ZONE USING gc.ttlseconds = 1;
ALTER RANGE default CONFIGURE ZONE USING num_replicas = 5;
ALTER DATABASE defaultdb CONFIGURE ZONE USING gc.ttlseconds = 1;

-- psql's own meta-commands run PostgreSQL's catalog queries, untouched.
\dt
\d settings
\l gw
