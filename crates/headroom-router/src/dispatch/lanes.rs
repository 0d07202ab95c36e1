//! Lanes and their rates: each device's bounded queue (waiting, running, the room kept for
//! failovers), the measured prefill and decode rates, and the delay they predict.

use super::*;

/// Queue limits: the `[queues]` table of the config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Requests that may wait for the GPU; beyond this, a capacity error.
    pub gpu_queue_capacity: usize,
    /// Requests that may wait for the CPU worker.
    pub cpu_queue_capacity: usize,
}

impl QueueConfig {
    /// Parses the `[queues]` table of a Headroom config file.
    pub fn from_toml(text: &str) -> crate::Result<Self> {
        crate::config_table(text, "queues")
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self { gpu_queue_capacity: 64, cpu_queue_capacity: 16 }
    }
}

/// Measured rates of one lane (one device and the bundle it holds), EWMA.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Rates {
    pub(super) prefill_ms_per_token: Option<f64>,
    pub(super) decode_ms_per_token: Option<f64>,
}

pub(super) fn ewma(current: Option<f64>, sample: f64) -> Option<f64> {
    Some(match current {
        Some(r) => 0.8 * r + 0.2 * sample,
        None => sample,
    })
}

/// One device's queue: a bounded number waiting, the worker's concurrency running. The slots
/// are taken first come, first served (tokio's semaphore is fair), whether a request was
/// admitted here or failed over from the GPU. A CPU worker shared by several models has one
/// queue for all of them (see [`crate::SharedCpu`]).
pub(crate) struct LaneQueue {
    pub(super) lane: Lane,
    pub(super) slots: Semaphore,
    pub(super) waiting: AtomicUsize,
    pub(super) running: AtomicUsize,
    /// Requests admitted here may join while fewer than this wait.
    pub(super) capacity: usize,
    /// Places kept beyond `capacity` for requests failing over from the GPU: as many as the GPU
    /// lanes failing over into it can hold (queued and running), so a GPU failure never finds
    /// this queue full.
    pub(super) failover_room: AtomicUsize,
    /// Slots of `slots`; settings may change it (see [`Lane::resize`]).
    pub(super) concurrency: AtomicUsize,
    pub(super) rates: Mutex<Rates>,
    /// Prompt and max_tokens of every request waiting or running here.
    pub(super) work_ahead: Mutex<WorkAhead>,
    /// When each waiting request joined, for the oldest age.
    pub(super) waiting_since: Mutex<HashMap<String, Instant>>,
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct WorkAhead {
    pub(super) prompt_tokens: u64,
    pub(super) max_tokens: u64,
}

impl LaneQueue {
    /// A lane with no failover room yet: each dispatcher whose GPU lane fails over into it adds
    /// its own (see [`super::Dispatcher::start`]).
    pub(super) fn new(lane: Lane, capacity: usize, concurrency: usize) -> Self {
        Self {
            lane,
            slots: Semaphore::new(concurrency.max(1)),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            capacity,
            failover_room: AtomicUsize::new(0),
            concurrency: AtomicUsize::new(concurrency.max(1)),
            rates: Mutex::new(Rates::default()),
            work_ahead: Mutex::new(WorkAhead::default()),
            waiting_since: Mutex::new(HashMap::new()),
        }
    }

    /// Expected milliseconds to run a request of this shape here, from measured rates; None
    /// before any request has finished here.
    pub(super) fn expected_run_ms(&self, prompt_tokens: u64, max_tokens: u64) -> Option<f64> {
        let rates = *self.rates.lock().unwrap();
        let decode = rates.decode_ms_per_token?;
        Some(prompt_tokens as f64 * rates.prefill_ms_per_token.unwrap_or(0.0) + max_tokens as f64 * decode)
    }

    /// Expected wait before a new request starts here: the work ahead at measured rates, shared
    /// by the lane's concurrency; None before any request has finished here.
    pub(super) fn estimated_delay_ms(&self) -> Option<u64> {
        let ahead = *self.work_ahead.lock().unwrap();
        let work = self.expected_run_ms(ahead.prompt_tokens, ahead.max_tokens)?;
        let concurrency = self.concurrency.load(Ordering::Relaxed);
        if self.running.load(Ordering::Relaxed) < concurrency {
            return Some(0);
        }
        Some((work / concurrency as f64).round() as u64)
    }

    pub(super) fn observe(&self, prompt_tokens: u32, prefill_ms: f64, tokens: u32, decode_ms: f64) {
        let mut rates = self.rates.lock().unwrap();
        if prompt_tokens > 0 {
            rates.prefill_ms_per_token = ewma(rates.prefill_ms_per_token, prefill_ms / prompt_tokens as f64);
        }
        if tokens > 0 {
            rates.decode_ms_per_token = ewma(rates.decode_ms_per_token, decode_ms / tokens as f64);
        }
    }

    pub(super) fn join(&self, id: &str, prompt_tokens: u64, max_tokens: u64) {
        let mut ahead = self.work_ahead.lock().unwrap();
        ahead.prompt_tokens += prompt_tokens;
        ahead.max_tokens += max_tokens;
        self.waiting_since.lock().unwrap().insert(id.to_string(), Instant::now());
    }

    /// No longer waiting: it took a slot, or ended in the queue.
    pub(super) fn forget(&self, id: &str) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.waiting_since.lock().unwrap().remove(id);
    }

    pub(super) fn leave(&self, prompt_tokens: u64, max_tokens: u64) {
        let mut ahead = self.work_ahead.lock().unwrap();
        ahead.prompt_tokens -= prompt_tokens;
        ahead.max_tokens -= max_tokens;
    }

    /// Changes how many requests run here at once. More slots are free at once; fewer are
    /// taken back as running requests finish (none is stopped).
    pub(super) fn resize(self: &Arc<Self>, concurrency: usize) {
        let concurrency = concurrency.max(1);
        let old = self.concurrency.swap(concurrency, Ordering::SeqCst);
        if concurrency > old {
            self.slots.add_permits(concurrency - old);
        } else if concurrency < old {
            let lane = self.clone();
            tokio::spawn(async move {
                if let Ok(permits) = lane.slots.acquire_many((old - concurrency) as u32).await {
                    permits.forget();
                }
            });
        }
    }

    pub(super) fn oldest_wait_ms(&self) -> u64 {
        let since = self.waiting_since.lock().unwrap();
        since.values().map(|t| t.elapsed().as_millis() as u64).max().unwrap_or(0)
    }

    pub(super) fn status(&self) -> QueueStatus {
        let rates = *self.rates.lock().unwrap();
        QueueStatus {
            device: self.lane,
            waiting: self.waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            capacity: self.capacity,
            failover_room: self.failover_room.load(Ordering::Relaxed),
            concurrency: self.concurrency.load(Ordering::Relaxed),
            oldest_wait_ms: self.oldest_wait_ms(),
            estimated_delay_ms: self.estimated_delay_ms(),
            ms_per_token: rates.decode_ms_per_token,
            prefill_ms_per_token: rates.prefill_ms_per_token,
        }
    }
}

/// Queue depths and delays, for status, metrics and the UI.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueStatus {
    pub device: Lane,
    pub waiting: usize,
    pub running: usize,
    /// How many admitted requests may wait here.
    pub capacity: usize,
    /// Places beyond `capacity` kept for requests failing over from the GPU.
    pub failover_room: usize,
    pub concurrency: usize,
    /// How long the oldest waiting request has waited.
    pub oldest_wait_ms: u64,
    pub estimated_delay_ms: Option<u64>,
    /// Measured decode milliseconds per token (EWMA).
    pub ms_per_token: Option<f64>,
    pub prefill_ms_per_token: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_config_reads_its_table_and_rejects_typos() {
        let q = QueueConfig::from_toml("[queues]\ncpu_queue_capacity = 3\n").unwrap();
        assert_eq!((q.gpu_queue_capacity, q.cpu_queue_capacity), (64, 3));
        assert!(QueueConfig::from_toml("[queues]\ncpu_queue = 3\n").unwrap_err().to_string().contains("cpu_queue"));
    }

    #[tokio::test]
    async fn a_lane_resized_by_settings_gives_and_takes_back_slots() {
        let lane = Arc::new(LaneQueue::new(Lane::Cpu, 4, 1));
        let running = lane.slots.acquire().await.unwrap();
        lane.resize(3);
        assert_eq!(lane.slots.available_permits(), 2, "two more slots at once");
        lane.resize(1);
        // Taken back as they free: the running request keeps its slot until it ends.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(lane.slots.available_permits(), 0);
        drop(running);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(lane.slots.available_permits(), 1);
        assert_eq!(lane.status().concurrency, 1);
    }

    #[test]
    fn lane_delay_comes_from_measured_rates_and_the_work_ahead() {
        let lane = LaneQueue::new(Lane::Cpu, 4, 1);
        assert_eq!(lane.estimated_delay_ms(), None, "nothing measured yet");
        lane.observe(100, 100.0, 100, 1000.0); // 1 ms a prompt token, 10 ms a new token
        assert_eq!(lane.estimated_delay_ms(), Some(0), "a free slot: no wait");
        lane.running.store(1, Ordering::SeqCst);
        lane.join("a", 200, 300);
        assert_eq!(lane.estimated_delay_ms(), Some(200 + 3000));
        lane.observe(0, 0.0, 100, 2000.0); // decode EWMA moves a fifth of the way to 20 ms
        assert_eq!(lane.estimated_delay_ms(), Some(200 + 3600));
        lane.leave(200, 300);
        assert_eq!(lane.estimated_delay_ms(), Some(0), "nothing ahead");
    }
}
