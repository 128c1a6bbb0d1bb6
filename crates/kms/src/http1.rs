//! The little HTTP/1.1 the datapipe socket needs: one request per connection
//! (`Connection: close`), responses framed by `Content-Length`, chunked transfer coding or the
//! end of the connection, with size limits and an overall deadline.
//!
//! reqwest cannot talk over a unix socket, and the datapipe protocol is a handful of small
//! GET/POST requests, so this is hand-written rather than pulling in hyper's low-level API.

use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

/// Longest status or header line accepted.
const MAX_LINE: usize = 16 * 1024;
/// Most header lines accepted.
const MAX_HEADERS: usize = 128;
/// Largest body accepted: KMS and datapipe answers are a few hundred bytes.
pub(crate) const MAX_BODY: usize = 4 * 1024 * 1024;

/// Why an exchange failed.
#[derive(Debug)]
pub(crate) enum HttpError {
    /// The transport failed (including timeouts: `ErrorKind::TimedOut` / `WouldBlock`).
    Io(io::Error),
    /// The peer sent something that is not a valid HTTP/1.1 response.
    Malformed(String),
    /// A header value we were asked to send contains CR, LF or NUL.
    BadHeader(&'static str),
}

impl HttpError {
    /// True for transport failures worth retrying (everything but a bad request of ours).
    pub(crate) fn is_transient(&self) -> bool {
        !matches!(self, HttpError::BadHeader(_))
    }

    /// True when the deadline passed.
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, HttpError::Io(e) if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock))
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::Io(_) if self.is_timeout() => f.write_str("timed out"),
            HttpError::Io(e) => write!(f, "{e}"),
            HttpError::Malformed(m) => write!(f, "malformed HTTP response: {m}"),
            HttpError::BadHeader(name) => {
                write!(f, "header {name} would contain CR, LF or NUL")
            }
        }
    }
}

impl From<io::Error> for HttpError {
    fn from(e: io::Error) -> Self {
        HttpError::Io(e)
    }
}

/// A response: status, headers (names as received) and the body, zeroized on drop (it may
/// hold key material).
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Zeroizing<Vec<u8>>,
}

impl Response {
    /// The first header named `name` (case-insensitive).
    #[cfg(test)]
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

impl fmt::Debug for Response {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Response")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body_len", &self.body.len())
            .finish()
    }
}

/// Serialises a request. `headers` must not include `Content-Length` (added when there is a
/// body or the method is POST). Values are checked for CR/LF/NUL (header injection).
pub(crate) fn write_request<W: Write>(
    w: &mut W,
    method: &str,
    target: &str,
    headers: &[(&'static str, &str)],
    body: &[u8],
) -> Result<(), HttpError> {
    if target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(HttpError::BadHeader("request-target"));
    }
    let mut out = Zeroizing::new(Vec::with_capacity(256 + body.len()));
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
            return Err(HttpError::BadHeader(name));
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || method == "POST" {
        out.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()?;
    Ok(())
}

/// Reads one line ending in `\n` (CR stripped), at most [`MAX_LINE`] bytes. `None` at a clean
/// end of stream before any byte.
fn read_line<R: BufRead>(r: &mut R) -> Result<Option<String>, HttpError> {
    let mut line = Vec::new();
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            if line.is_empty() {
                return Ok(None);
            }
            return Err(HttpError::Malformed("connection closed in the middle of a line".into()));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if line.len() > MAX_LINE {
            return Err(HttpError::Malformed(format!("a status or header line is longer than {MAX_LINE} bytes")));
        }
        if done {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return String::from_utf8(line)
                .map(Some)
                .map_err(|_| HttpError::Malformed("a header line is not UTF-8".into()));
        }
    }
}

fn parse_status(line: &str) -> Result<u16, HttpError> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let code = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Malformed(format!(
            "status line does not start with HTTP/1.x: {:?}",
            truncate(line, 80)
        )));
    }
    match code.parse::<u16>() {
        Ok(c) if code.len() == 3 && (100..=999).contains(&c) => Ok(c),
        _ => Err(HttpError::Malformed(format!("bad status code in {:?}", truncate(line, 80)))),
    }
}

/// At most `max` characters of `s`, for messages.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Reads one response to a request made with `method`.
pub(crate) fn read_response<R: Read>(r: R, method: &str) -> Result<Response, HttpError> {
    let mut r = BufReader::new(r);
    let (status, headers) = loop {
        let line = read_line(&mut r)?
            .ok_or_else(|| HttpError::Malformed("connection closed before a response was received".into()))?;
        let status = parse_status(&line)?;
        let headers = read_headers(&mut r)?;
        // Skip interim 1xx responses (e.g. an unsolicited 100 Continue).
        if !(100..200).contains(&status) {
            break (status, headers);
        }
    };
    let get = |name: &str| {
        headers.iter().filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect::<Vec<_>>()
    };
    let no_body = method == "HEAD" || status == 204 || status == 304;
    let chunked =
        get("transfer-encoding").iter().any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("chunked")));
    let body = if no_body {
        Zeroizing::new(Vec::new())
    } else if chunked {
        read_chunked(&mut r)?
    } else {
        let lengths = get("content-length");
        match lengths.first() {
            Some(first) => {
                if lengths.iter().any(|l| l.trim() != first.trim()) {
                    return Err(HttpError::Malformed("conflicting Content-Length headers".into()));
                }
                let len: usize = first
                    .trim()
                    .parse()
                    .map_err(|_| HttpError::Malformed(format!("bad Content-Length {:?}", truncate(first, 40))))?;
                if len > MAX_BODY {
                    return Err(HttpError::Malformed(format!(
                        "body of {len} bytes is larger than the {MAX_BODY} byte limit"
                    )));
                }
                read_exact_body(&mut r, len)?
            }
            None => read_to_end_limited(&mut r)?,
        }
    };
    Ok(Response { status, headers, body })
}

fn read_headers<R: BufRead>(r: &mut R) -> Result<Vec<(String, String)>, HttpError> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| HttpError::Malformed("connection closed inside the headers".into()))?;
        if line.is_empty() {
            return Ok(headers);
        }
        if headers.len() >= MAX_HEADERS {
            return Err(HttpError::Malformed(format!("more than {MAX_HEADERS} header lines")));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| HttpError::Malformed(format!("header line without a colon: {:?}", truncate(&line, 80))))?;
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(HttpError::Malformed(format!("bad header name {:?}", truncate(name, 80))));
        }
        headers.push((name.to_string(), value.trim().to_string()));
    }
}

fn read_exact_body<R: Read>(r: &mut R, len: usize) -> Result<Zeroizing<Vec<u8>>, HttpError> {
    let mut body = Zeroizing::new(vec![0u8; len]);
    let mut got = 0;
    while got < len {
        match r.read(&mut body[got..]) {
            Ok(0) => return Err(HttpError::Malformed(format!("connection closed after {got} of {len} body bytes"))),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(body)
}

fn read_to_end_limited<R: Read>(r: &mut R) -> Result<Zeroizing<Vec<u8>>, HttpError> {
    let mut body = Zeroizing::new(Vec::new());
    let mut buf = Zeroizing::new([0u8; 8192]);
    loop {
        match r.read(&mut buf[..]) {
            Ok(0) => return Ok(body),
            Ok(n) => {
                if body.len() + n > MAX_BODY {
                    return Err(HttpError::Malformed(format!("body is larger than the {MAX_BODY} byte limit")));
                }
                body.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

fn read_chunked<R: BufRead>(r: &mut R) -> Result<Zeroizing<Vec<u8>>, HttpError> {
    let mut body = Zeroizing::new(Vec::new());
    loop {
        let line =
            read_line(r)?.ok_or_else(|| HttpError::Malformed("connection closed before the last chunk".into()))?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .ok()
            .filter(|_| !size_text.is_empty() && size_text.len() <= 16)
            .ok_or_else(|| HttpError::Malformed(format!("bad chunk size line {:?}", truncate(&line, 40))))?;
        if size == 0 {
            // Trailers, then the empty line.
            read_headers(r)?;
            return Ok(body);
        }
        if body.len().saturating_add(size) > MAX_BODY {
            return Err(HttpError::Malformed(format!("chunked body is larger than the {MAX_BODY} byte limit")));
        }
        let chunk = read_exact_body(r, size)?;
        body.extend_from_slice(&chunk);
        match read_line(r)? {
            Some(l) if l.is_empty() => {}
            _ => return Err(HttpError::Malformed("chunk data is not followed by CRLF".into())),
        }
    }
}

/// A unix-socket stream whose reads and writes all share one deadline.
pub(crate) struct DeadlineStream {
    stream: UnixStream,
    deadline: Instant,
}

impl DeadlineStream {
    pub(crate) fn new(stream: UnixStream, timeout: Duration) -> DeadlineStream {
        DeadlineStream { stream, deadline: Instant::now() + timeout }
    }

    fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
        } else {
            Ok(left)
        }
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Result<Response, HttpError> {
        read_response(raw, "GET")
    }

    #[test]
    fn content_length() {
        let r =
            parse(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}trailing")
                .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(&r.body[..], b"{\"a\":1}");
        assert_eq!(r.header("content-type"), Some("application/json"));
    }

    #[test]
    fn chunked_with_extensions_and_trailers() {
        let r = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\n{\"me\r\na\r\nssage\": \"p\r\n5\r\nong\"}\r\n0\r\nX-Trailer: t\r\n\r\n",
        )
        .unwrap();
        assert_eq!(&r.body[..], br#"{"message": "pong"}"#);
    }

    #[test]
    fn until_eof_and_interim() {
        let r = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 503 Busy\r\nServer: x\r\n\r\nlater").unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(&r.body[..], b"later");
        let r = read_response(&b"HTTP/1.1 204 No Content\r\n\r\n"[..], "GET").unwrap();
        assert!(r.body.is_empty());
    }

    #[test]
    fn malformed_responses_are_errors() {
        for raw in [
            &b""[..],
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
            b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
        ] {
            let e = parse(raw).unwrap_err();
            assert!(matches!(e, HttpError::Malformed(_)), "{e} for {raw:?}");
        }
        let long = [b"HTTP/1.1 200 OK\r\nX: ".as_slice(), &[b'a'; MAX_LINE + 10]].concat();
        assert!(parse(&long).is_err());
    }

    #[test]
    fn request_serialisation_and_injection() {
        let mut out = Vec::new();
        write_request(
            &mut out,
            "POST",
            "/?Action=Decrypt",
            &[("Host", "localhost"), ("X-Datapipe-Task-Type", "top")],
            b"{}",
        )
        .unwrap();
        assert_eq!(
            out,
            b"POST /?Action=Decrypt HTTP/1.1\r\nHost: localhost\r\nX-Datapipe-Task-Type: top\r\nContent-Length: 2\r\n\r\n{}"
        );
        let mut out = Vec::new();
        write_request(&mut out, "GET", "/", &[("Host", "localhost")], b"").unwrap();
        assert_eq!(out, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n");
        let e = write_request(&mut Vec::new(), "GET", "/", &[("X-TOS-Path", "/a\r\nX-Evil: 1")], b"").unwrap_err();
        assert!(matches!(e, HttpError::BadHeader("X-TOS-Path")));
        assert!(write_request(&mut Vec::new(), "GET", "/ x", &[], b"").is_err());
    }
}
