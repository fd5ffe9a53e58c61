//! Recognising a star (`*`, `t.*`, `s.t.*`) at a position of PostgreSQL's source text.
//!
//! PostgreSQL gives every column a star expands to the star's location, and an explicitly named
//! column the location of its name, so the text there tells which of the two a column came from.
//! The extension uses this to keep the hidden `crdb_region` column out of `SELECT *`.

/// True if the text at byte offset `location` of `sql` is a star reference: `*`, or one or more
/// (possibly quoted) names each followed by `.`, then `*`. Comments and whitespace may appear
/// around the dots, as PostgreSQL allows.
pub fn is_star_reference(sql: &str, location: usize) -> bool {
    let Some(rest) = sql.as_bytes().get(location..) else {
        return false;
    };
    let mut s = Scanner { b: rest, i: 0 };
    loop {
        if s.peek() == Some(b'*') {
            return true;
        }
        if !s.name() {
            return false;
        }
        s.skip_blank();
        if s.peek() != Some(b'.') {
            return false;
        }
        s.i += 1;
        s.skip_blank();
    }
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    /// Consumes one identifier, quoted or not; false (consuming nothing useful) if none is here.
    fn name(&mut self) -> bool {
        match self.peek() {
            Some(b'"') => {
                self.i += 1;
                loop {
                    match self.peek() {
                        None => return false,
                        Some(b'"') if self.b.get(self.i + 1) == Some(&b'"') => self.i += 2,
                        Some(b'"') => {
                            self.i += 1;
                            return true;
                        }
                        Some(_) => self.i += 1,
                    }
                }
            }
            Some(c) if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => {
                while let Some(c) = self.peek() {
                    if c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80 {
                        self.i += 1;
                    } else {
                        break;
                    }
                }
                true
            }
            _ => false,
        }
    }

    fn skip_blank(&mut self) {
        loop {
            match (self.peek(), self.b.get(self.i + 1).copied()) {
                (Some(c), _) if c.is_ascii_whitespace() => self.i += 1,
                (Some(b'-'), Some(b'-')) => {
                    while !matches!(self.peek(), None | Some(b'\n')) {
                        self.i += 1;
                    }
                }
                (Some(b'/'), Some(b'*')) => {
                    let mut depth = 0usize;
                    while self.i < self.b.len() {
                        if self.b[self.i..].starts_with(b"/*") {
                            depth += 1;
                            self.i += 2;
                        } else if self.b[self.i..].starts_with(b"*/") {
                            depth -= 1;
                            self.i += 2;
                            if depth == 0 {
                                break;
                            }
                        } else {
                            self.i += 1;
                        }
                    }
                }
                _ => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_star_reference;

    fn at(sql: &str, needle: &str) -> bool {
        is_star_reference(sql, sql.find(needle).expect("needle"))
    }

    #[test]
    fn bare_and_qualified_stars_are_stars() {
        assert!(at("SELECT * FROM t", "*"));
        assert!(at("SELECT t.* FROM t", "t.*"));
        assert!(at("SELECT public.t.* FROM t", "public"));
        assert!(at("SELECT \"T\".* FROM \"T\"", "\"T\""));
        assert!(at("SELECT \"a\"\"b\" . /* c */ * FROM x", "\"a"));
        assert!(at("SELECT x -- c\n . * FROM x", "x --"));
    }

    #[test]
    fn named_columns_are_not_stars() {
        assert!(!at("SELECT crdb_region FROM t", "crdb_region"));
        assert!(!at("SELECT t.crdb_region FROM t", "t.crdb"));
        assert!(!at("SELECT \"crdb_region\", * FROM t", "\"crdb"));
        assert!(!at("SELECT count(*) FROM t", "count"));
    }

    #[test]
    fn out_of_range_or_garbage_is_not_a_star() {
        assert!(!is_star_reference("SELECT 1", 99));
        assert!(!is_star_reference("\"unterminated", 0));
        assert!(!is_star_reference("a.", 0));
        assert!(!is_star_reference("a./* open", 0));
        assert!(!is_star_reference("é", 1));
    }
}
