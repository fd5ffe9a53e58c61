//! PostgreSQL wire protocol v3: message framing, and readers and writers for the few messages
//! pgmr's SQL gateway looks into or makes itself. Everything else it relays as opaque bytes,
//! so this is deliberately not a full protocol implementation.
//!
//! Every reader works on untrusted bytes and returns [`ProtoError`] rather than panicking.

/// The largest message PostgreSQL itself accepts (`PQ_LARGE_MESSAGE_LIMIT`).
pub const MAX_MESSAGE: usize = 0x3fff_ffff;
/// The largest startup packet PostgreSQL accepts (`MAX_STARTUP_PACKET_LENGTH`).
pub const MAX_STARTUP: usize = 10_000;

const PROTOCOL_3: u32 = 196_608;
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
const CANCEL_REQUEST: u32 = 80_877_102;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("invalid message length {0}")]
    BadLength(i64),
    #[error("message of {0} bytes is larger than the limit of {1} bytes")]
    TooLarge(usize, usize),
    #[error("unsupported frontend protocol {}.{}", .0 >> 16, .0 & 0xffff)]
    Version(u32),
    #[error("malformed {0} message")]
    Malformed(&'static str),
}

/// The first packet of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Startup {
    Ssl,
    GssEnc,
    Cancel {
        pid: i32,
        key: i32,
    },
    /// A v3 startup message: `user`, `database`, `options`, … in the client's order.
    Params(Vec<(String, String)>),
}

/// The length of the startup packet at the front of `buf` (it has no type byte), once its
/// length word has arrived.
pub fn startup_len(buf: &[u8]) -> Result<Option<usize>, ProtoError> {
    let Some(word) = buf.get(..4) else {
        return Ok(None);
    };
    let len = i32::from_be_bytes([word[0], word[1], word[2], word[3]]);
    if len < 8 {
        return Err(ProtoError::BadLength(len.into()));
    }
    let len = len as usize;
    if len > MAX_STARTUP {
        return Err(ProtoError::TooLarge(len, MAX_STARTUP));
    }
    Ok(Some(len))
}

/// Reads a complete startup packet (length word included).
pub fn parse_startup(packet: &[u8]) -> Result<Startup, ProtoError> {
    let code = be_u32(packet.get(4..8).ok_or(ProtoError::Malformed("startup"))?);
    match code {
        SSL_REQUEST => Ok(Startup::Ssl),
        GSSENC_REQUEST => Ok(Startup::GssEnc),
        CANCEL_REQUEST => {
            let b = packet.get(8..16).ok_or(ProtoError::Malformed("cancel"))?;
            Ok(Startup::Cancel {
                pid: be_u32(&b[..4]) as i32,
                key: be_u32(&b[4..]) as i32,
            })
        }
        c if c >> 16 == 3 => {
            let mut params = Vec::new();
            let mut pos = 8;
            loop {
                let name = cstr(packet, &mut pos, "startup")?;
                if name.is_empty() {
                    break;
                }
                let value = cstr(packet, &mut pos, "startup")?;
                params.push((name.to_string(), value.to_string()));
            }
            Ok(Startup::Params(params))
        }
        c => Err(ProtoError::Version(c)),
    }
}

/// The type and total length (type byte included) of the message at the front of `buf`, once
/// its header has arrived. The body may still be incomplete.
pub fn header(buf: &[u8], max: usize) -> Result<Option<(u8, usize)>, ProtoError> {
    let Some(h) = buf.get(..5) else {
        return Ok(None);
    };
    let len = i32::from_be_bytes([h[1], h[2], h[3], h[4]]);
    if len < 4 {
        return Err(ProtoError::BadLength(len.into()));
    }
    let len = len as usize;
    if len > max {
        return Err(ProtoError::TooLarge(len, max));
    }
    Ok(Some((h[0], len + 1)))
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// A NUL-terminated UTF-8 string at `*pos`, advancing past it.
pub fn cstr<'a>(b: &'a [u8], pos: &mut usize, what: &'static str) -> Result<&'a str, ProtoError> {
    let rest = b.get(*pos..).ok_or(ProtoError::Malformed(what))?;
    let n = rest
        .iter()
        .position(|&c| c == 0)
        .ok_or(ProtoError::Malformed(what))?;
    let s = std::str::from_utf8(&rest[..n]).map_err(|_| ProtoError::Malformed(what))?;
    *pos += n + 1;
    Ok(s)
}

/// The body of a whole message (after type and length).
pub fn body(msg: &[u8]) -> &[u8] {
    msg.get(5..).unwrap_or_default()
}

/// `Query`: the query string.
pub fn read_query(msg: &[u8]) -> Result<&str, ProtoError> {
    cstr(body(msg), &mut 0, "Query")
}

/// `Parse`: statement name, query string, and the raw parameter-type section.
pub fn read_parse(msg: &[u8]) -> Result<(&str, &str, &[u8]), ProtoError> {
    let b = body(msg);
    let mut pos = 0;
    let name = cstr(b, &mut pos, "Parse")?;
    let query = cstr(b, &mut pos, "Parse")?;
    Ok((name, query, &b[pos..]))
}

/// `Bind`: portal name and statement name.
pub fn read_bind(msg: &[u8]) -> Result<(&str, &str), ProtoError> {
    let b = body(msg);
    let mut pos = 0;
    let portal = cstr(b, &mut pos, "Bind")?;
    let stmt = cstr(b, &mut pos, "Bind")?;
    Ok((portal, stmt))
}

/// `Describe` / `Close`: kind (`S` or `P`) and name.
pub fn read_target(msg: &[u8]) -> Result<(u8, &str), ProtoError> {
    let b = body(msg);
    let kind = *b.first().ok_or(ProtoError::Malformed("Describe/Close"))?;
    Ok((kind, cstr(b, &mut 1, "Describe/Close")?))
}

/// `Execute`: portal name.
pub fn read_execute(msg: &[u8]) -> Result<&str, ProtoError> {
    cstr(body(msg), &mut 0, "Execute")
}

/// `CommandComplete`: the tag.
pub fn read_command_complete(msg: &[u8]) -> Result<&str, ProtoError> {
    cstr(body(msg), &mut 0, "CommandComplete")
}

/// `ErrorResponse` / `NoticeResponse`: the fields, in order.
pub fn read_fields(msg: &[u8]) -> Result<Vec<(u8, String)>, ProtoError> {
    let b = body(msg);
    let mut pos = 0;
    let mut out = Vec::new();
    while let Some(&code) = b.get(pos) {
        if code == 0 {
            return Ok(out);
        }
        pos += 1;
        out.push((code, cstr(b, &mut pos, "ErrorResponse")?.to_string()));
    }
    Err(ProtoError::Malformed("ErrorResponse"))
}

/// `DataRow` in text format: each column's value, `None` for NULL.
pub fn read_data_row(msg: &[u8]) -> Result<Vec<Option<String>>, ProtoError> {
    let b = body(msg);
    let bad = ProtoError::Malformed("DataRow");
    let n = b.get(..2).ok_or(bad.clone())?;
    let n = u16::from_be_bytes([n[0], n[1]]) as usize;
    let mut pos = 2;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = b.get(pos..pos + 4).ok_or(bad.clone())?;
        let len = be_u32(len) as i32;
        pos += 4;
        if len < 0 {
            out.push(None);
            continue;
        }
        let v = b.get(pos..pos + len as usize).ok_or(bad.clone())?;
        out.push(Some(String::from_utf8_lossy(v).into_owned()));
        pos += len as usize;
    }
    Ok(out)
}

/// `BackendKeyData`: pid and secret key.
pub fn read_backend_key(msg: &[u8]) -> Result<(i32, i32), ProtoError> {
    let b = body(msg);
    if b.len() != 8 {
        return Err(ProtoError::Malformed("BackendKeyData"));
    }
    Ok((be_u32(&b[..4]) as i32, be_u32(&b[4..]) as i32))
}

/// `Authentication*`: the request code and its data.
pub fn read_auth(msg: &[u8]) -> Result<(i32, &[u8]), ProtoError> {
    let b = body(msg);
    let code = b.get(..4).ok_or(ProtoError::Malformed("Authentication"))?;
    Ok((be_u32(code) as i32, &b[4..]))
}

/// Appends a message of type `tag` whose body `fill` writes.
pub fn message(out: &mut Vec<u8>, tag: u8, fill: impl FnOnce(&mut Vec<u8>)) {
    out.push(tag);
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    fill(out);
    let len = (out.len() - at) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

fn put_cstr(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(s.as_bytes());
    out.push(0);
}

pub fn startup_message(out: &mut Vec<u8>, params: &[(String, String)]) {
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&PROTOCOL_3.to_be_bytes());
    for (k, v) in params {
        put_cstr(out, k);
        put_cstr(out, v);
    }
    out.push(0);
    let len = (out.len() - at) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

pub fn cancel_request(out: &mut Vec<u8>, pid: i32, key: i32) {
    out.extend_from_slice(&16u32.to_be_bytes());
    out.extend_from_slice(&CANCEL_REQUEST.to_be_bytes());
    out.extend_from_slice(&pid.to_be_bytes());
    out.extend_from_slice(&key.to_be_bytes());
}

pub fn query(out: &mut Vec<u8>, sql: &str) {
    message(out, b'Q', |b| put_cstr(b, sql));
}

/// `Parse` with the parameter-type section copied from the client's message.
pub fn parse(out: &mut Vec<u8>, name: &str, sql: &str, param_types: &[u8]) {
    message(out, b'P', |b| {
        put_cstr(b, name);
        put_cstr(b, sql);
        b.extend_from_slice(param_types);
    });
}

pub fn password(out: &mut Vec<u8>, data: &[u8]) {
    message(out, b'p', |b| b.extend_from_slice(data));
}

pub fn command_complete(out: &mut Vec<u8>, tag: &str) {
    message(out, b'C', |b| put_cstr(b, tag));
}

pub fn ready_for_query(out: &mut Vec<u8>, status: u8) {
    message(out, b'Z', |b| b.push(status));
}

pub fn backend_key_data(out: &mut Vec<u8>, pid: i32, key: i32) {
    message(out, b'K', |b| {
        b.extend_from_slice(&pid.to_be_bytes());
        b.extend_from_slice(&key.to_be_bytes());
    });
}

/// `ErrorResponse` (or `NoticeResponse` with tag `N`) from its fields.
pub fn fields_message(out: &mut Vec<u8>, tag: u8, fields: &[(u8, String)]) {
    message(out, tag, |b| {
        for (code, value) in fields {
            b.push(*code);
            put_cstr(b, value);
        }
        b.push(0);
    });
}

/// An `ErrorResponse` with severity `ERROR` (or `FATAL`), SQLSTATE, message and hint.
pub fn error_response(
    out: &mut Vec<u8>,
    severity: &str,
    sqlstate: &str,
    text: &str,
    hint: Option<&str>,
) {
    let mut fields = vec![
        (b'S', severity.to_string()),
        (b'V', severity.to_string()),
        (b'C', sqlstate.to_string()),
        (b'M', text.to_string()),
    ];
    if let Some(h) = hint {
        fields.push((b'H', h.to_string()));
    }
    fields_message(out, b'E', &fields);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_round_trips() {
        let params = vec![
            ("user".to_string(), "root".to_string()),
            ("database".to_string(), "movr".to_string()),
        ];
        let mut b = Vec::new();
        startup_message(&mut b, &params);
        assert_eq!(startup_len(&b).unwrap(), Some(b.len()));
        assert_eq!(parse_startup(&b).unwrap(), Startup::Params(params));
        let mut c = Vec::new();
        cancel_request(&mut c, 42, -7);
        assert_eq!(
            parse_startup(&c).unwrap(),
            Startup::Cancel { pid: 42, key: -7 }
        );
    }

    #[test]
    fn bad_lengths_and_versions_are_errors() {
        assert_eq!(startup_len(&[0, 0, 0, 3]), Err(ProtoError::BadLength(3)));
        assert!(matches!(
            startup_len(&[0, 1, 0, 0]),
            Err(ProtoError::TooLarge(..))
        ));
        assert_eq!(
            parse_startup(&[0, 0, 0, 8, 0, 2, 0, 0]),
            Err(ProtoError::Version(2 << 16))
        );
        assert_eq!(
            header(&[b'Q', 0, 0, 0, 2], MAX_MESSAGE),
            Err(ProtoError::BadLength(2))
        );
        assert!(matches!(
            header(&[b'Q', 0x7f, 0xff, 0xff, 0xff], MAX_MESSAGE),
            Err(ProtoError::TooLarge(..))
        ));
        assert_eq!(header(&[b'Q', 0, 0], MAX_MESSAGE), Ok(None));
    }

    #[test]
    fn messages_read_back() {
        let mut b = Vec::new();
        parse(&mut b, "s1", "SELECT $1", &[0, 1, 0, 0, 0, 23]);
        assert_eq!(header(&b, MAX_MESSAGE).unwrap(), Some((b'P', b.len())));
        assert_eq!(
            read_parse(&b).unwrap(),
            ("s1", "SELECT $1", &[0u8, 1, 0, 0, 0, 23][..])
        );
        let mut e = Vec::new();
        error_response(&mut e, "ERROR", "0A000", "no", Some("try"));
        let f = read_fields(&e).unwrap();
        assert_eq!(f[2], (b'C', "0A000".to_string()));
        assert_eq!(f[4], (b'H', "try".to_string()));
    }

    #[test]
    fn truncated_bodies_are_malformed_not_panics() {
        for msg in [
            &b"Q\0\0\0\x05"[..],
            b"P\0\0\0\x06s",
            b"B\0\0\0\x04",
            b"E\0\0\0\x06Cx",
        ] {
            let _ = read_query(msg);
            let _ = read_parse(msg);
            let _ = read_bind(msg);
            let _ = read_fields(msg);
            let _ = read_target(msg);
            let _ = read_backend_key(msg);
            let _ = read_auth(msg);
        }
        assert!(read_fields(b"E\0\0\0\x06Cx").is_err());
    }
}
