//! The dispatcher's Prometheus metrics and the queue events the UI follows.

use super::*;

impl Dispatcher {
    /// The Prometheus text exposition of the service's metrics, gauges read now.
    pub fn metrics_text(&self) -> String {
        let inner = &self.inner;
        let m = &inner.metrics;
        let status = inner.supervisor.status();
        m.breaker_state.set(match status.breaker {
            crate::BreakerState::Closed => 0,
            crate::BreakerState::HalfOpen => 1,
            crate::BreakerState::Open => 2,
        });
        m.degraded.set(i64::from(status.degraded));
        m.gpu_paused.set(i64::from(status.gpu_paused));
        m.gpu_model_loaded.set(i64::from(status.gpu.is_some() && !status.gpu_unloaded));
        for q in self.queues() {
            let label = crate::metrics::device(q.device.as_str());
            m.queue_waiting.get_or_create(&label).set(q.waiting as i64);
            m.queue_running.get_or_create(&label).set(q.running as i64);
            m.queue_capacity.get_or_create(&label).set(q.capacity as i64);
            m.queue_oldest_age_seconds.get_or_create(&label).set(q.oldest_wait_ms as f64 / 1000.0);
            if let Some(d) = q.estimated_delay_ms {
                m.estimated_delay_seconds.get_or_create(&label).set(d as f64 / 1000.0);
            }
            if let Some(r) = q.ms_per_token {
                m.decode_ms_per_token.get_or_create(&label).set(r);
            }
            if let Some(r) = q.prefill_ms_per_token {
                m.prefill_ms_per_token.get_or_create(&label).set(r);
            }
        }
        // Gauges are i64; byte counts never come near its limit, but saturate rather than wrap.
        let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        if status.gpu_unloaded {
            // Nothing of Headroom's is on the device: what is in use there is other programs'.
            let others = inner.supervisor.vram_room().map_or(0, |room| room.total_bytes.saturating_sub(room.free_bytes));
            m.vram_used_bytes.set(bytes(others));
            m.vram_predicted_bytes.set(bytes(others));
            m.gpu_kv_resident_bytes.set(0);
        } else if let Some(reading) = inner.supervisor.gpu_worker().and_then(|w| w.memory().borrow().clone()) {
            m.vram_capacity_bytes.set(bytes(reading.capacity_bytes.unwrap_or(0)));
            m.vram_used_bytes.set(bytes(reading.used_bytes.unwrap_or(0)));
            m.vram_predicted_bytes.set(bytes(reading.weights_bytes + reading.reserved_bytes + reading.competing_bytes));
            if let Some(resident) = reading.kv_resident_bytes {
                m.gpu_kv_resident_bytes.set(bytes(resident));
            }
        }
        if let Some(host) = headroom_memory::observe::host_memory() {
            m.host_total_bytes.set(bytes(host.total_bytes));
            m.host_available_bytes.set(bytes(host.available_bytes));
        }
        m.host_reserved_bytes.set(bytes(inner.host_ledger().held_bytes()));
        let cpu_reading = inner.supervisor.cpu_worker().and_then(|w| w.memory().borrow().clone());
        if let Some(resident) = cpu_reading.as_ref().and_then(|r| r.kv_resident_bytes) {
            m.cpu_kv_resident_bytes.set(bytes(resident));
        }
        if let Some(p) = cpu_reading.and_then(|r| r.prefix_cache) {
            m.prefix_cache_bytes.set(bytes(p.bytes));
            m.prefix_cache_looked_up_tokens.set(bytes(p.looked_up_tokens));
            m.prefix_cache_reused_tokens.set(bytes(p.reused_tokens));
        }
        m.encode()
    }

    /// Times this model's GPU copy was unloaded (keep_alive) or evicted for another model.
    pub fn gpu_model_unloads(&self) -> u64 {
        self.inner.metrics.gpu_model_unloads.get()
    }

    pub(super) fn count_end(&self, device: &str, outcome: &str) {
        self.inner.metrics.requests.get_or_create(&OutcomeLabels { device: device.into(), outcome: outcome.into() }).inc();
    }

    pub(super) fn queue_changed(&self, lane: &LaneQueue) {
        let q = lane.status();
        self.inner.supervisor.emit(EventKind::QueueChanged {
            device: q.device,
            waiting: q.waiting as u32,
            running: q.running as u32,
            capacity: q.capacity as u32,
            oldest_wait_ms: q.oldest_wait_ms,
            estimated_delay_ms: q.estimated_delay_ms,
        });
    }
}

