//! Mock KMS (TCP) and mock datapipe (unix socket) servers for the integration tests.
//!
//! The mock KMS checks every request's signature with its own implementation of the documented
//! algorithm (veturboio.md §3.3), computed from what it actually received, not with the
//! crate's `sign` module.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

pub const KEYRING: &str = "datapipe_keyring";
pub const KEY_NAME: &str = "datapipe_key_ml_maas";
pub const REGION: &str = "cn-beijing";

// ---------------------------------------------------------------------------------------------
// A minimal HTTP request reader and response writer (independent of the crate's).

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn query(&self) -> &str {
        self.target.split_once('?').map_or("", |(_, q)| q)
    }

    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query().split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| v)
    }
}

pub fn read_request<R: Read>(r: R) -> Option<Request> {
    let mut r = BufReader::new(r);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.trim_end().split(' ');
    let method = parts.next()?.to_string();
    let target = parts.next()?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end_matches(['\r', '\n']);
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.to_string(), v.trim().to_string()));
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .map_or(0, |(_, v)| v.parse().unwrap_or(0));
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some(Request { method, target, headers, body })
}

pub fn write_response<W: Write>(w: &mut W, status: u16, body: &str, chunked: bool) {
    let mut out = format!("HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nConnection: close\r\n");
    if chunked {
        out.push_str("Transfer-Encoding: chunked\r\n\r\n");
        for chunk in body.as_bytes().chunks(7) {
            out.push_str(&format!("{:x};mock=1\r\n", chunk.len()));
            out.push_str(std::str::from_utf8(chunk).unwrap_or(""));
            out.push_str("\r\n");
        }
        out.push_str("0\r\n\r\n");
    } else {
        out.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    }
    let _ = w.write_all(out.as_bytes());
    let _ = w.flush();
}

fn error_body(code: &str, message: &str) -> String {
    format!(
        r#"{{"ResponseMetadata":{{"RequestId":"mock","Action":"","Version":"2021-02-18","Service":"kms","Region":"cn-beijing","Error":{{"Code":"{code}","Message":"{message}"}}}}}}"#
    )
}

// ---------------------------------------------------------------------------------------------
// Independent signature check.

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key).unwrap();
    m.update(data.as_bytes());
    m.finalize().into_bytes().to_vec()
}

fn hexs(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Verifies `req` as a Volcano Engine HMAC-SHA256 request. `Err((code, message))` on failure.
fn verify(req: &Request, sk_for: &dyn Fn(&str) -> Option<String>) -> Result<String, (String, String)> {
    let fail = |c: &str, m: &str| Err((c.to_string(), m.to_string()));
    let Some(auth) = req.header("authorization") else {
        return fail("MissingAuthenticationToken", "no Authorization");
    };
    let Some(rest) = auth.strip_prefix("HMAC-SHA256 ") else {
        return fail("InvalidAuthorization", "algorithm");
    };
    let mut fields = HashMap::new();
    for part in rest.split(", ") {
        if let Some((k, v)) = part.split_once('=') {
            fields.insert(k.to_string(), v.to_string());
        }
    }
    let (Some(cred), Some(signed), Some(sig)) =
        (fields.get("Credential"), fields.get("SignedHeaders"), fields.get("Signature"))
    else {
        return fail("InvalidAuthorization", "fields");
    };
    let cparts: Vec<&str> = cred.split('/').collect();
    if cparts.len() != 5 || cparts[4] != "request" {
        return fail("InvalidCredential", "credential scope");
    }
    let (ak, date, region, service) = (cparts[0], cparts[1], cparts[2], cparts[3]);
    let Some(sk) = sk_for(ak) else {
        return fail("InvalidAccessKey", "unknown access key");
    };
    let x_date = req.header("x-date").unwrap_or("");
    if !x_date.starts_with(date) || x_date.len() != 16 {
        return fail("InvalidTimestamp", "X-Date does not match the scope");
    }
    let body_hash = hexs(&Sha256::digest(&req.body));
    if req.header("x-content-sha256") != Some(body_hash.as_str()) {
        return fail("InvalidContentSha256", "X-Content-Sha256 does not match the body");
    }
    let names: Vec<&str> = signed.split(';').collect();
    if !names.contains(&"host") || !names.contains(&"x-date") {
        return fail("InvalidAuthorization", "host and x-date must be signed");
    }
    let mut canon_headers = String::new();
    for n in &names {
        let v = req.header(n).unwrap_or("");
        canon_headers.push_str(&format!("{n}:{}\n", v.trim()));
    }
    let mut q: Vec<&str> = req.query().split('&').filter(|s| !s.is_empty()).collect();
    q.sort();
    let path = req.target.split('?').next().unwrap_or("");
    let canonical = format!("{}\n{}\n{}\n{}\n{}\n{}", req.method, path, q.join("&"), canon_headers, signed, body_hash);
    let scope = format!("{date}/{region}/{service}/request");
    let sts = format!("HMAC-SHA256\n{x_date}\n{scope}\n{}", hexs(&Sha256::digest(canonical.as_bytes())));
    let k = hmac(sk.as_bytes(), date);
    let k = hmac(&k, region);
    let k = hmac(&k, service);
    let k = hmac(&k, "request");
    if hexs(&hmac(&k, &sts)) != *sig {
        return fail(
            "SignatureDoesNotMatch",
            "The request signature we calculated does not match the signature you provided",
        );
    }
    if region != REGION || service != "kms" {
        return fail("InvalidCredential", "region or service");
    }
    Ok(ak.to_string())
}

// ---------------------------------------------------------------------------------------------
// Mock KMS.

/// The mock's "encryption": XOR with 0x5a behind a prefix, base64.
pub fn mock_blob(plaintext: &[u8]) -> String {
    let mut v = b"mockblob:".to_vec();
    v.extend(plaintext.iter().map(|b| b ^ 0x5a));
    B64.encode(v)
}

fn mock_unblob(blob: &str) -> Option<Vec<u8>> {
    let raw = B64.decode(blob).ok()?;
    let rest = raw.strip_prefix(b"mockblob:")?;
    Some(rest.iter().map(|b| b ^ 0x5a).collect())
}

/// The blob veTurboIO would store for a raw data key: KMS-encrypted base64 of the key.
pub fn header_blob(raw_key: &[u8]) -> String {
    mock_blob(B64.encode(raw_key).as_bytes())
}

#[derive(Default)]
struct KmsState {
    /// access key -> (secret key, required session token)
    creds: HashMap<String, (String, Option<String>)>,
    forced: VecDeque<u16>,
    requests: Vec<Request>,
    hang: bool,
    omit_result: bool,
}

pub struct MockKms {
    pub addr: SocketAddr,
    state: Arc<Mutex<KmsState>>,
    stop: Arc<AtomicBool>,
}

impl MockKms {
    pub fn start() -> MockKms {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(KmsState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        accept_loop(move || listener.accept().map(|(c, _)| c), stop.clone(), state.clone(), serve_kms);
        MockKms { addr, state, stop }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn add_credentials(&self, ak: &str, sk: &str, token: Option<&str>) {
        self.state.lock().unwrap().creds.insert(ak.into(), (sk.into(), token.map(str::to_string)));
    }

    /// The next requests get these statuses (a 5xx/4xx error body) before normal service.
    pub fn force(&self, statuses: &[u16]) {
        self.state.lock().unwrap().forced.extend(statuses);
    }

    pub fn set_omit_result(&self, on: bool) {
        self.state.lock().unwrap().omit_result = on;
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }
}

/// Accepts connections on a background thread and serves each on its own thread, until `stop`
/// is set (the owner then makes one more connection to wake the loop up).
fn accept_loop<C: Send + 'static, S: Send + 'static>(
    mut accept: impl FnMut() -> std::io::Result<C> + Send + 'static,
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<S>>,
    serve: fn(C, &Mutex<S>),
) {
    thread::spawn(move || loop {
        let conn = accept();
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        let state = state.clone();
        thread::spawn(move || serve(conn, &state));
    });
}

impl Drop for MockKms {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve_kms(mut conn: TcpStream, state: &Mutex<KmsState>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let Some(req) = read_request(&mut conn) else {
        return;
    };
    let (status, body) = handle_kms(&req, state);
    write_response(&mut conn, status, &body, false);
}

fn handle_kms(req: &Request, state: &Mutex<KmsState>) -> (u16, String) {
    let mut st = state.lock().unwrap();
    st.requests.push(req.clone());
    if let Some(code) = st.forced.pop_front() {
        return (code, error_body("MockForced", &format!("forced {code}")));
    }
    let creds = st.creds.clone();
    let omit = st.omit_result;
    drop(st);
    let ak = match verify(req, &|ak| creds.get(ak).map(|c| c.0.clone())) {
        Ok(ak) => ak,
        Err((code, msg)) => return (401, error_body(&code, &msg)),
    };
    if let Some(Some(token)) = creds.get(&ak).map(|c| c.1.clone()) {
        if req.header("x-security-token") != Some(token.as_str()) {
            return (401, error_body("InvalidSecurityToken", "bad session token"));
        }
    }
    if req.method != "POST" || !req.target.starts_with("/?") {
        return (400, error_body("InvalidRequest", "POST /? expected"));
    }
    if req.header("content-type") != Some("application/json") {
        return (400, error_body("InvalidContentType", "application/json expected"));
    }
    if req.query_param("Version") != Some("2021-02-18")
        || req.query_param("KeyringName") != Some(KEYRING)
        || req.query_param("KeyName") != Some(KEY_NAME)
    {
        return (404, error_body("KeyNotFound", "no such keyring or key"));
    }
    let body = String::from_utf8_lossy(&req.body).to_string();
    let json: serde_json::Value = match serde_json::from_str(&body) {
        Ok(j) => j,
        Err(_) => return (400, error_body("InvalidParameter", "body is not JSON")),
    };
    let result = match req.query_param("Action") {
        Some("Decrypt") => {
            let Some(blob) = json.get("CiphertextBlob").and_then(|v| v.as_str()) else {
                return (400, error_body("InvalidParameter", "CiphertextBlob"));
            };
            // Python json.dumps spacing, byte for byte.
            if body != format!("{{\"CiphertextBlob\": \"{blob}\"}}") {
                return (400, error_body("InvalidParameter", "body spacing"));
            }
            match mock_unblob(blob) {
                Some(p) => {
                    format!(r#"{{"Plaintext":"{}","KeyringName":"{KEYRING}","KeyName":"{KEY_NAME}"}}"#, B64.encode(p))
                }
                None => return (400, error_body("InvalidCiphertext", "cannot decrypt")),
            }
        }
        Some("Encrypt") => {
            let Some(p) = json.get("Plaintext").and_then(|v| v.as_str()) else {
                return (400, error_body("InvalidParameter", "Plaintext"));
            };
            if body != format!("{{\"Plaintext\": \"{p}\"}}") {
                return (400, error_body("InvalidParameter", "body spacing"));
            }
            match B64.decode(p) {
                Ok(raw) => format!(r#"{{"CiphertextBlob":"{}"}}"#, mock_blob(&raw)),
                Err(_) => return (400, error_body("InvalidParameter", "Plaintext is not base64")),
            }
        }
        _ => return (400, error_body("InvalidAction", "unknown action")),
    };
    if omit {
        return (200, r#"{"ResponseMetadata":{"RequestId":"mock"},"Result":{}}"#.into());
    }
    (200, format!(r#"{{"ResponseMetadata":{{"RequestId":"mock","Service":"kms"}},"Result":{result}}}"#))
}

// ---------------------------------------------------------------------------------------------
// Mock datapipe.

#[derive(Default)]
struct DpState {
    key_iv: Option<(String, String)>,
    sts: Option<(String, String, String)>,
    sfcs_sts: Option<String>,
    kms: Option<SocketAddr>,
    pong: String,
    forced: HashMap<String, VecDeque<u16>>,
    chunked: bool,
    requests: Vec<Request>,
}

pub struct MockDatapipe {
    pub path: PathBuf,
    state: Arc<Mutex<DpState>>,
    stop: Arc<AtomicBool>,
    _dir: tempfile::TempDir,
}

impl MockDatapipe {
    pub fn start() -> MockDatapipe {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("datapipe.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let state = Arc::new(Mutex::new(DpState { pong: "pong".into(), ..DpState::default() }));
        let stop = Arc::new(AtomicBool::new(false));
        accept_loop(move || listener.accept().map(|(c, _)| c), stop.clone(), state.clone(), serve_dp);
        MockDatapipe { path, state, stop, _dir: dir }
    }

    /// `encrypt-key` answers with these raw key and IV bytes.
    pub fn set_key_iv(&self, key: &[u8], iv: &[u8]) {
        self.state.lock().unwrap().key_iv = Some((B64.encode(key), B64.encode(iv)));
    }

    /// `encrypt-key` answers with this raw JSON text for Key and IV.
    pub fn set_key_iv_b64(&self, key: &str, iv: &str) {
        self.state.lock().unwrap().key_iv = Some((key.into(), iv.into()));
    }

    pub fn set_sts(&self, ak: &str, sk: &str, token: &str) {
        self.state.lock().unwrap().sts = Some((ak.into(), sk.into(), token.into()));
    }

    /// `sfcs-sts` answers with this JSON text.
    pub fn set_sfcs_sts(&self, json: &str) {
        self.state.lock().unwrap().sfcs_sts = Some(json.into());
    }

    /// `top` forwards to this KMS.
    pub fn set_kms(&self, kms: &MockKms) {
        self.state.lock().unwrap().kms = Some(kms.addr);
    }

    pub fn set_pong(&self, word: &str) {
        self.state.lock().unwrap().pong = word.into();
    }

    pub fn set_chunked(&self, on: bool) {
        self.state.lock().unwrap().chunked = on;
    }

    /// The next requests of `task` get these statuses.
    pub fn force(&self, task: &str, statuses: &[u16]) {
        self.state.lock().unwrap().forced.entry(task.into()).or_default().extend(statuses);
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    pub fn tasks(&self) -> Vec<String> {
        self.requests().iter().map(|r| r.header("x-datapipe-task-type").unwrap_or("").to_string()).collect()
    }
}

impl Drop for MockDatapipe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&self.path);
    }
}

fn serve_dp(mut conn: UnixStream, state: &Mutex<DpState>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let Some(req) = read_request(&mut conn) else {
        return;
    };
    let task = req.header("x-datapipe-task-type").unwrap_or("").to_string();
    let mut st = state.lock().unwrap();
    st.requests.push(req.clone());
    let chunked = st.chunked;
    if let Some(code) = st.forced.get_mut(&task).and_then(VecDeque::pop_front) {
        drop(st);
        write_response(&mut conn, code, r#"{"error":"forced"}"#, false);
        return;
    }
    let (status, body) = match (req.method.as_str(), task.as_str()) {
        ("GET", "ping") => (200, format!(r#"{{"message": "{}"}}"#, st.pong)),
        ("GET", "encrypt-key") => match &st.key_iv {
            Some((k, iv)) => (200, format!(r#"{{"Key": "{k}", "IV": "{iv}"}}"#)),
            None => (404, r#"{"error":"no key for this model"}"#.to_string()),
        },
        ("GET", "kms-sts") => match &st.sts {
            Some((ak, sk, tok)) => (
                200,
                format!(
                    r#"{{"Cred": {{"AccessKeyId": "{ak}", "SecretAccessKey": "{sk}", "SessionToken": "{tok}", "CurrentTime": "2024-01-01T00:00:00Z"}}}}"#
                ),
            ),
            None => (404, r#"{"error":"no sts"}"#.to_string()),
        },
        ("GET", "sfcs-sts") => match &st.sfcs_sts {
            Some(j) => (200, j.clone()),
            None => (404, r#"{"error":"no sfcs sts"}"#.to_string()),
        },
        ("POST", "top") => match st.kms {
            Some(addr) => {
                drop(st);
                forward(&req, addr, &mut conn);
                return;
            }
            None => (502, r#"{"error":"no upstream"}"#.to_string()),
        },
        _ => (400, r#"{"error":"unknown task"}"#.to_string()),
    };
    drop(st);
    write_response(&mut conn, status, &body, chunked);
}

/// The `top` proxy: the same request to the KMS, with its Host, relayed back verbatim.
fn forward(req: &Request, kms: SocketAddr, client: &mut UnixStream) {
    let Ok(mut up) = TcpStream::connect(kms) else {
        write_response(client, 502, r#"{"error":"upstream down"}"#, false);
        return;
    };
    let mut out = format!("{} {} HTTP/1.1\r\nHost: {kms}\r\nConnection: close\r\n", req.method, req.target);
    for (k, v) in &req.headers {
        let lk = k.to_ascii_lowercase();
        if lk == "host" || lk == "connection" || lk == "x-datapipe-task-type" {
            continue;
        }
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&req.body);
    let _ = up.write_all(&bytes);
    let mut resp = Vec::new();
    let _ = up.read_to_end(&mut resp);
    let _ = client.write_all(&resp);
}

/// A unix socket that accepts connections and never answers (for timeouts). Connections are
/// kept open until the listener is dropped with the returned guard.
pub struct SilentSocket {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
    _listener: UnixListener,
}

impl SilentSocket {
    /// Waits for the next connection (a request is then in flight) and keeps it open, unanswered.
    pub fn accept_one(&self) -> UnixStream {
        self._listener.accept().unwrap().0
    }
}

pub fn silent_socket() -> SilentSocket {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("silent.sock");
    let listener = UnixListener::bind(&path).unwrap();
    SilentSocket { path, _dir: dir, _listener: listener }
}

/// A path in a fresh temp dir where no socket exists.
pub fn missing_socket() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("none.sock");
    (dir, p)
}

pub fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}
