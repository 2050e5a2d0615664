//! Go `time.Duration` strings as used by `metav1.Duration` (`"1h0m0s"`, `"90s"`, `"1.5s"`, `"0s"`).
//!
//! yawol stores `tcpIdleTimeout`/`udpIdleTimeout` as `metav1.Duration`, which serialises as Go's
//! `Duration.String()`. The service annotations accept anything `time.ParseDuration` accepts. This
//! module parses both into [`std::time::Duration`] and formats a duration exactly as Go does, so the
//! objects we write are byte-identical to the ones yawol writes.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Error from [`parse_go_duration`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// The text is not a Go duration (`time.ParseDuration` would fail).
    #[error(
        "invalid duration {0:?}: expected a Go duration such as \"90s\", \"5m30s\" or \"1h0m0s\""
    )]
    Invalid(String),
    /// The duration is negative; timeouts cannot be negative.
    #[error("negative duration {0:?} is not allowed")]
    Negative(String),
    /// The duration does not fit into 64-bit nanoseconds (Go's limit, about 290 years).
    #[error("duration {0:?} overflows")]
    Overflow(String),
}

/// JSON-schema regular expression accepting what Go's `time.ParseDuration` accepts
/// (optional sign, then one or more `<number><unit>` groups, or a bare `0`).
pub const GO_DURATION_PATTERN: &str =
    r"^[-+]?(0|(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)$";

/// Parses a Go duration string (`time.ParseDuration` syntax) into a [`Duration`].
///
/// Negative values are rejected ([`DurationError::Negative`]) except `-0`, because every use in
/// this project is a timeout or interval.
pub fn parse_go_duration(text: &str) -> Result<Duration, DurationError> {
    let invalid = || DurationError::Invalid(text.to_string());
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    // Work in u128 nanoseconds with a fractional part kept as (numerator, denominator), so
    // "1.5h" or ".25s" are exact like in Go.
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let int_part = &rest[..int_len];
        rest = &rest[int_len..];
        let mut frac_part = "";
        if let Some(after_dot) = rest.strip_prefix('.') {
            let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
            frac_part = &after_dot[..frac_len];
            rest = &after_dot[frac_len..];
        }
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(invalid());
        }
        let unit_len = rest
            .char_indices()
            .find(|(_, c)| *c == '.' || c.is_ascii_digit())
            .map_or(rest.len(), |(i, _)| i);
        let unit: u128 = match &rest[..unit_len] {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(invalid()),
        };
        rest = &rest[unit_len..];
        let overflow = || DurationError::Overflow(text.to_string());
        let int_value: u128 = if int_part.is_empty() {
            0
        } else {
            int_part.parse().map_err(|_| overflow())?
        };
        let mut value = int_value.checked_mul(unit).ok_or_else(overflow)?;
        if !frac_part.is_empty() {
            // Go truncates the fraction towards zero at nanosecond precision.
            let digits = &frac_part[..frac_part.len().min(30)];
            let numerator: u128 = digits.parse().map_err(|_| overflow())?;
            let denominator = 10u128.pow(digits.len() as u32);
            value += numerator * unit / denominator;
        }
        total = total.checked_add(value).ok_or_else(overflow)?;
    }
    if total > i64::MAX as u128 {
        return Err(DurationError::Overflow(text.to_string()));
    }
    if negative && total != 0 {
        return Err(DurationError::Negative(text.to_string()));
    }
    Ok(Duration::from_nanos(total as u64))
}

/// Formats a duration exactly like Go's `time.Duration.String()` (`"1h0m0s"`, `"1m30s"`,
/// `"1.5s"`, `"500ms"`, `"0s"`), which is what `metav1.Duration` serialises to.
pub fn format_go_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos().min(i64::MAX as u128) as u64;
    if nanos == 0 {
        return "0s".to_string();
    }
    if nanos < 1_000_000_000 {
        // Sub-second: one unit with a fraction, e.g. "1.5ms".
        let (unit, scale) = if nanos < 1_000 {
            ("ns", 1)
        } else if nanos < 1_000_000 {
            ("µs", 1_000)
        } else {
            ("ms", 1_000_000)
        };
        return format!("{}{}", fixed_fraction(nanos, scale), unit);
    }
    let hours = nanos / 3_600_000_000_000;
    let minutes = (nanos / 60_000_000_000) % 60;
    let seconds_nanos = nanos % 60_000_000_000;
    let seconds = fixed_fraction(seconds_nanos, 1_000_000_000);
    if hours > 0 {
        format!("{hours}h{minutes}m{seconds}s")
    } else if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

/// `value / scale` printed with the minimal number of fractional digits.
fn fixed_fraction(value: u64, scale: u64) -> String {
    let whole = value / scale;
    let frac = value % scale;
    if frac == 0 {
        return whole.to_string();
    }
    let width = scale.ilog10() as usize;
    let digits = format!("{frac:0width$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// A `metav1.Duration` as stored in the objects: the Go duration text, kept verbatim so that
/// objects round-trip unchanged. Use [`GoDuration::to_std`] to interpret it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GoDuration(pub String);

impl GoDuration {
    /// The canonical Go text for `duration` (what yawol would store).
    pub fn from_std(duration: Duration) -> Self {
        Self(format_go_duration(duration))
    }

    /// Parses the stored text. `Ok(Duration::ZERO)` means "disabled" for idle timeouts.
    pub fn to_std(&self) -> Result<Duration, DurationError> {
        parse_go_duration(&self.0)
    }

    /// The stored text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Duration> for GoDuration {
    fn from(duration: Duration) -> Self {
        Self::from_std(duration)
    }
}

impl JsonSchema for GoDuration {
    fn schema_name() -> Cow<'static, str> {
        "GoDuration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": GO_DURATION_PATTERN,
            "description": "A Go duration (metav1.Duration), e.g. \"90s\", \"5m30s\", \"1h0m0s\"; \"0s\" disables the timeout.",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_syntax() {
        let cases = [
            ("0", 0),
            ("0s", 0),
            ("-0", 0),
            ("90s", 90_000_000_000),
            ("1h0m0s", 3_600_000_000_000),
            ("5m30s", 330_000_000_000),
            ("1.5s", 1_500_000_000),
            (".5s", 500_000_000),
            ("1.5h", 5_400_000_000_000),
            ("300ms", 300_000_000),
            ("10us", 10_000),
            ("10µs", 10_000),
            ("7ns", 7),
            ("+2m", 120_000_000_000),
            ("1h1h", 7_200_000_000_000),
        ];
        for (text, nanos) in cases {
            assert_eq!(
                parse_go_duration(text),
                Ok(Duration::from_nanos(nanos)),
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_invalid() {
        for text in [
            "", "1", "s", "1x", "1.s.", "abc", "1h 2m", " 1s", ".s", "1e3s",
        ] {
            assert!(
                matches!(parse_go_duration(text), Err(DurationError::Invalid(_))),
                "{text:?} should be invalid"
            );
        }
        assert!(matches!(
            parse_go_duration("-1s"),
            Err(DurationError::Negative(_))
        ));
        assert!(matches!(
            parse_go_duration("9999999999h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn formats_like_go() {
        let cases = [
            (0, "0s"),
            (1, "1ns"),
            (1_500, "1.5µs"),
            (500_000_000, "500ms"),
            (1_500_000_000, "1.5s"),
            (60_000_000_000, "1m0s"),
            (90_000_000_000, "1m30s"),
            (330_000_000_000, "5m30s"),
            (3_600_000_000_000, "1h0m0s"),
            (3_661_000_000_000, "1h1m1s"),
            (3_600_000_000_001, "1h0m0.000000001s"),
        ];
        for (nanos, text) in cases {
            assert_eq!(format_go_duration(Duration::from_nanos(nanos)), text);
            assert_eq!(parse_go_duration(text), Ok(Duration::from_nanos(nanos)));
        }
    }
}
