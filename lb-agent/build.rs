//! Embeds the data-plane object built by `cargo xtask build-ebpf` (`target/bpf/lb.o`). When it has not been
//! built, an empty placeholder is embedded and `Dataplane::load` says what to run, so the rest of the
//! workspace still builds and lints.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let obj = manifest.join("../target/bpf/lb.o");
    println!("cargo:rerun-if-changed={}", obj.display());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("lb.o");
    let bytes = std::fs::read(&obj).unwrap_or_default();
    if bytes.is_empty() {
        println!("cargo:warning=target/bpf/lb.o not found: run `cargo xtask build-ebpf` to embed the data plane");
    }
    if std::fs::read(&out).ok() != Some(bytes.clone()) {
        std::fs::write(&out, bytes).unwrap();
    }
}
