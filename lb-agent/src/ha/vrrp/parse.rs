//! Parsers for what keepalived writes: notify-FIFO lines, the SIGUSR2 stats file, the SIGUSR1 data dump and
//! console log lines.

use super::VrrpState;

/// One line of keepalived's notify FIFO, e.g. `INSTANCE "lb_vip" MASTER 105`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotifyLine {
    /// `INSTANCE` or `GROUP`.
    pub kind: String,
    /// Instance or sync-group name, without quotes.
    pub name: String,
    /// `MASTER`, `BACKUP`, `FAULT`, `STOP`, `DELETED`, `MASTER_RX_LOWER_PRI`, `MASTER_PRIORITY`, …
    pub event: String,
    /// Effective priority, when given.
    pub priority: Option<u32>,
}

impl NotifyLine {
    /// The state this line reports, if it is a state transition.
    pub fn state(&self) -> Option<VrrpState> {
        VrrpState::from_keepalived(&self.event)
    }
}

/// Parses one notify-FIFO line; `None` for anything that is not `KIND "NAME" EVENT [PRIORITY]`.
pub fn parse_notify_line(line: &str) -> Option<NotifyLine> {
    let line = line.trim();
    let (kind, rest) = line.split_once(' ')?;
    let rest = rest.trim_start().strip_prefix('"')?;
    let (name, rest) = rest.split_once('"')?;
    let mut words = rest.split_whitespace();
    let event = words.next()?;
    let priority = match words.next() {
        Some(p) => Some(p.parse().ok()?),
        None => None,
    };
    if words.next().is_some() || kind.is_empty() {
        return None;
    }
    Some(NotifyLine {
        kind: kind.to_string(),
        name: name.to_string(),
        event: event.to_string(),
        priority,
    })
}

/// keepalived's VRRP counters (since keepalived started) plus the current mastership, as yawol reports them in
/// `LoadBalancerMachine.status.metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VrrpStats {
    /// This machine holds the VIP now (from the live state, not from the counters).
    pub is_master: bool,
    /// Transitions to MASTER.
    pub became_master: u64,
    /// Transitions away from MASTER.
    pub released_master: u64,
    /// Adverts sent.
    pub advertisements_sent: u64,
    /// Adverts received.
    pub advertisements_received: u64,
}

impl VrrpStats {
    /// Parses the `keepalived.stats` file for `instance`. `None` if the instance's section or one of the counters
    /// is missing (e.g. the file is still being written).
    ///
    /// ```text
    /// VRRP Instance: lb_vip
    ///   Advertisements:
    ///     Received: 0
    ///     Sent: 22
    ///   Became master: 1
    ///   Released master: 0
    ///   …
    /// ```
    pub fn parse(text: &str, instance: &str, is_master: bool) -> Option<Self> {
        let mut in_instance = false;
        let mut section = "";
        let (mut received, mut sent, mut became, mut released) = (None, None, None, None);
        for raw in text.lines() {
            let indent = raw.len() - raw.trim_start().len();
            let line = raw.trim();
            if indent == 0 {
                if let Some(name) = line.strip_prefix("VRRP Instance:") {
                    in_instance = name.trim() == instance;
                    section = "";
                    continue;
                }
            }
            if !in_instance || line.is_empty() {
                continue;
            }
            let (key, value) = match line.split_once(':') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => continue,
            };
            if value.is_empty() {
                section = key;
                continue;
            }
            let Ok(n) = value.parse::<u64>() else {
                continue;
            };
            match (indent > 2, section, key) {
                (true, "Advertisements", "Received") => received = Some(n),
                (true, "Advertisements", "Sent") => sent = Some(n),
                (false, _, "Became master") => became = Some(n),
                (false, _, "Released master") => released = Some(n),
                _ => {}
            }
        }
        Some(VrrpStats {
            is_master,
            became_master: became?,
            released_master: released?,
            advertisements_sent: sent?,
            advertisements_received: received?,
        })
    }

    /// The five keepalived entries of yawol's `LoadBalancerMachine.status.metrics` (type, value).
    pub fn yawol_metrics(&self) -> Vec<(String, String)> {
        [
            ("keepalivedIsMaster", u64::from(self.is_master)),
            ("keepalivedBecameMaster", self.became_master),
            ("keepalivedReleasedMaster", self.released_master),
            ("keepalivedAdvertisementsSent", self.advertisements_sent),
            (
                "keepalivedAdvertisementsReceived",
                self.advertisements_received,
            ),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
    }
}

/// The state of `instance` in keepalived's SIGUSR1 data dump (`keepalived.data`):
///
/// ```text
///  VRRP Instance = lb_vip
///    VRRP Version = 3
///    State = MASTER
/// ```
pub fn parse_data_state(text: &str, instance: &str) -> Option<VrrpState> {
    let mut in_instance = false;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("VRRP Instance =") {
            in_instance = name.trim() == instance;
        } else if in_instance {
            if let Some(state) = line.strip_prefix("State =") {
                return VrrpState::from_keepalived(state.trim());
            }
        }
    }
    None
}

/// A console log line without keepalived's `Sat Nov 21 18:16:55 2026: ` prefix (tracing adds its own time).
pub(crate) fn strip_log_timestamp(line: &str) -> &str {
    match line.split_once(": ") {
        // "Www Mmm dd hh:mm:ss yyyy" is 24 characters.
        Some((prefix, rest))
            if prefix.len() == 24
                && prefix.as_bytes()[prefix.len() - 4..]
                    .iter()
                    .all(u8::is_ascii_digit) =>
        {
            rest
        }
        _ => line,
    }
}

/// Whether a keepalived log line deserves a warning rather than info.
pub(crate) fn log_line_is_warning(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    [
        "error", "warning", "unable", "fail", "cannot", "unknown", "died", "exiting",
    ]
    .iter()
    .any(|w| lower.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_lines() {
        let l = parse_notify_line("INSTANCE \"lb_vip\" MASTER 105\n").unwrap();
        assert_eq!(l.kind, "INSTANCE");
        assert_eq!(l.name, "lb_vip");
        assert_eq!(l.state(), Some(VrrpState::Master));
        assert_eq!(l.priority, Some(105));
        for (word, state) in [
            ("BACKUP", Some(VrrpState::Backup)),
            ("FAULT", Some(VrrpState::Fault)),
            ("STOP", Some(VrrpState::Stopped)),
            ("MASTER_RX_LOWER_PRI", None),
            ("MASTER_PRIORITY", None),
        ] {
            let l = parse_notify_line(&format!("INSTANCE \"lb_vip\" {word} 100")).unwrap();
            assert_eq!(l.state(), state, "{word}");
        }
        let g = parse_notify_line("GROUP \"g 1\" BACKUP").unwrap();
        assert_eq!((g.name.as_str(), g.priority), ("g 1", None));
        for bad in [
            "",
            "INSTANCE",
            "INSTANCE lb_vip MASTER 1",
            "INSTANCE \"x\"",
            "INSTANCE \"x\" MASTER y",
        ] {
            assert_eq!(parse_notify_line(bad), None, "{bad:?}");
        }
    }

    // Verbatim from keepalived 2.2.7 (SIGUSR2), with a second instance to check the section logic.
    const STATS: &str = "VRRP Instance: other
  Advertisements:
    Received: 7
    Sent: 7
  Became master: 7
  Released master: 7
VRRP Instance: lb_vip
  Advertisements:
    Received: 3
    Sent: 22
  Became master: 1
  Released master: 0
  Packet Errors:
    Length: 0
    TTL: 0
    Invalid Type: 0
    Advertisement Interval: 0
    Address List: 0
  Authentication Errors:
    Invalid Type: 0
    Type Mismatch: 0
    Failure: 0
  Priority Zero:
    Received: 0
    Sent: 0
";

    #[test]
    fn stats_file() {
        let s = VrrpStats::parse(STATS, "lb_vip", true).unwrap();
        assert_eq!(
            s,
            VrrpStats {
                is_master: true,
                became_master: 1,
                released_master: 0,
                advertisements_sent: 22,
                advertisements_received: 3,
            }
        );
        assert_eq!(
            s.yawol_metrics(),
            vec![
                ("keepalivedIsMaster".to_string(), "1".to_string()),
                ("keepalivedBecameMaster".to_string(), "1".to_string()),
                ("keepalivedReleasedMaster".to_string(), "0".to_string()),
                ("keepalivedAdvertisementsSent".to_string(), "22".to_string()),
                (
                    "keepalivedAdvertisementsReceived".to_string(),
                    "3".to_string()
                ),
            ]
        );
        // Incomplete file (still being written) or another instance only.
        assert_eq!(
            VrrpStats::parse(
                &STATS[..STATS.find("  Became master: 1").unwrap()],
                "lb_vip",
                false
            ),
            None
        );
        assert_eq!(VrrpStats::parse("", "lb_vip", false), None);
        assert_eq!(VrrpStats::parse(STATS, "missing", false), None);
    }

    #[test]
    fn data_dump_state() {
        let dump = "------< VRRP Topology >------\n VRRP Instance = other\n   State = BACKUP\n VRRP Instance = lb_vip\n   VRRP Version = 3\n   State = MASTER\n   Flags: none\n   Wantstate = MASTER\n";
        assert_eq!(parse_data_state(dump, "lb_vip"), Some(VrrpState::Master));
        assert_eq!(parse_data_state(dump, "other"), Some(VrrpState::Backup));
        assert_eq!(parse_data_state(dump, "missing"), None);
    }

    #[test]
    fn log_lines() {
        assert_eq!(
            strip_log_timestamp("Sat Nov 21 18:16:55 2026: (lb_vip) Entering MASTER STATE"),
            "(lb_vip) Entering MASTER STATE"
        );
        assert_eq!(strip_log_timestamp("no: timestamp"), "no: timestamp");
        assert!(log_line_is_warning("Unable to open notify fifo"));
        assert!(!log_line_is_warning("(lb_vip) Entering MASTER STATE"));
    }
}
