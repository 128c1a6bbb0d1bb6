//! The table `turboio inspect` prints, line by line (a library function so that the fuzz
//! target `crates/turboio/fuzz` and the tests can drive it with any header the parser accepts).

use crate::Header;
use std::path::Path;

/// Name columns wider than this are not padded: a longer name (the format allows names of any
/// length) overflows its column instead of widening every line of the table.
pub const MAX_NAME_WIDTH: usize = 64;

/// A byte count for people: `4.29 GB`, `4.19 MB`, `361.3 kB`, `12 bytes`.
pub fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} bytes")
    }
}

fn pad(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n >= width {
        s.to_owned()
    } else {
        format!("{s}{}", " ".repeat(width - n))
    }
}

/// Writes the table of a file's header (tensor counts and bytes by dtype, metadata, one line
/// per tensor), one line at a time through `line`; stops at the first error `line` returns.
pub fn table<E>(file: &Path, header: &Header, line: &mut dyn FnMut(&str) -> Result<(), E>) -> Result<(), E> {
    line(&turboio_storage::shown(file).to_string())?;
    line(&format!(
        "  {} tensors, {} of data, header {} bytes, file {} bytes",
        header.len(),
        human_bytes(header.data_len()),
        header.header_len(),
        header.file_len()
    ))?;
    let mut by_dtype: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
    for t in header.tensors() {
        let e = by_dtype.entry(t.dtype.name()).or_default();
        e.0 += 1;
        e.1 += t.len() as u64;
    }
    for (d, (n, b)) in &by_dtype {
        line(&format!("  {d:>12}: {n:>6} tensors, {b:>14} bytes"))?;
    }
    if let Some(meta) = header.metadata() {
        line("  metadata:")?;
        for (k, v) in meta {
            line(&format!("    {k}: {v}"))?;
        }
    }
    let width = header.tensors().iter().map(|t| t.name.chars().count()).max().unwrap_or(0).clamp(4, MAX_NAME_WIDTH);
    line(&format!("  {}  {:>11}  {:<24}  {:>14}", pad("name", width), "dtype", "shape", "bytes"))?;
    for t in header.tensors() {
        let shape = format!("{:?}", t.shape);
        line(&format!("  {}  {:>11}  {:<24}  {:>14}", pad(&t.name, width), t.dtype.name(), shape, t.len()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(json: &str, data_len: u64) -> Header {
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        Header::parse(&file, file.len() as u64 + data_len).unwrap()
    }

    fn lines(h: &Header) -> Vec<String> {
        let mut out = Vec::new();
        table::<()>(Path::new("f.safetensors"), h, &mut |l| {
            out.push(l.to_owned());
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn names_of_any_length_print() {
        for n in [0, 1, 63, 64, 65, 70_000] {
            let name = "é".repeat(n);
            let h = header(&format!(r#"{{"{name}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}}}"#), 0);
            let out = lines(&h);
            assert!(out.last().unwrap().contains(&name), "{n}");
        }
    }

    #[test]
    fn columns_line_up_for_short_names() {
        let h = header(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"bbbbbbbb":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#,
            6,
        );
        let out = lines(&h);
        let n = out.len();
        let shape_at: Vec<Option<usize>> =
            out[n - 3..].iter().map(|l| l.find("shape").or_else(|| l.find('['))).collect();
        assert_eq!(shape_at[0], shape_at[1], "{out:?}");
        assert_eq!(shape_at[1], shape_at[2], "{out:?}");
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(12), "12 bytes");
        assert_eq!(human_bytes(361_300), "361.3 kB");
        assert_eq!(human_bytes(4_194_304), "4.19 MB");
        assert_eq!(human_bytes(4_294_967_296), "4.29 GB");
    }
}
