//! SVG charts of a bench run's tables (plotters' SVG backend, no fonts needed): one horizontal
//! bar chart of GB/s per table (file size, loader group, page-cache state), written beside
//! `load.md` by `cargo xtask bench`, or from a saved `load.json` by `cargo xtask chart`.

use anyhow::{Context, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// One table of a run: its title and each loader's GB/s (skipped loaders left out).
pub struct Table {
    pub title: String,
    pub file: String,
    pub bars: Vec<(String, f64)>,
}

/// The tables of a `load.json` (the shape `bench::report_json` writes).
pub fn tables(json: &serde_json::Value) -> Vec<Table> {
    let mut out: Vec<Table> = Vec::new();
    let rows = json["rows"].as_array().cloned().unwrap_or_default();
    for r in &rows {
        if !r["skipped"].is_null() {
            continue;
        }
        let (Some(size), Some(cache), Some(group), Some(loader), Some(gbps)) = (
            r["size_bytes"].as_u64(),
            r["cache"].as_str(),
            r["group"].as_str(),
            r["loader"].as_str(),
            r["gb_per_s"].as_f64(),
        ) else {
            continue;
        };
        if !gbps.is_finite() {
            continue;
        }
        let kind = match group {
            "python" => "Python loaders",
            "gpu" => "into the GPU",
            "python, gpu" => "Python loaders into the GPU",
            "" => "Rust loaders",
            other => other,
        };
        let title = format!("{kind}, {:.2} GB file, {cache} page cache (GB/s, higher is better)", size as f64 / 1e9);
        let slug: String = format!("load-{}MB-{group}-{cache}", size / 1_000_000)
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
            .collect::<String>()
            .split('-')
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join("-");
        match out.iter_mut().find(|t| t.title == title) {
            Some(t) => t.bars.push((loader.to_owned(), gbps)),
            None => out.push(Table { title, file: format!("{slug}.svg"), bars: vec![(loader.to_owned(), gbps)] }),
        }
    }
    out
}

/// Writes one chart per table into `dir`; returns their paths.
pub fn write(tables: &[Table], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    for t in tables.iter().filter(|t| !t.bars.is_empty()) {
        let path = dir.join(&t.file);
        draw(t, &path).with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn draw(t: &Table, path: &Path) -> Result<()> {
    let n = t.bars.len();
    let height = 86 + 26 * n as u32;
    let root = SVGBackend::new(path, (860, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let max = t.bars.iter().map(|b| b.1).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(&t.title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(270)
        .build_cartesian_2d(0.0..max, (0..n).into_segmented())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let names: Vec<String> = t.bars.iter().map(|b| b.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .x_desc("GB/s")
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .draw_series(t.bars.iter().enumerate().map(|(i, (name, v))| {
            let color = if name.starts_with("turboio") { RGBColor(31, 119, 180) } else { RGBColor(160, 160, 160) };
            Rectangle::new([(0.0, SegmentValue::Exact(i)), (*v, SegmentValue::Exact(i + 1))], color.filled())
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .draw_series(
            t.bars
                .iter()
                .enumerate()
                .map(|(i, (_, v))| Text::new(format!("{v:.2}"), (*v, SegmentValue::CenterOf(i)), ("sans-serif", 12))),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_run_becomes_one_chart_per_table() {
        let json = serde_json::json!({"rows": [
            {"size_bytes": 1_073_741_824u64, "cache": "hot", "group": "", "loader": "turboio mapped", "gb_per_s": 40.0, "skipped": null},
            {"size_bytes": 1_073_741_824u64, "cache": "hot", "group": "", "loader": "std::fs::read", "gb_per_s": 2.0, "skipped": null},
            {"size_bytes": 1_073_741_824u64, "cache": "cold", "group": "python", "loader": "turboio.load", "gb_per_s": 1.2, "skipped": null},
            {"size_bytes": 1_073_741_824u64, "cache": "cold", "group": "python", "loader": "gone", "gb_per_s": null, "skipped": "why"},
        ]});
        let tables = super::tables(&json);
        assert_eq!(tables.len(), 2);
        assert_eq!(tables[0].bars.len(), 2);
        assert_eq!(tables[1].file, "load-1073MB-python-cold.svg");
        let d = tempfile::tempdir().unwrap();
        let written = super::write(&tables, d.path()).unwrap();
        let svg = std::fs::read_to_string(&written[0]).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("turboio mapped") && svg.contains("40.00"), "{svg}");
    }
}
