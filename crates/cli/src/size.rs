//! Byte sizes on the command line.

/// Parses `4GiB`, `512MiB`, `100MB`, `1G`, `123456`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("size `{s}` is negative; give a positive size such as 4GiB, 512MiB or 100MB"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("invalid size `{s}` (try 4GiB, 512MiB, 100MB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => return Err(format!("invalid size unit `{other}` in `{s}` (try GiB, MiB, GB, MB)")),
    };
    let bytes = value * mult as f64;
    if !(1.0..1e15).contains(&bytes) {
        return Err(format!("size `{s}` is out of range"));
    }
    Ok(bytes as u64)
}

/// `4GiB`-style spelling for file names.
pub fn format_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("100MB").unwrap(), 100_000_000);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("4 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("-1GiB").unwrap_err().contains("negative"));
        assert_eq!(format_size(4 << 30), "4GiB");
        assert_eq!(format_size(3 << 20), "3MiB");
        assert_eq!(format_size(1000), "1000B");
    }
}
