//! How long the GPU keeps a model loaded after its last request: Ollama's `keep_alive`, read the
//! way Ollama reads it (a number of seconds, or a Go duration such as `"5m"`, `"1h30m"`,
//! `"250ms"`; 0 unloads at once, a negative value never).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How long an idle model stays loaded on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepAlive {
    /// Loaded while the service runs (`-1`, any negative value).
    #[default]
    Forever,
    /// Unloaded once no request has used it for this long (`0`: as soon as it is idle).
    For(Duration),
}

impl KeepAlive {
    /// From a number of seconds; negative means forever.
    pub fn from_seconds(seconds: f64) -> Result<Self, String> {
        if !seconds.is_finite() {
            return Err(format!("keep_alive {seconds} is not a number of seconds"));
        }
        if seconds < 0.0 {
            return Ok(Self::Forever);
        }
        Ok(Self::For(Duration::from_secs_f64(seconds.min(1e12))))
    }

    /// Whether a model idle for `idle` is unloaded now.
    pub fn expired(self, idle: Duration) -> bool {
        matches!(self, Self::For(keep) if idle >= keep)
    }

    /// What is left of it after `idle`; `None` when it never expires.
    pub fn remaining(self, idle: Duration) -> Option<Duration> {
        match self {
            Self::Forever => None,
            Self::For(keep) => Some(keep.saturating_sub(idle)),
        }
    }

    /// Reads a JSON value as Ollama does: a number of seconds or a duration string.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, String> {
        match value {
            serde_json::Value::Number(n) => Self::from_seconds(n.as_f64().unwrap_or(f64::NAN)),
            serde_json::Value::String(s) => s.parse(),
            other => Err(format!("keep_alive = {other}: give a duration such as \"5m\" or \"30s\", a number of seconds, 0 to unload at once, or -1 to keep the model loaded")),
        }
    }
}

impl FromStr for KeepAlive {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let s = text.trim();
        let bad = || format!("keep_alive {text:?} is not a duration; give one such as \"5m\", \"1h30m\" or \"30s\", a number of seconds, 0 to unload at once, or -1 to keep the model loaded");
        if s.is_empty() {
            return Err(bad());
        }
        if let Ok(seconds) = s.parse::<f64>() {
            return Self::from_seconds(seconds);
        }
        let (negative, mut rest) = match s.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, s.strip_prefix('+').unwrap_or(s)),
        };
        let mut total = 0f64;
        while !rest.is_empty() {
            let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
            let value: f64 = rest[..number_end].parse().map_err(|_| bad())?;
            rest = &rest[number_end..];
            let unit_end = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
            let seconds_per = match &rest[..unit_end] {
                "ns" => 1e-9,
                "us" | "µs" | "μs" => 1e-6,
                "ms" => 1e-3,
                "s" => 1.0,
                "m" => 60.0,
                "h" => 3600.0,
                _ => return Err(bad()),
            };
            total += value * seconds_per;
            rest = &rest[unit_end..];
        }
        Self::from_seconds(if negative { -total } else { total })
    }
}

impl fmt::Display for KeepAlive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Forever => f.write_str("-1"),
            Self::For(d) if d.subsec_millis() == 0 && d.as_secs() % 3600 == 0 && d.as_secs() > 0 => write!(f, "{}h", d.as_secs() / 3600),
            Self::For(d) if d.subsec_millis() == 0 && d.as_secs() % 60 == 0 && d.as_secs() > 0 => write!(f, "{}m", d.as_secs() / 60),
            Self::For(d) if d.subsec_millis() == 0 => write!(f, "{}s", d.as_secs()),
            Self::For(d) => write!(f, "{}ms", d.as_millis()),
        }
    }
}

impl Serialize for KeepAlive {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for KeepAlive {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Seconds(f64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Seconds(s) => Self::from_seconds(s),
            Raw::Text(t) => t.parse(),
        }
        .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ollamas_forms() {
        let secs = |s: u64| KeepAlive::For(Duration::from_secs(s));
        assert_eq!("5m".parse::<KeepAlive>().unwrap(), secs(300));
        assert_eq!("1h30m".parse::<KeepAlive>().unwrap(), secs(5400));
        assert_eq!("250ms".parse::<KeepAlive>().unwrap(), KeepAlive::For(Duration::from_millis(250)));
        assert_eq!("1.5s".parse::<KeepAlive>().unwrap(), KeepAlive::For(Duration::from_millis(1500)));
        assert_eq!("0".parse::<KeepAlive>().unwrap(), secs(0));
        assert_eq!("-1".parse::<KeepAlive>().unwrap(), KeepAlive::Forever);
        assert_eq!("-5m".parse::<KeepAlive>().unwrap(), KeepAlive::Forever);
        assert_eq!(KeepAlive::from_json(&serde_json::json!(30)).unwrap(), secs(30));
        assert_eq!(KeepAlive::from_json(&serde_json::json!(-1)).unwrap(), KeepAlive::Forever);
        assert_eq!(KeepAlive::from_json(&serde_json::json!("10m")).unwrap(), secs(600));
        for bad in ["", "5 minutes", "m", "5x", "1..2s"] {
            let e = bad.parse::<KeepAlive>().unwrap_err();
            assert!(e.contains("keep_alive") && e.contains("-1"), "{bad}: {e}");
        }
        assert!(KeepAlive::from_json(&serde_json::json!(true)).is_err());
        assert_eq!(secs(300).to_string(), "5m");
        assert_eq!(KeepAlive::Forever.to_string(), "-1");
    }

    #[test]
    fn expires_only_after_its_time() {
        let k = KeepAlive::For(Duration::from_secs(10));
        assert!(!k.expired(Duration::from_secs(9)));
        assert!(k.expired(Duration::from_secs(10)));
        assert!(KeepAlive::For(Duration::ZERO).expired(Duration::ZERO));
        assert!(!KeepAlive::Forever.expired(Duration::from_secs(1 << 40)));
        assert_eq!(k.remaining(Duration::from_secs(4)), Some(Duration::from_secs(6)));
    }
}
