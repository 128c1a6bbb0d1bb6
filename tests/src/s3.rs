//! A real S3-compatible server on 127.0.0.1 for the object-storage tests:
//! `tests/support/s3_server.py` (moto's server with faults injected on request) run by the
//! venv's Python, killed when the handle drops. Shared by the workspace tests and
//! crates/io-object's own tests, which include this file by path.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A running server.
pub struct S3Server {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

/// Credentials the tests sign with (the server accepts any unless told to require one).
pub const ACCESS_KEY: &str = "AKIATURBOIOTEST";
/// The matching secret, which must never appear in an error message.
pub const SECRET_KEY: &str = "turboio-secret-Zq8uXk2pW9";

impl S3Server {
    /// Starts a server with the interpreter `python` (which must have moto installed).
    pub fn start(python: &Path) -> S3Server {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(S3Server::script_from_manifest());
        let mut child = Command::new(python)
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} {}: {e}", python.display(), script.display()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line).expect("server's first line");
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the S3 server did not start (it printed {line:?}); is moto installed?"));
        S3Server { child, port }
    }

    fn script_from_manifest() -> PathBuf {
        // The workspace tests' manifest is tests/Cargo.toml; the crates' are two levels deeper.
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        if here.join("support/s3_server.py").exists() {
            PathBuf::from("support/s3_server.py")
        } else {
            PathBuf::from("../../tests/support/s3_server.py")
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Options for turboio's object backend: this endpoint, a region, the test credentials,
    /// and short retry budgets so that fault tests end quickly.
    pub fn options(&self) -> Vec<(String, String)> {
        [
            ("endpoint", self.endpoint()),
            ("region", "us-east-1".to_owned()),
            ("access_key_id", ACCESS_KEY.to_owned()),
            ("secret_access_key", SECRET_KEY.to_owned()),
            ("retry_timeout", "5".to_owned()),
            ("max_retries", "3".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// One plain HTTP request to the server; returns the status and the body.
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect to the S3 server");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.port,
            body.len()
        );
        s.write_all(head.as_bytes()).and_then(|()| s.write_all(body)).expect("send");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("receive");
        let status = std::str::from_utf8(&out[..out.len().min(12)])
            .ok()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out.windows(4).position(|w| w == b"\r\n\r\n").map_or(Vec::new(), |p| out[p + 4..].to_vec());
        (status, body)
    }

    /// Creates a bucket.
    pub fn create_bucket(&self, name: &str) {
        let (status, body) = self.request("PUT", &format!("/{name}"), b"");
        assert_eq!(status, 200, "create bucket {name}: {}", String::from_utf8_lossy(&body));
    }

    /// Sets the injected faults (a JSON object; see the script) and resets the counters.
    pub fn faults(&self, json: &str) {
        let (status, _) = self.request("POST", "/__faults", json.as_bytes());
        assert_eq!(status, 200, "setting faults");
    }

    /// The counters since the last [`faults`](Self::faults) call, as JSON text.
    pub fn stats(&self) -> String {
        String::from_utf8(self.request("GET", "/__stats", b"").1).expect("stats are JSON")
    }

    /// A counter from [`stats`](Self::stats).
    pub fn stat(&self, name: &str) -> u64 {
        let text = self.stats();
        let at = text.find(&format!("\"{name}\": ")).unwrap_or_else(|| panic!("no {name} in {text}"));
        text[at + name.len() + 4..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
    }

    /// Stops the server now (the handle stays, so a test can see what clients do then).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// nginx serving a directory on 127.0.0.1, for `http://` range reads (Debian's `nginx-light`;
/// `cargo xtask test` installs it). Stopped when dropped.
pub struct Nginx {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// The directory it serves.
    pub root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Nginx {
    /// Starts nginx, or `None` (after saying why) where it is not installed, unless
    /// `TURBOIO_REQUIRE_NGINX` is set, in which case that is a failure.
    pub fn start() -> Option<Nginx> {
        let bin = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists());
        let Some(bin) = bin else {
            assert!(
                std::env::var_os("TURBOIO_REQUIRE_NGINX").is_none(),
                "TURBOIO_REQUIRE_NGINX is set but nginx is not installed"
            );
            eprintln!("skipped: nginx is not installed (cargo xtask test installs Debian's nginx-light)");
            return None;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("www");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
        // A free port: bound and released (nginx binds it right after).
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let d = dir.path().display();
        let conf = format!(
            "daemon off; master_process off; pid {d}/nginx.pid; error_log {d}/error.log;\n\
             events {{ worker_connections 256; }}\n\
             http {{ access_log off; client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; \
             fastcgi_temp_path {d}/tmp; uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;\n\
             server {{ listen 127.0.0.1:{port}; root {}; sendfile on; }} }}\n",
            root.display()
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
        let child = Command::new(&bin)
            .arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-c")
            .arg(dir.path().join("nginx.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nginx");
        let mut n = Nginx { child, port, root, _dir: dir };
        // Ready once it accepts a connection (polled every 10 ms, for at most 5 s).
        for _ in 0..500 {
            if TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), std::time::Duration::from_millis(10)).is_ok()
            {
                return Some(n);
            }
            if let Ok(Some(status)) = n.child.try_wait() {
                panic!("nginx exited at start ({status}); see its error.log");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        n.stop();
        panic!("nginx did not start listening on 127.0.0.1:{port}");
    }

    /// `http://127.0.0.1:PORT/NAME`.
    pub fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.stop();
    }
}
