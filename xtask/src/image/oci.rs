//! An OCI image layout (image-spec v1.1) written directly: one root-filesystem layer made with GNU tar and gzip, its
//! config, manifest and index as JSON, every blob named by its sha256 (coreutils).
//!
//! Why not umoci/buildah: both build from an unpacked root filesystem just the same, but stamp the files' and the
//! config's times with "now", so the same binary never gives the same digest; buildah also wants a storage
//! configuration on the machine. Here the layer is a sorted tar with fixed owners and one fixed time, gzip without
//! a name or time (`-n`), so the digest depends on the content only, and the whole writer is the JSON below. The
//! image is checked by a real consumer: podman pulls it from the layout (digests, media types, config) and runs it
//! in the controller-image stage.

use super::rootfs::sha256;
use crate::util::run;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// What goes into the image besides its root filesystem.
pub struct ImageConfig {
    /// `Entrypoint` of the config.
    pub entrypoint: Vec<String>,
    /// `User` (`uid:gid`).
    pub user: String,
    pub env: Vec<String>,
    pub exposed_ports: Vec<u16>,
    /// `org.opencontainers.image.*` (and any other) labels; also the manifest's annotations.
    pub labels: BTreeMap<String, String>,
    /// The `created` time (RFC 3339) and the files' mtime (seconds since the epoch): one source time, so a rebuild
    /// of the same content is the same image.
    pub created: String,
    pub epoch: i64,
    /// The tag (`org.opencontainers.image.ref.name` in the index): `oci:<layout>:<tag>`.
    pub tag: String,
}

/// The written layout.
pub struct Written {
    pub manifest_digest: String,
    /// Compressed layer bytes (what a registry stores and a node pulls).
    pub layer_bytes: u64,
    /// Uncompressed layer bytes (what the image takes on a node's disk).
    pub rootfs_bytes: u64,
}

/// Writes the layout of an image whose single layer is `rootfs` (a directory, owners and modes as they should be in
/// the image) into `layout` (replaced).
pub fn write_layout(rootfs: &Path, config: &ImageConfig, layout: &Path) -> Result<Written> {
    if layout.exists() {
        std::fs::remove_dir_all(layout)
            .with_context(|| format!("removing {}", layout.display()))?;
    }
    let blobs = layout.join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs)?;

    let tar = layout.join("layer.tar");
    deterministic_tar(rootfs, &tar, config.epoch)?;
    let tar_bytes = std::fs::read(&tar).context("reading the layer tar")?;
    let diff_id = sha256(&tar_bytes)?;
    let gz = gzip(&tar)?;
    std::fs::remove_file(&tar)?;
    let layer = blob(&blobs, LAYER, gz)?;

    let labels = json!(config.labels);
    let image_config = json!({
        "created": config.created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": config.user,
            "Entrypoint": config.entrypoint,
            "Env": config.env,
            "ExposedPorts": config.exposed_ports.iter()
                .map(|p| (format!("{p}/tcp"), json!({})))
                .collect::<serde_json::Map<_, _>>(),
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
        "history": [{"created": config.created, "created_by": "cargo xtask image controller"}],
    });
    let image_config = blob(&blobs, CONFIG, serde_json::to_vec(&image_config)?)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": image_config,
        "layers": [layer],
        "annotations": labels,
    });
    let manifest = blob(&blobs, MANIFEST, serde_json::to_vec(&manifest)?)?;
    let mut in_index = manifest.clone();
    in_index["annotations"] = json!({"org.opencontainers.image.ref.name": config.tag});
    let index = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [in_index]});
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec_pretty(&index)?,
    )?;
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    Ok(Written {
        manifest_digest: manifest["digest"].as_str().unwrap_or_default().to_owned(),
        layer_bytes: layer["size"].as_u64().unwrap_or_default(),
        rootfs_bytes: tar_bytes.len() as u64,
    })
}

/// Packs the layout into one file (an `oci-archive`, what `podman load -i` and `skopeo copy oci-archive:` take).
pub fn archive(layout: &Path, out: &Path, epoch: i64) -> Result<()> {
    deterministic_tar(layout, out, epoch)
}

/// Stores `data` as a blob and returns its descriptor.
fn blob(dir: &Path, media_type: &str, data: Vec<u8>) -> Result<Value> {
    let digest = sha256(&data)?;
    std::fs::write(dir.join(&digest), &data)?;
    Ok(json!({"mediaType": media_type, "digest": format!("sha256:{digest}"), "size": data.len()}))
}

/// A tar of everything in `dir` (paths relative to it, no `./`), sorted, numeric owners as on disk, every mtime
/// `epoch`, POSIX format without access and change times: the same tree always gives the same bytes.
fn deterministic_tar(dir: &Path, out: &Path, epoch: i64) -> Result<()> {
    let mut top: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| PathBuf::from(e.file_name())))
        .collect::<std::io::Result<_>>()?;
    top.sort();
    run(
        Command::new("tar")
            .arg("--create")
            .arg("--file")
            .arg(out)
            .arg("--directory")
            .arg(dir)
            .args(["--sort=name", "--numeric-owner", "--format=posix"])
            .arg(format!("--mtime=@{epoch}"))
            .arg("--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime")
            .args(&top),
        "tar of the image layer",
    )
}

/// `gzip -n` (no name, no time in the header) of `file`, returned as bytes.
fn gzip(file: &Path) -> Result<Vec<u8>> {
    let out = Command::new("gzip")
        .args(["-n", "-6", "-c"])
        .arg(file)
        .output()
        .context("starting gzip")?;
    anyhow::ensure!(
        out.status.success(),
        "gzip failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}
