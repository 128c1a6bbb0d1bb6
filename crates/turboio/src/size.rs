//! Sizes written by people: `"5GB"`, `"500MB"`, `"2GiB"` or a byte count. The lowest layer of
//! the crate: it uses nothing else of it.

/// Parses a size (a shard size, a coalescing gap): a number of bytes, or with a unit (`"5GB"`, `"500MB"`, `"2GiB"`, as
/// `transformers`' `max_shard_size` takes them: KB/MB/GB are powers of 10, KiB/MiB/GiB of 2).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid size {s:?}: expected e.g. 5GB, 500MB or a byte count"))?;
    let mult: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        "TIB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(format!("invalid size {s:?}: unknown unit {unit:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    };
    let v = n * mult;
    if !(1.0..1.8e19).contains(&v) {
        return Err(format!("invalid size {s:?}: must be at least one byte"));
    }
    Ok(v as u64)
}
