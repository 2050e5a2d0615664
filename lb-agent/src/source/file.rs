//! File mode's config source: a local YAML file ([`crate::source::config::LocalConfig`]), polled.

use crate::source::config::DesiredConfig;
use crate::source::ConfigState;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Polls a config file (content, not just mtime, so atomic renames and editors are seen alike) and publishes
/// each new version. Reading a few kilobytes every `every` (50 ms in the agent) costs nothing next to the
/// latency it saves.
/// `proxy_v2`: the data plane inserts PROXY v2 headers (see [`DesiredConfig::from_file`]).
pub fn watch_file(path: PathBuf, every: Duration, proxy_v2: bool) -> watch::Receiver<ConfigState> {
    let (tx, rx) = watch::channel(ConfigState::Pending);
    tokio::spawn(async move {
        let mut last: Option<String> = None;
        let mut generation = 0u64;
        loop {
            match tokio::fs::read_to_string(&path).await {
                Ok(text) if last.as_deref() != Some(text.as_str()) => {
                    generation += 1;
                    let state = crate::source::config::LocalConfig::parse(&text)
                        .map_err(|e| format!("{}: {e:#}", path.display()))
                        .and_then(|c| {
                            DesiredConfig::from_file(&c, proxy_v2).map_err(|e| format!("{e:#}"))
                        });
                    let _ = tx.send(match state {
                        Ok(c) => {
                            for w in &c.warnings {
                                tracing::warn!(file = %path.display(), warning = %w, "config accepted with a warning");
                            }
                            ConfigState::Valid(Arc::new(c), generation)
                        }
                        Err(e) => ConfigState::Invalid(e, generation),
                    });
                    last = Some(text);
                }
                Ok(_) => {}
                Err(e) if last.is_none() => {
                    generation += 1;
                    let _ = tx.send(ConfigState::Invalid(
                        format!("reading {}: {e}", path.display()),
                        generation,
                    ));
                    last = Some(String::new());
                }
                Err(_) => {}
            }
            tokio::time::sleep(every).await;
        }
    });
    rx
}
