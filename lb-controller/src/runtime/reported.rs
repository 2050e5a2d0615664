//! Bad input reported once: each problem of an object is counted and gets its Warning event when it appears, not on
//! every reconcile while it lasts.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// Bad input per object, so that each problem is counted and gets its Warning event once when it appears — and again
/// only after it was gone (fixed) for a whole reconcile, not on every reconcile while it lasts.
#[derive(Default)]
pub struct Reported(Mutex<HashMap<String, HashSet<String>>>);

impl Reported {
    /// The problems of `problems` not reported yet for the object `uid`. With `complete` (the reconcile finished, so
    /// `problems` is everything the object has now) the ones no longer present are forgotten.
    pub fn fresh(&self, uid: &str, problems: &[String], complete: bool) -> Vec<String> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let known = all.entry(uid.to_string()).or_default();
        let new: Vec<String> = problems
            .iter()
            .filter(|p| !known.contains(*p))
            .cloned()
            .collect();
        if complete {
            *known = problems.iter().cloned().collect();
        } else {
            known.extend(new.iter().cloned());
        }
        if known.is_empty() {
            all.remove(uid);
        }
        new
    }

    /// The object is gone.
    pub fn forget(&self, uid: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(uid);
    }
}
