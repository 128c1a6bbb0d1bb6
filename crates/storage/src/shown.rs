//! How a path or URL appears in errors and messages.

use std::fmt;
use std::path::Path;

/// `path` as errors and messages show it: a URL without its user info (`user:password@`) and
/// without its query string or fragment (presigned URLs carry credentials and signatures
/// there); a local path as [`Path::display`] shows it. Every error of this crate and of the
/// orchestrator names its file through this, so no backend can leak a URL's secrets by naming
/// it.
pub fn shown(path: &Path) -> Shown<'_> {
    Shown(path)
}

/// See [`shown`].
pub struct Shown<'a>(&'a Path);

/// The length of `s`'s `scheme://` prefix when `s` is a URL.
fn scheme_len(s: &str) -> Option<usize> {
    let i = s.find("://")?;
    let scheme = &s[..i];
    let ok = scheme.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    ok.then_some(i + 3)
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0.to_string_lossy();
        let Some(start) = scheme_len(&text) else { return write!(f, "{}", self.0.display()) };
        let (scheme, rest) = text.split_at(start);
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let host = match authority.rfind('@') {
            Some(at) => {
                f.write_str(scheme)?;
                f.write_str("***@")?;
                &authority[at + 1..]
            }
            None => {
                f.write_str(scheme)?;
                authority
            }
        };
        f.write_str(host)?;
        match tail.find(['?', '#']) {
            Some(cut) => write!(f, "{}?<redacted>", &tail[..cut]),
            None => f.write_str(tail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::shown;
    use std::path::Path;

    fn s(p: &str) -> String {
        shown(Path::new(p)).to_string()
    }

    #[test]
    fn urls_lose_their_user_info_and_query_and_paths_are_kept() {
        assert_eq!(s("/data/a?b@c.safetensors"), "/data/a?b@c.safetensors");
        assert_eq!(s("relative/x"), "relative/x");
        assert_eq!(s("s3://bucket/k/model.safetensors"), "s3://bucket/k/model.safetensors");
        assert_eq!(
            s("https://b.s3.amazonaws.com/m.safetensors?X-Amz-Credential=AKIA&X-Amz-Signature=abc"),
            "https://b.s3.amazonaws.com/m.safetensors?<redacted>"
        );
        assert_eq!(s("http://user:pa%40ss@host:8080/a/b"), "http://***@host:8080/a/b");
        assert_eq!(s("http://user:pw@host?q=1"), "http://***@host?<redacted>");
        assert_eq!(s("http://host/a#frag"), "http://host/a?<redacted>");
        assert_eq!(s("http://host/a/b@c"), "http://host/a/b@c");
    }
}
