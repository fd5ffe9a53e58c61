-- pg_dump of the MovR database (movr.sql) and pg_restore into a new database of the cluster:
-- multiregion.post_restore() adopts the dump's declarations, and the copy has the same
-- regions, localities, hidden and computed region columns, global keys and rows.
\set VERBOSITY default
CREATE DATABASE movr_copy;
\c movr_copy
-- Nothing restored yet.
SELECT multiregion.post_restore();
SELECT multiregion.post_restore('{"tables": []}');
\! /usr/lib/postgresql/15/bin/pg_dump -Fc -d movr -f /tmp/pg_multiregion-regress-movr.dump && echo dumped
\! /usr/lib/postgresql/15/bin/pg_restore -d movr_copy --exit-on-error /tmp/pg_multiregion-regress-movr.dump && echo restored
-- Until adopted, the database has no regions; its rows are all there.
SELECT count(*) AS regions FROM multiregion.regions;
SELECT multiregion.post_restore();
-- Once is enough.
SELECT multiregion.post_restore();
SELECT region, "primary" FROM multiregion.regions ORDER BY region;
SELECT table_name, locality FROM multiregion.tables ORDER BY table_name;
SELECT tableoid::regclass AS partition, count(*) FROM rides GROUP BY 1 ORDER BY 1;
SELECT g.relid::regclass AS "table", g.constraint_name, g.key_table, g.columns
  FROM multiregion.global_key g ORDER BY 1, 2;
-- Every row of every table, as one checksum, compared with the original's.
\set sums 'SELECT \'users\' t, count(*) n, md5(string_agg(u::text, \',\' ORDER BY id)) FROM users u UNION ALL SELECT \'vehicles\', count(*), md5(string_agg(v::text, \',\' ORDER BY id)) FROM vehicles v UNION ALL SELECT \'rides\', count(*), md5(string_agg(r::text, \',\' ORDER BY id)) FROM rides r UNION ALL SELECT \'vehicle_location_histories\', count(*), md5(string_agg(h::text, \',\' ORDER BY ride_id, "timestamp")) FROM vehicle_location_histories h UNION ALL SELECT \'promo_codes\', count(*), md5(string_agg(p::text, \',\' ORDER BY code)) FROM promo_codes p UNION ALL SELECT \'user_promo_codes\', count(*), md5(string_agg(c::text, \',\' ORDER BY user_id, code)) FROM user_promo_codes c'
SELECT t, n FROM (:sums) s ORDER BY t;
SELECT md5(string_agg(t || n || md5, ',' ORDER BY t)) AS copy_sum FROM (:sums) s \gset
\c movr
SELECT md5(string_agg(t || n || md5, ',' ORDER BY t)) = :'copy_sum' AS same_rows FROM (:sums) s;
\c movr_copy
-- Keys stay unique across regions; a new row's region is computed from its city.
INSERT INTO promo_codes VALUES ('code2', 'again', now(), now(), '{}');
INSERT INTO users (id, city, name) SELECT id, 'rome', 'again' FROM users WHERE city = 'boston' LIMIT 1;
INSERT INTO users (id, city, name) VALUES ('00000000-0000-0000-0000-0000000000d1', 'seattle', 'new')
RETURNING region;
\c postgres
DROP DATABASE movr_copy WITH (FORCE);
\! rm -f /tmp/pg_multiregion-regress-movr.dump
