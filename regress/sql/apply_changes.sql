-- multiregion.apply_changes: how a replica writes a replicated entry's rows (apply.rs), by
-- statements each backend prepares once per relation. Run here on local tables, as pgmr's
-- applier runs it: superuser, triggers off.
CREATE EXTENSION pg_multiregion;
CREATE TABLE ac_kv (k int PRIMARY KEY, v numeric, note text);
CREATE TABLE ac_nokey (a int, b text);
CREATE TABLE ac_seq (id serial PRIMARY KEY, v text);
SET session_replication_role = replica;
-- A run of inserts is one statement; numbers keep every digit (never through a float).
SELECT multiregion.apply_changes('[
  {"s":"public","t":"ac_kv","op":"I","old":null,"new":{"k":1,"v":123456789012345678901234567890.123456789,"note":"a"}},
  {"s":"public","t":"ac_kv","op":"I","old":null,"new":{"k":2,"v":"NaN","note":null}},
  {"s":"public","t":"ac_nokey","op":"I","old":null,"new":{"a":1,"b":"x"}},
  {"s":"public","t":"ac_nokey","op":"I","old":null,"new":{"a":1,"b":"x"}}]');
SELECT * FROM ac_kv ORDER BY k;
-- An entry applied again (one row, and a run) replaces the rows with its keys.
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_kv","op":"I","old":null,"new":{"k":1,"v":1,"note":"replayed"}}]');
SELECT multiregion.apply_changes('[
  {"s":"public","t":"ac_kv","op":"I","old":null,"new":{"k":1,"v":1,"note":"replayed"}},
  {"s":"public","t":"ac_kv","op":"I","old":null,"new":{"k":2,"v":"NaN","note":"replayed"}}]');
SELECT * FROM ac_kv ORDER BY k;
-- Updates (one of them changing the key) and a delete.
SELECT multiregion.apply_changes('[
  {"s":"public","t":"ac_kv","op":"U","old":{"k":1,"v":1,"note":"replayed"},"new":{"k":1,"v":98765432109876543210.0123456789012345,"note":"b"}},
  {"s":"public","t":"ac_kv","op":"U","old":{"k":2,"v":"NaN","note":"replayed"},"new":{"k":3,"v":"NaN","note":"moved key"}},
  {"s":"public","t":"ac_nokey","op":"D","old":{"a":1,"b":"x"},"new":null}]');
SELECT * FROM ac_kv ORDER BY k;
-- Without a primary key a delete takes one row equal to the old one.
SELECT * FROM ac_nokey;
-- Owned sequences move past the values written, never back.
SELECT multiregion.apply_changes('[
  {"s":"public","t":"ac_seq","op":"I","old":null,"new":{"id":41,"v":"a"}},
  {"s":"public","t":"ac_seq","op":"I","old":null,"new":{"id":40,"v":"b"}}]');
SELECT last_value FROM ac_seq_id_seq;
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_seq","op":"I","old":null,"new":{"id":7,"v":"c"}}]');
SELECT last_value FROM ac_seq_id_seq;
-- A schema change between entries: the relation's statements are prepared again, with the
-- new column (and without the dropped one).
ALTER TABLE ac_kv ADD COLUMN extra int;
ALTER TABLE ac_kv DROP COLUMN note;
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_kv","op":"I","old":null,"new":{"k":4,"v":4,"extra":44}}]');
SELECT * FROM ac_kv ORDER BY k;
-- A renamed table is found by its new name; the old name is gone.
ALTER TABLE ac_kv RENAME TO ac_kv2;
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_kv2","op":"D","old":{"k":4,"v":4,"extra":44},"new":null}]');
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_kv","op":"D","old":{"k":3},"new":null}]');
\echo :SQLSTATE
SELECT k FROM ac_kv2 ORDER BY k;
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_nokey","op":"T","old":null,"new":null}]');
SELECT count(*) FROM ac_nokey;
-- Bad input: not the captured format, or a kind of change there is none of.
SELECT multiregion.apply_changes('{"not":"an array"}');
\echo :SQLSTATE
SELECT multiregion.apply_changes('[{"s":"public","t":"ac_kv2","op":"X","old":null,"new":null}]');
\echo :SQLSTATE
RESET session_replication_role;
-- Only for pgmr's applier (a superuser): not executable by others.
SELECT has_function_privilege('public', 'multiregion.apply_changes(text)', 'EXECUTE');
DROP TABLE ac_kv2, ac_nokey, ac_seq;
DROP EXTENSION pg_multiregion;
