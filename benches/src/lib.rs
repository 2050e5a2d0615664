//! Shared pieces of the benchmarks: result tables and JSON output.

use serde::Serialize;
use std::path::{Path, PathBuf};

/// Where benchmark JSON goes: `target/bench/<name>.json` under the workspace root.
pub fn json_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("bench")
        .join(format!("{name}.json"))
}

/// Writes a benchmark's results as pretty JSON and says where.
pub fn write_json<T: Serialize>(name: &str, value: &T) -> anyhow::Result<PathBuf> {
    let path = json_path(name);
    std::fs::create_dir_all(path.parent().unwrap())?;
    std::fs::write(&path, serde_json::to_string_pretty(value)?)?;
    Ok(path)
}

/// Median of a non-empty sample.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}
