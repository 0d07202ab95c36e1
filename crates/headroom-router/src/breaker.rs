//! The circuit breaker over the GPU worker. Closed → Open after `failure_threshold` allocation
//! failures within `window_ms`, or at once on device loss or a failed health check. Open →
//! HalfOpen once `cooldown_ms` has passed (and a clean worker is up); HalfOpen → Closed when the
//! canary allocation and the probe request succeed, back to Open otherwise. Time is passed in,
//! so the policy is tested without sleeping.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Allocation failures within the window that open the breaker.
    pub failure_threshold: u32,
    pub window_ms: u64,
    /// Time the breaker stays open before a probe is tried.
    pub cooldown_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self { failure_threshold: 3, window_ms: 60_000, cooldown_ms: 500 }
    }
}

/// Why the GPU is being counted against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCause {
    /// An allocation failed (counted; opens at the threshold).
    Oom,
    /// The device or its process is gone (opens at once).
    DeviceLost,
    /// The worker did not answer a health check in time (opens at once).
    HealthCheck,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakerTransition {
    pub from: BreakerState,
    pub to: BreakerState,
    pub reason: String,
}

#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
    failures: VecDeque<Instant>,
    opened_at: Option<Instant>,
    reason: String,
    /// The failure that opened it (None while closed).
    cause: Option<FailureCause>,
    times_opened: u64,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: BreakerState::Closed,
            failures: VecDeque::new(),
            opened_at: None,
            reason: "healthy".into(),
            cause: None,
            times_opened: 0,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Why the breaker is in its state (the last transition's reason).
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The failure that opened the breaker (None while closed).
    pub fn cause(&self) -> Option<FailureCause> {
        self.cause
    }

    /// How often the breaker has opened: a worker started before the latest opening is suspect.
    pub fn times_opened(&self) -> u64 {
        self.times_opened
    }

    pub fn allows_requests(&self) -> bool {
        self.state == BreakerState::Closed
    }

    fn go(&mut self, to: BreakerState, reason: String, now: Instant) -> Option<BreakerTransition> {
        if self.state == to {
            return None;
        }
        let from = self.state;
        self.state = to;
        self.reason = reason.clone();
        match to {
            BreakerState::Open => {
                self.opened_at = Some(now);
                self.times_opened += 1;
            }
            BreakerState::Closed => {
                self.opened_at = None;
                self.cause = None;
                self.failures.clear();
            }
            BreakerState::HalfOpen => {}
        }
        Some(BreakerTransition { from, to, reason })
    }

    pub fn record_failure(&mut self, cause: FailureCause, reason: &str, now: Instant) -> Option<BreakerTransition> {
        let t = self.count_failure(cause, reason, now);
        if t.is_some() {
            self.cause = Some(cause);
        }
        t
    }

    fn count_failure(&mut self, cause: FailureCause, reason: &str, now: Instant) -> Option<BreakerTransition> {
        match (self.state, cause) {
            (BreakerState::Open, _) => None,
            (BreakerState::HalfOpen, _) => self.go(BreakerState::Open, format!("probe period failed: {reason}"), now),
            (BreakerState::Closed, FailureCause::Oom) => {
                let window = Duration::from_millis(self.config.window_ms);
                self.failures.push_back(now);
                while self.failures.front().is_some_and(|&t| now.duration_since(t) > window) {
                    self.failures.pop_front();
                }
                if self.failures.len() as u32 >= self.config.failure_threshold {
                    let n = self.failures.len();
                    self.go(
                        BreakerState::Open,
                        format!("{n} allocation failures within {} s: {reason}", self.config.window_ms / 1000),
                        now,
                    )
                } else {
                    None
                }
            }
            (BreakerState::Closed, _) => self.go(BreakerState::Open, reason.to_string(), now),
        }
    }

    /// Whether the cool-down of an open breaker is over.
    pub fn cooldown_over(&self, now: Instant) -> bool {
        self.state == BreakerState::Open
            && self
                .opened_at
                .is_some_and(|t| now.duration_since(t) >= Duration::from_millis(self.config.cooldown_ms))
    }

    /// Open → HalfOpen, once the cool-down is over.
    pub fn begin_probe(&mut self, now: Instant) -> Option<BreakerTransition> {
        if !self.cooldown_over(now) {
            return None;
        }
        self.go(BreakerState::HalfOpen, "cool-down over; probing the GPU".into(), now)
    }

    pub fn probe_succeeded(&mut self, detail: &str, now: Instant) -> Option<BreakerTransition> {
        if self.state != BreakerState::HalfOpen {
            return None;
        }
        self.go(BreakerState::Closed, format!("probe succeeded: {detail}"), now)
    }

    pub fn probe_failed(&mut self, detail: &str, now: Instant) -> Option<BreakerTransition> {
        if self.state != BreakerState::HalfOpen {
            return None;
        }
        self.go(BreakerState::Open, format!("probe failed: {detail}"), now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> BreakerConfig {
        BreakerConfig { failure_threshold: 3, window_ms: 10_000, cooldown_ms: 1_000 }
    }

    #[test]
    fn ooms_open_at_the_threshold_within_the_window() {
        let mut b = Breaker::new(config());
        let t0 = Instant::now();
        assert!(b.record_failure(FailureCause::Oom, "oom", t0).is_none());
        // The first failure ages out of the window.
        assert!(b.record_failure(FailureCause::Oom, "oom", t0 + Duration::from_secs(11)).is_none());
        assert!(b.record_failure(FailureCause::Oom, "oom", t0 + Duration::from_secs(12)).is_none());
        let t = b.record_failure(FailureCause::Oom, "oom", t0 + Duration::from_secs(13)).unwrap();
        assert_eq!((t.from, t.to), (BreakerState::Closed, BreakerState::Open));
        assert!(t.reason.contains("3 allocation failures"), "{}", t.reason);
        assert!(!b.allows_requests());
    }

    #[test]
    fn device_loss_opens_at_once_and_a_full_cycle_closes() {
        let mut b = Breaker::new(config());
        let t0 = Instant::now();
        b.record_failure(FailureCause::DeviceLost, "worker exited", t0).unwrap();
        assert!(b.begin_probe(t0 + Duration::from_millis(500)).is_none(), "still cooling down");
        let half = b.begin_probe(t0 + Duration::from_millis(1000)).unwrap();
        assert_eq!(half.to, BreakerState::HalfOpen);
        assert!(!b.allows_requests());
        let closed = b.probe_succeeded("ok", t0 + Duration::from_millis(1100)).unwrap();
        assert_eq!(closed.to, BreakerState::Closed);
        assert!(b.allows_requests());
    }

    #[test]
    fn a_failed_probe_reopens_and_restarts_the_cool_down() {
        let mut b = Breaker::new(config());
        let t0 = Instant::now();
        b.record_failure(FailureCause::HealthCheck, "no answer", t0);
        b.begin_probe(t0 + Duration::from_secs(1)).unwrap();
        let t = b.probe_failed("canary failed", t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(t.to, BreakerState::Open);
        assert!(!b.cooldown_over(t0 + Duration::from_millis(2500)));
        assert!(b.cooldown_over(t0 + Duration::from_secs(3)));
    }

    proptest::proptest! {
        /// Whatever happens, requests flow only when closed, and closing needs a probe.
        #[test]
        fn only_a_successful_probe_closes(ops in proptest::collection::vec(0u8..5, 1..60)) {
            let mut b = Breaker::new(config());
            let mut now = Instant::now();
            for op in ops {
                now += Duration::from_millis(400);
                let before = b.state();
                let t = match op {
                    0 => b.record_failure(FailureCause::Oom, "oom", now),
                    1 => b.record_failure(FailureCause::DeviceLost, "lost", now),
                    2 => b.begin_probe(now),
                    3 => b.probe_succeeded("ok", now),
                    _ => b.probe_failed("bad", now),
                };
                if let Some(t) = &t {
                    proptest::prop_assert_eq!(t.from, before);
                    if t.to == BreakerState::Closed {
                        proptest::prop_assert_eq!(op, 3);
                        proptest::prop_assert_eq!(before, BreakerState::HalfOpen);
                    }
                }
                proptest::prop_assert_eq!(b.allows_requests(), b.state() == BreakerState::Closed);
            }
        }
    }
}
