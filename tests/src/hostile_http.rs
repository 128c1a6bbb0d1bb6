//! A small HTTP/1.1 server on 127.0.0.1 that misbehaves on purpose, for the object-storage
//! tests: each request goes to a handler that answers like a real server, or with an endless
//! body, a wrong `Content-Range`, another version of the object, a 5xx, a reset connection, a
//! redirect, or a long stall. One thread per connection; connections are kept alive as
//! HTTP/1.1 clients expect. Not a mock of the backend: the client is the real one, over TCP.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A request as the handler sees it.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// The request target as sent (path and query).
    pub target: String,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    /// The how-manieth request this server got (from 0).
    pub index: usize,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The `Range: bytes=a-b` asked for, as `a..b+1`.
    pub fn range(&self) -> Option<std::ops::Range<u64>> {
        let spec = self.header("range")?.strip_prefix("bytes=")?;
        let (a, b) = spec.split_once('-')?;
        Some(a.trim().parse().ok()?..b.trim().parse::<u64>().ok()? + 1)
    }
}

/// How the body is sent.
pub enum Body {
    /// These bytes, with a `Content-Length`.
    Bytes(Vec<u8>),
    /// A `Content-Length` of a petabyte, whatever the `Content-Range` says, and bytes without
    /// end (until the client goes away).
    Endless,
    /// Chunked, without end.
    EndlessChunked,
    /// The headers, then nothing for this long, then these bytes.
    Stall(Duration, Vec<u8>),
}

/// What the handler answers.
pub enum Answer {
    Respond {
        status: u16,
        headers: Vec<(String, String)>,
        body: Body,
    },
    /// Close the connection without answering.
    Reset,
}

impl Answer {
    pub fn status(status: u16) -> Answer {
        Answer::Respond { status, headers: vec![], body: Body::Bytes(vec![]) }
    }
}

/// An object served as a static file server serves one: `206` with `Content-Range` for a
/// range, `200` without, `404` for other paths, the validators given.
pub struct Object<'a> {
    pub data: &'a [u8],
    pub etag: Option<&'a str>,
    pub last_modified: Option<&'a str>,
}

impl Object<'_> {
    pub fn answer(&self, req: &Request) -> Answer {
        let mut headers = vec![];
        if let Some(e) = self.etag {
            headers.push(("ETag".to_owned(), format!("\"{e}\"")));
        }
        if let Some(m) = self.last_modified {
            headers.push(("Last-Modified".to_owned(), m.to_owned()));
        }
        let len = self.data.len() as u64;
        match req.range() {
            Some(r) if r.start < len => {
                let end = r.end.min(len);
                headers.push(("Content-Range".to_owned(), format!("bytes {}-{}/{len}", r.start, end - 1)));
                let body = Body::Bytes(self.data[r.start as usize..end as usize].to_vec());
                Answer::Respond { status: 206, headers, body }
            }
            Some(_) => {
                headers.push(("Content-Range".to_owned(), format!("bytes */{len}")));
                Answer::Respond { status: 416, headers, body: Body::Bytes(vec![]) }
            }
            None => Answer::Respond { status: 200, headers, body: Body::Bytes(self.data.to_vec()) },
        }
    }
}

type Handler = dyn Fn(&Request) -> Answer + Send + Sync;

/// The running server; stopped when dropped.
pub struct HostileServer {
    port: u16,
    stop: Arc<AtomicBool>,
    requests: Arc<Mutex<Vec<Request>>>,
    accept: Option<thread::JoinHandle<()>>,
}

impl HostileServer {
    pub fn start(handler: impl Fn(&Request) -> Answer + Send + Sync + 'static) -> HostileServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let count = Arc::new(AtomicUsize::new(0));
        let (s, r) = (stop.clone(), requests.clone());
        let accept = thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (h, s, r, c) = (handler.clone(), s.clone(), r.clone(), count.clone());
                thread::spawn(move || serve(conn, &*h, &s, &r, &c));
            }
        });
        HostileServer { port, stop, requests, accept: Some(accept) }
    }

    /// `http://127.0.0.1:port/name`.
    pub fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for HostileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve(conn: TcpStream, handler: &Handler, stop: &AtomicBool, log: &Mutex<Vec<Request>>, count: &AtomicUsize) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(120)));
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || stop.load(Ordering::SeqCst) {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, target) = (parts.next().unwrap_or("").to_owned(), parts.next().unwrap_or("").to_owned());
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
            }
        }
        let body_len: usize =
            headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
        let mut sink = vec![0u8; body_len];
        if reader.read_exact(&mut sink).is_err() {
            return;
        }
        let req = Request { method, target, headers, index: count.fetch_add(1, Ordering::SeqCst) };
        log.lock().unwrap().push(req.clone());
        let (status, mut extra, body) = match handler(&req) {
            Answer::Reset => {
                let _ = out.shutdown(Shutdown::Both);
                return;
            }
            Answer::Respond { status, headers, body } => (status, headers, body),
        };
        let head_only = req.method == "HEAD";
        let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
        match &body {
            Body::Bytes(b) | Body::Stall(_, b) => extra.push(("Content-Length".into(), b.len().to_string())),
            Body::Endless => extra.push(("Content-Length".into(), (1u64 << 50).to_string())),
            Body::EndlessChunked => extra.push(("Transfer-Encoding".into(), "chunked".into())),
        }
        for (k, v) in &extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        if out.write_all(head.as_bytes()).is_err() {
            return;
        }
        if head_only {
            continue;
        }
        let ok = match body {
            Body::Bytes(b) => out.write_all(&b).is_ok(),
            Body::Stall(wait, b) => {
                let until = Instant::now() + wait;
                while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                    thread::sleep(Duration::from_millis(20));
                }
                out.write_all(&b).is_ok()
            }
            Body::Endless | Body::EndlessChunked => {
                let chunk = vec![0x5au8; 1 << 16];
                let framed = match body {
                    Body::Endless => chunk,
                    _ => [format!("{:x}\r\n", chunk.len()).into_bytes(), chunk, b"\r\n".to_vec()].concat(),
                };
                while !stop.load(Ordering::SeqCst) {
                    if out.write_all(&framed).is_err() {
                        break;
                    }
                }
                false
            }
        };
        if !ok {
            return;
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        304 => "Not Modified",
        404 => "Not Found",
        412 => "Precondition Failed",
        416 => "Range Not Satisfiable",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Whatever",
    }
}
