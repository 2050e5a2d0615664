//! Ad-hoc debug access, as yawollet gives it (yawol `helper.EnableAdHocDebugging`): when the LoadBalancer carries
//! `yawol.stackit.cloud/adHocDebug: "true"` and an SSH public key in `yawol.stackit.cloud/adHocDebugSSHKey`, the
//! key goes into the debug user's `authorized_keys` and sshd is started; the security group opens TCP/22 for it
//! (the controllers' part). Unlike yawollet, the key is removed again — and sshd stopped, unless the LoadBalancer's
//! `debugSettings` keep it on — when the annotation goes, also when that happened while the agent was down.
//!
//! The debug user is the image's (`yawoldebug`, as in yawol's image: sudo, an empty `authorized_keys`, no
//! password). Keys: yawol accepts `ssh-rsa <base64>` only; this also takes Ed25519 and ECDSA keys and a comment —
//! one line, so nothing (options, a second key) can be smuggled in. [`wanted`] is the rule, pure and tested;
//! [`AdHocDebug`] applies it and says what happened as Events.

use super::events::{event_reasons, MachineEvent};
use lb_api::constants::lb_annotations::{AD_HOC_DEBUG, AD_HOC_DEBUG_SSH_KEY};
use lb_api::LoadBalancer;
use std::path::PathBuf;

/// The image's debug user (yawol's name).
pub const DEFAULT_USER: &str = "yawoldebug";

/// Where the key goes and how sshd is started and stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdHocDebugSettings {
    /// The debug user (for messages).
    pub user: String,
    /// Its `authorized_keys`; must exist (the image creates it empty, owned by the user, mode 0600): the agent only
    /// rewrites its content.
    pub authorized_keys: PathBuf,
    /// Starts sshd.
    pub start_sshd: Vec<String>,
    /// Stops sshd.
    pub stop_sshd: Vec<String>,
}

impl AdHocDebugSettings {
    /// `user`'s `~/.ssh/authorized_keys` under /home, sshd as Debian's `ssh.service`.
    pub fn for_user(user: &str) -> Self {
        AdHocDebugSettings {
            user: user.to_string(),
            authorized_keys: PathBuf::from(format!("/home/{user}/.ssh/authorized_keys")),
            start_sshd: ["systemctl", "start", "ssh.service"]
                .map(String::from)
                .to_vec(),
            stop_sshd: ["systemctl", "stop", "ssh.service"]
                .map(String::from)
                .to_vec(),
        }
    }
}

/// What the LoadBalancer asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Wanted {
    /// No ad-hoc access (annotation absent, false, or no key).
    Off,
    /// This key line.
    On(String),
    /// Asked for but refused, and why.
    Refused(String),
}

/// yawol's rule: the annotation parses as true (Go's `strconv.ParseBool`) and a key is set; refused when the
/// LoadBalancer's `debugSettings` are on anyway or the key is not a single public key.
pub fn wanted(lb: &LoadBalancer) -> Wanted {
    let ann = lb.metadata.annotations.as_ref();
    let enabled = ann
        .and_then(|a| a.get(AD_HOC_DEBUG))
        .is_some_and(|v| matches!(v.as_str(), "1" | "t" | "T" | "true" | "TRUE" | "True"));
    let Some(key) = ann.and_then(|a| a.get(AD_HOC_DEBUG_SSH_KEY)) else {
        return Wanted::Off;
    };
    if !enabled {
        return Wanted::Off;
    }
    if lb.spec.debug_settings().enabled {
        return Wanted::Refused(
            "Ad-hoc debugging will not be enabled because normal debug is already enabled".into(),
        );
    }
    match public_key_line(key) {
        Some(line) => Wanted::On(line),
        None => Wanted::Refused(
            "Ad-hoc debugging will not be enabled because ssh key is not valid (one line: ssh-rsa, ssh-ed25519 or \
             ecdsa-sha2-nistp256/384/521, the base64 key, an optional comment)"
                .into(),
        ),
    }
}

/// The key as one `authorized_keys` line, if it is `TYPE BASE64 [COMMENT]` with a known type, a base64 blob and a
/// comment of printable characters.
fn public_key_line(key: &str) -> Option<String> {
    const TYPES: &[&str] = &[
        "ssh-rsa",
        "ssh-ed25519",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
    ];
    let key = key.trim();
    let mut parts = key.splitn(3, [' ', '\t']);
    let kind = parts.next()?;
    let blob = parts.next()?;
    let comment = parts.next().map(str::trim).unwrap_or("");
    let blob_ok = !blob.is_empty()
        && blob
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b));
    let comment_ok = comment.chars().all(|c| !c.is_control());
    (TYPES.contains(&kind) && blob_ok && comment_ok).then(|| {
        if comment.is_empty() {
            format!("{kind} {blob}")
        } else {
            format!("{kind} {blob} {comment}")
        }
    })
}

/// Applies [`wanted`] on the machine: installs or removes the key, starts or stops sshd.
pub struct AdHocDebug {
    settings: AdHocDebugSettings,
    machine: String,
    /// What is in effect; `None` at start (the key file may hold a key from before the agent's restart) and after
    /// a failure (tried again on the next LoadBalancer event).
    applied: Option<Wanted>,
    /// The last failure reported, so a repeated one makes no new Event.
    last_failure: Option<String>,
}

impl AdHocDebug {
    /// For the LoadBalancerMachine `machine` (named in messages).
    pub fn new(settings: AdHocDebugSettings, machine: &str) -> Self {
        AdHocDebug {
            settings,
            machine: machine.to_string(),
            applied: None,
            last_failure: None,
        }
    }

    /// Brings the machine in line with `lb`; returns the Events to write.
    pub async fn reconcile(&mut self, lb: &LoadBalancer) -> Vec<MachineEvent> {
        let want = wanted(lb);
        if self.applied.as_ref() == Some(&want) {
            return Vec::new();
        }
        let keep_sshd = lb.spec.debug_settings().enabled;
        let mut events = Vec::new();
        let result = match &want {
            Wanted::On(key) => self.install(key).await.map(|()| {
                events.push(MachineEvent {
                    warning: true,
                    reason: event_reasons::AD_HOC_DEBUG_ENABLED,
                    message: format!(
                        "Successfully enabled ad-hoc debugging access to LoadBalancerMachine '{}' (user {}). Remove \
                         the annotation {AD_HOC_DEBUG} when you are finished: the key is removed and sshd stopped then",
                        self.machine, self.settings.user
                    ),
                });
            }),
            Wanted::Off | Wanted::Refused(_) => self.remove(keep_sshd).await.map(|removed| {
                if removed {
                    events.push(MachineEvent {
                        warning: false,
                        reason: event_reasons::AD_HOC_DEBUG_DISABLED,
                        message: format!(
                            "Ad-hoc debugging disabled: the key was removed from {}{}",
                            self.settings.authorized_keys.display(),
                            if keep_sshd { "" } else { " and sshd stopped" }
                        ),
                    });
                }
                if let Wanted::Refused(why) = &want {
                    events.push(MachineEvent {
                        warning: true,
                        reason: event_reasons::AD_HOC_DEBUG_NOT_ENABLED,
                        message: why.clone(),
                    });
                }
            }),
        };
        match result {
            Ok(()) => {
                self.applied = Some(want);
                self.last_failure = None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "ad-hoc debug access");
                self.applied = None;
                if self.last_failure.as_ref() != Some(&e) {
                    events.push(MachineEvent {
                        warning: true,
                        reason: event_reasons::AD_HOC_DEBUG_NOT_ENABLED,
                        message: e.clone(),
                    });
                }
                self.last_failure = Some(e);
            }
        }
        events
    }

    async fn install(&self, key: &str) -> Result<(), String> {
        let path = &self.settings.authorized_keys;
        if !path.is_file() {
            return Err(format!(
                "Ad-hoc debugging cannot be enabled: {} does not exist (this image has no debug user {})",
                path.display(),
                self.settings.user
            ));
        }
        write_keys(path, &format!("{key}\n")).map_err(|e| {
            format!(
                "Ad-hoc debugging cannot be enabled because authorized_keys cannot be written: {e}"
            )
        })?;
        tracing::info!(user = %self.settings.user, "ad-hoc debug key installed; starting sshd");
        run(&self.settings.start_sshd).await.map_err(|e| {
            format!("Ad-hoc debugging cannot be enabled because ssh cannot be started: {e}")
        })
    }

    /// Empties the key file (and stops sshd unless `keep_sshd`) if it holds a key; whether it did.
    async fn remove(&self, keep_sshd: bool) -> Result<bool, String> {
        let path = &self.settings.authorized_keys;
        let had_key = std::fs::read_to_string(path).is_ok_and(|s| !s.trim().is_empty());
        if !had_key {
            return Ok(false);
        }
        write_keys(path, "").map_err(|e| format!("removing the ad-hoc debug key failed: {e}"))?;
        tracing::info!(user = %self.settings.user, "ad-hoc debug key removed");
        if !keep_sshd {
            run(&self.settings.stop_sshd)
                .await
                .map_err(|e| format!("stopping sshd after ad-hoc debugging failed: {e}"))?;
        }
        Ok(true)
    }
}

/// Replaces the content of an existing file (its owner and mode stay: sshd insists on them).
fn write_keys(path: &std::path::Path, content: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)?;
    f.write_all(content.as_bytes())?;
    f.sync_all()
}

async fn run(argv: &[String]) -> Result<(), String> {
    let (program, args) = argv.split_first().ok_or("no command")?;
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|e| format!("{}: {e}", argv.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} failed ({}): {}",
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEY: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/=";

    fn lb(annotations: serde_json::Value, debug: bool) -> LoadBalancer {
        serde_json::from_value(json!({
            "apiVersion": lb_api::constants::API_VERSION, "kind": "LoadBalancer",
            "metadata": {"name": "lb", "namespace": "ns", "annotations": annotations},
            "spec": {
                "selector": {},
                "debugSettings": {"enabled": debug},
                "infrastructure": {
                    "defaultNetwork": {"networkID": "net"},
                    "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                    "availabilityZone": "az", "authSecretRef": {"name": "s", "namespace": "ns"}
                }
            }
        }))
        .unwrap()
    }

    fn on(key: &str) -> serde_json::Value {
        json!({AD_HOC_DEBUG: "true", AD_HOC_DEBUG_SSH_KEY: key})
    }

    #[test]
    fn yawols_rule() {
        assert_eq!(wanted(&lb(on(KEY), false)), Wanted::On(KEY.into()));
        for yes in ["1", "t", "T", "TRUE", "True"] {
            let a = json!({AD_HOC_DEBUG: yes, AD_HOC_DEBUG_SSH_KEY: KEY});
            assert_eq!(wanted(&lb(a, false)), Wanted::On(KEY.into()), "{yes}");
        }
        for off in [
            json!({}),
            json!({AD_HOC_DEBUG: "true"}),
            json!({AD_HOC_DEBUG_SSH_KEY: KEY}),
            json!({AD_HOC_DEBUG: "yes", AD_HOC_DEBUG_SSH_KEY: KEY}),
            json!({AD_HOC_DEBUG: "false", AD_HOC_DEBUG_SSH_KEY: KEY}),
        ] {
            assert_eq!(wanted(&lb(off.clone(), false)), Wanted::Off, "{off}");
        }
        assert!(
            matches!(wanted(&lb(on(KEY), true)), Wanted::Refused(m) if m.contains("normal debug"))
        );
    }

    #[test]
    fn only_one_plain_public_key_line() {
        assert_eq!(
            public_key_line(&format!("  {KEY}\n")).as_deref(),
            Some(KEY),
            "surrounding blanks trimmed"
        );
        assert_eq!(
            public_key_line("ssh-ed25519 AAAAC3Nza me@laptop").as_deref(),
            Some("ssh-ed25519 AAAAC3Nza me@laptop")
        );
        for bad in [
            "",
            "ssh-rsa",
            "ssh-dss AAAAB3",
            "command=\"sh\" ssh-rsa AAAAB3",
            "ssh-rsa AAAA$B3",
            "ssh-rsa AAAAB3\nssh-rsa AAAAC4",
            "ssh-rsa AAAAB3 comment\nwith newline",
        ] {
            assert_eq!(public_key_line(bad), None, "{bad:?}");
            assert!(matches!(
                wanted(&lb(on(bad), false)),
                Wanted::Refused(_) | Wanted::Off
            ));
        }
    }

    /// Settings on a temporary key file with `true`/`false` for sshd, recording the calls in a file.
    fn setup(name: &str, sshd_ok: bool) -> (AdHocDebugSettings, PathBuf, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("lb-agent-adhoc-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("authorized_keys");
        std::fs::write(&keys, "").unwrap();
        let log = dir.join("calls");
        let cmd = |what: &str| {
            let tail = if sshd_ok { "" } else { "; exit 3" };
            vec![
                "sh".to_string(),
                "-c".to_string(),
                format!("echo {what} >> {}{tail}", log.display()),
            ]
        };
        let s = AdHocDebugSettings {
            user: "yawoldebug".into(),
            authorized_keys: keys.clone(),
            start_sshd: cmd("start"),
            stop_sshd: cmd("stop"),
        };
        (s, keys, log)
    }

    fn reasons(e: &[MachineEvent]) -> Vec<&str> {
        e.iter().map(|e| e.reason).collect()
    }

    #[tokio::test]
    async fn key_in_and_out_with_sshd() {
        let (s, keys, log) = setup("cycle", true);
        let mut d = AdHocDebug::new(s, "lbm-1");
        let e = d.reconcile(&lb(json!({}), false)).await;
        assert!(e.is_empty(), "nothing to remove: {e:?}");
        let e = d.reconcile(&lb(on(KEY), false)).await;
        assert_eq!(reasons(&e), ["AdHocDebuggingEnabled"]);
        assert!(e[0].warning && e[0].message.contains("'lbm-1'"));
        assert_eq!(std::fs::read_to_string(&keys).unwrap(), format!("{KEY}\n"));
        assert!(
            d.reconcile(&lb(on(KEY), false)).await.is_empty(),
            "unchanged"
        );
        let e = d
            .reconcile(&lb(json!({AD_HOC_DEBUG: "false"}), false))
            .await;
        assert_eq!(reasons(&e), ["AdHocDebuggingDisabled"]);
        assert!(e[0].message.ends_with("and sshd stopped"), "{e:?}");
        assert_eq!(std::fs::read_to_string(&keys).unwrap(), "");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "start\nstop\n");
    }

    #[tokio::test]
    async fn a_key_left_from_before_a_restart_goes_and_debug_settings_keep_sshd() {
        let (s, keys, log) = setup("restart", true);
        std::fs::write(&keys, format!("{KEY}\n")).unwrap();
        let mut d = AdHocDebug::new(s.clone(), "lbm-1");
        let e = d.reconcile(&lb(json!({}), false)).await;
        assert_eq!(reasons(&e), ["AdHocDebuggingDisabled"]);
        assert_eq!(std::fs::read_to_string(&keys).unwrap(), "");
        // debugSettings on: refused, and sshd (the user data's) left running.
        std::fs::write(&keys, format!("{KEY}\n")).unwrap();
        let mut d = AdHocDebug::new(s, "lbm-1");
        let e = d.reconcile(&lb(on(KEY), true)).await;
        assert_eq!(
            reasons(&e),
            ["AdHocDebuggingDisabled", "AdHocDebuggingNotEnabled"]
        );
        assert!(!e[0].message.contains("sshd"), "{e:?}");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "stop\n");
    }

    #[tokio::test]
    async fn failures_are_reported_once_and_retried() {
        let (s, keys, _) = setup("fail", false);
        let mut d = AdHocDebug::new(s.clone(), "lbm-1");
        let e = d.reconcile(&lb(on(KEY), false)).await;
        assert_eq!(reasons(&e), ["AdHocDebuggingNotEnabled"]);
        assert!(
            e[0].message.contains("ssh cannot be started")
                && e[0].message.contains("exit status: 3"),
            "{e:?}"
        );
        assert!(
            d.reconcile(&lb(on(KEY), false)).await.is_empty(),
            "same failure, no new Event"
        );
        // No debug user on the image.
        std::fs::remove_file(&keys).unwrap();
        let mut d = AdHocDebug::new(s, "lbm-1");
        let e = d.reconcile(&lb(on(KEY), false)).await;
        assert!(e[0].message.contains("does not exist"), "{e:?}");
        assert!(
            d.reconcile(&lb(json!({}), false)).await.is_empty(),
            "nothing to remove"
        );
    }
}
