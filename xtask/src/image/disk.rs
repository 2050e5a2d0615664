//! The bootable disk, made without mounting anything (no loop devices, so it also builds where those are
//! missing, e.g. in CI containers):
//!
//! - a GPT written into a sparse file by `sfdisk`: BIOS boot partition (GRUB's core image), EFI system
//!   partition, root partition last (cloud-init's growpart grows it to the flavor's disk);
//! - the root filesystem by `mkfs.ext4 -d` from a hard-linked copy of the cached root directory plus the agent,
//!   written straight into the disk file at the partition's offset (`-E offset=`);
//! - the ESP by `mkfs.vfat --offset` and filled with `mcopy`;
//! - GRUB for both firmware types, built with `grub-mkimage` from Debian's grub-pc-bin/grub-efi-amd64-bin
//!   with `image/grub/early.cfg` embedded: it finds the root filesystem by UUID and reads
//!   `/boot/grub/grub.cfg` there, which boots `/vmlinuz` (the kernel package keeps that symlink current, so a
//!   kernel upgrade on the VM needs no bootloader step). UEFI firmware starts `\EFI\BOOT\BOOTX64.EFI` on the
//!   ESP; a BIOS starts the MBR boot code, which loads the core image from the BIOS boot partition.
//!
//! Why GRUB and not a unified kernel image for UEFI: the same configuration then serves BIOS (still the
//! default firmware of most OpenStack clouds) and UEFI, and kernel updates keep working. Why the BIOS boot
//! code is set up here and not by `grub-bios-setup`: that tool insists on resolving the block device of its
//! `--directory` on the build host (it fails on an image file unless that directory lives on a device GRUB
//! can open), so [`install_bios_boot`] does its three writes itself, for exactly this layout.

use super::rootfs::{remove_tree, Agent, Rootfs};
use super::{out_dir, recipe_dir};
use crate::util::{output, run};
use anyhow::{ensure, Context, Result};
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const SECTOR: u64 = 512;
/// BIOS boot partition: 1 MiB from 1 MiB (GRUB's core image is ~150 KiB).
const BIOS_START: u64 = 2048;
const BIOS_SECTORS: u64 = 2048;
/// EFI system partition: 64 MiB FAT32 (the UEFI spec wants FAT32; with 512-byte clusters 64 MiB has enough).
const ESP_START: u64 = BIOS_START + BIOS_SECTORS;
const ESP_SECTORS: u64 = 64 * 2048;
/// Root partition start, after the ESP.
const ROOT_START: u64 = ESP_START + ESP_SECTORS;
/// Room the secondary GPT needs at the end of the disk.
const GPT_BACKUP_SECTORS: u64 = 34;

/// GPT partition types.
const TYPE_BIOS_BOOT: &str = "21686148-6449-6E6F-744E-656564454649";
const TYPE_ESP: &str = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B";
/// "Linux root (x86-64)" of the Discoverable Partitions Specification.
const TYPE_ROOT_X86_64: &str = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709";

/// GRUB modules embedded in the core images (there is no module directory in the image: no grub package).
const GRUB_COMMON_MODULES: &[&str] = &[
    "part_gpt",
    "ext2",
    "search",
    "search_fs_uuid",
    "configfile",
    "normal",
    "linux",
    "boot",
    "echo",
    "test",
    "serial",
    "terminal",
];
const GRUB_BIOS_MODULES: &[&str] = &["biosdisk"];
const GRUB_EFI_MODULES: &[&str] = &["fat", "efi_gop", "all_video"];

/// What [`assemble`] made.
pub struct Disk {
    /// The image to upload.
    pub qcow2: PathBuf,
    /// Its size on disk.
    pub qcow2_bytes: u64,
    /// The disk size a VM sees before growpart.
    pub virtual_bytes: u64,
    /// MiB used in the root filesystem.
    pub used_mib: u64,
    /// Kernel release in the image.
    pub kernel: String,
    /// Time spent on this stage.
    pub seconds: f64,
}

/// Builds `target/image/lb-vm.qcow2` from the root filesystem and the agent.
pub fn assemble(rootfs: &Rootfs, agent: &Agent, keep_raw: bool) -> Result<Disk> {
    let t = Instant::now();
    let work = out_dir().join("work");
    remove_tree(&work)?;
    std::fs::create_dir_all(&work)?;
    let staging = work.join("root");
    // Hard links: instant and free. Only new files may be written into the copy, never existing ones.
    run(
        Command::new("cp").arg("-al").arg(&rootfs.dir).arg(&staging),
        "copying the root filesystem (hard links)",
    )?;
    install_agent(&staging, &agent.path)?;
    let kernel = kernel_release(&staging)?;

    let used_mib: u64 = output(
        Command::new("du")
            .args(["-s", "-x", "--block-size=1M"])
            .arg(&staging),
        "measuring the root filesystem",
    )?
    .split_whitespace()
    .next()
    .context("du printed nothing")?
    .parse()?;
    // Room for ext4's metadata and the first boot's writes; growpart makes it the flavor's disk size anyway.
    let root_mib = (used_mib * 5 / 4 + 256).div_ceil(64) * 64;
    let root_sectors = root_mib * 2048;
    let total_sectors = (ROOT_START + root_sectors + GPT_BACKUP_SECTORS).div_ceil(2048) * 2048;
    let raw = out_dir().join("lb-vm.raw");
    let _ = std::fs::remove_file(&raw);
    std::fs::File::create(&raw)?.set_len(total_sectors * SECTOR)?;

    partition(&raw, root_sectors)?;
    make_esp(&raw, &work, &rootfs.root_uuid)?;
    make_root(&raw, &staging, &rootfs.root_uuid, root_sectors)?;
    let core = grub_image(&work, "i386-pc", GRUB_BIOS_MODULES, &rootfs.root_uuid)?;
    install_bios_boot(&raw, &std::fs::read(core)?, BIOS_START, BIOS_SECTORS)?;
    remove_tree(&work)?;

    let qcow2 = super::image_path();
    let tmp = qcow2.with_extension("qcow2.tmp");
    // Compressed (zlib, readable by every qemu-img a cloud may run): about half the upload.
    run(
        Command::new("qemu-img")
            .args([
                "convert",
                "-q",
                "-c",
                "-f",
                "raw",
                "-O",
                "qcow2",
                "-o",
                "compat=1.1",
            ])
            .arg(&raw)
            .arg(&tmp),
        "converting the disk to qcow2",
    )?;
    std::fs::rename(&tmp, &qcow2)?;
    if !keep_raw {
        std::fs::remove_file(&raw)?;
    }
    let lock = out_dir().join("cache/packages.lock");
    if lock.exists() {
        std::fs::copy(&lock, out_dir().join("lb-vm.packages"))?;
    }
    Ok(Disk {
        qcow2_bytes: std::fs::metadata(&qcow2)?.len(),
        qcow2,
        virtual_bytes: total_sectors * SECTOR,
        used_mib,
        kernel,
        seconds: t.elapsed().as_secs_f64(),
    })
}

/// Puts the stripped agent at /usr/local/bin/lb-agent and runs it once in the image (`--version`): it must
/// work with the image's C library.
fn install_agent(staging: &Path, agent: &Path) -> Result<()> {
    let dest = staging.join("usr/local/bin/lb-agent");
    // A new file (never a write through a hard link into the cache).
    let _ = std::fs::remove_file(&dest);
    run(
        Command::new("strip")
            .arg("--strip-unneeded")
            .arg("-o")
            .arg(&dest)
            .arg(agent),
        "stripping lb-agent into the image",
    )?;
    set_mode(&dest, 0o755)?;
    let version = output(
        Command::new("chroot")
            .arg(staging)
            .args(["/usr/local/bin/lb-agent", "--version"]),
        "running lb-agent --version inside the image (a C library mismatch would show here)",
    )?;
    eprintln!("image: {} in the image", version.trim());
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// The release of the kernel /vmlinuz points at.
fn kernel_release(staging: &Path) -> Result<String> {
    let link = std::fs::read_link(staging.join("vmlinuz")).context("the image has no /vmlinuz")?;
    let name = link.file_name().unwrap_or_default().to_string_lossy();
    Ok(name.trim_start_matches("vmlinuz-").to_string())
}

fn partition(raw: &Path, root_sectors: u64) -> Result<()> {
    let script = format!(
        "label: gpt\nunit: sectors\n\
         start={BIOS_START}, size={BIOS_SECTORS}, type={TYPE_BIOS_BOOT}, name=\"bios-boot\"\n\
         start={ESP_START}, size={ESP_SECTORS}, type={TYPE_ESP}, name=\"esp\"\n\
         start={ROOT_START}, size={root_sectors}, type={TYPE_ROOT_X86_64}, name=\"root\"\n"
    );
    let mut child = Command::new("sfdisk")
        .args(["--quiet", "--no-reread", "--no-tell-kernel"])
        .arg(raw)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("starting sfdisk")?;
    child
        .stdin
        .take()
        .context("sfdisk stdin")?
        .write_all(script.as_bytes())?;
    ensure!(
        child.wait()?.success(),
        "sfdisk failed to partition {}",
        raw.display()
    );
    Ok(())
}

fn make_esp(raw: &Path, work: &Path, root_uuid: &str) -> Result<()> {
    // Output only on failure: mkfs.vfat warns that the file is larger than the filesystem, which is the point.
    output(
        Command::new("mkfs.vfat")
            .args(["-F", "32", "-s", "1", "-n", "ESP", "--offset"])
            .arg(ESP_START.to_string())
            .arg(raw)
            .arg((ESP_SECTORS / 2).to_string()),
        "making the EFI system partition",
    )?;
    let efi = grub_image(work, "x86_64-efi", GRUB_EFI_MODULES, root_uuid)?;
    // mtools addresses the partition inside the image file as FILE@@OFFSET.
    let target = format!("{}@@{}", raw.display(), ESP_START * SECTOR);
    run(
        Command::new("mmd")
            .args(["-i", &target, "::/EFI", "::/EFI/BOOT"])
            .env("MTOOLS_SKIP_CHECK", "1"),
        "creating \\EFI\\BOOT on the ESP",
    )?;
    run(
        Command::new("mcopy")
            .args(["-i", &target])
            .arg(&efi)
            .arg("::/EFI/BOOT/BOOTX64.EFI")
            .env("MTOOLS_SKIP_CHECK", "1"),
        "copying GRUB onto the ESP",
    )
}

fn make_root(raw: &Path, staging: &Path, root_uuid: &str, root_sectors: u64) -> Result<()> {
    run(
        Command::new("mkfs.ext4")
            .args(["-F", "-q", "-L", "lb-root", "-U", root_uuid])
            // Features GRUB 2.06 (Debian 12) cannot read, whatever the build host's mke2fs.conf enables.
            .args(["-O", "^metadata_csum_seed,^orphan_file"])
            .arg("-E")
            .arg(format!("offset={}", ROOT_START * SECTOR))
            .arg("-d")
            .arg(staging)
            .arg(raw)
            .arg(format!("{}k", root_sectors / 2)),
        "making the root filesystem (mkfs.ext4 -d)",
    )
}

/// A GRUB core image for `format` with `image/grub/early.cfg` (root UUID filled in) embedded.
fn grub_image(work: &Path, format: &str, extra: &[&str], root_uuid: &str) -> Result<PathBuf> {
    let early = std::fs::read_to_string(recipe_dir().join("grub/early.cfg"))?;
    let cfg = work.join(format!("early-{format}.cfg"));
    std::fs::write(&cfg, early.replace("@ROOT_UUID@", root_uuid))?;
    let out = work.join(format!("grub-{format}.img"));
    run(
        Command::new("grub-mkimage")
            .args(["-O", format, "-p", "/boot/grub", "-c"])
            .arg(&cfg)
            .arg("-o")
            .arg(&out)
            .args(GRUB_COMMON_MODULES)
            .args(extra),
        &format!("grub-mkimage -O {format}"),
    )?;
    Ok(out)
}

/// Offsets in GRUB 2.06's boot.img (include/grub/i386/pc/boot.h).
const BOOT_BPB_START: usize = 0x3;
const BOOT_BPB_END: usize = 0x5a;
const BOOT_KERNEL_SECTOR: usize = 0x5c;
const BOOT_DRIVE_CHECK: usize = 0x66;
const BOOT_WINDOWS_NT_MAGIC: usize = 0x1b8;
/// The blocklist at the end of diskboot.img (the core image's first sector): start (u64), sectors (u16),
/// load segment (u16).
const DISKBOOT_BLOCKLIST: usize = 0x200 - 12;
const DISKBOOT_SEGMENT: u16 = 0x820;

/// What `grub-bios-setup` does for a GPT disk: the core image into the BIOS boot partition with its
/// blocklist pointing at the rest of itself, and GRUB's boot.img into the protective MBR (around the BIOS
/// parameter block, before the disk signature and partition table) pointing at the core image.
fn install_bios_boot(raw: &Path, core: &[u8], start: u64, max_sectors: u64) -> Result<()> {
    let boot = std::fs::read("/usr/lib/grub/i386-pc/boot.img")
        .context("reading GRUB's boot.img (package grub-pc-bin)")?;
    ensure!(boot.len() == 512, "boot.img is not one sector");
    let sectors = (core.len() as u64).div_ceil(SECTOR);
    ensure!(
        sectors > 1 && sectors <= max_sectors,
        "GRUB core image of {sectors} sectors does not fit the BIOS boot partition"
    );
    let mut core = core.to_vec();
    core.resize((sectors * SECTOR) as usize, 0);
    let bl = DISKBOOT_BLOCKLIST;
    ensure!(
        u16::from_le_bytes([core[bl + 10], core[bl + 11]]) == DISKBOOT_SEGMENT,
        "the core image does not start with GRUB 2.06's diskboot.img"
    );
    core[bl..bl + 8].copy_from_slice(&(start + 1).to_le_bytes());
    core[bl + 8..bl + 10].copy_from_slice(&u16::try_from(sectors - 1)?.to_le_bytes());

    let mut f = OpenOptions::new().read(true).write(true).open(raw)?;
    let mut mbr = [0u8; 512];
    f.read_exact(&mut mbr)?;
    mbr[..BOOT_BPB_START].copy_from_slice(&boot[..BOOT_BPB_START]);
    mbr[BOOT_BPB_END..BOOT_WINDOWS_NT_MAGIC]
        .copy_from_slice(&boot[BOOT_BPB_END..BOOT_WINDOWS_NT_MAGIC]);
    mbr[BOOT_KERNEL_SECTOR..BOOT_KERNEL_SECTOR + 8].copy_from_slice(&start.to_le_bytes());
    // As grub-bios-setup does for hard disks: NOP the jump over the boot-drive check, for BIOSes that pass
    // a wrong drive number in DL.
    mbr[BOOT_DRIVE_CHECK..BOOT_DRIVE_CHECK + 2].copy_from_slice(&[0x90, 0x90]);
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&mbr)?;
    f.seek(SeekFrom::Start(start * SECTOR))?;
    f.write_all(&core)?;
    f.sync_all()?;
    Ok(())
}
