//! The request path: admission into a lane (checking every lane the request may land on),
//! launch, the run with failover through the CPU queue, and completion.

use super::*;

impl Dispatcher {
    /// Accepts a request: journals it, admits it to a queue and starts it. Returns once it is
    /// durably accepted (or refused); the ticket then streams its tokens and its end.
    pub fn submit(&self, sub: Submission) -> Result<Ticket, SubmitError> {
        self.check_lanes(&sub)?;
        let body = serde_json::to_value(StoredBody { run: sub.run.clone(), allow: sub.allow })
            .map_err(|e| SubmitError::Invalid(e.to_string()))?;
        let accepted = self
            .inner
            .journal
            .accept(&NewRequest {
                id: sub.run.request_id.clone(),
                idempotency_key: sub.idempotency_key.clone(),
                body_hash: sub.body_hash.clone(),
                body,
                stream: sub.stream,
                allow_resume: sub.run.allow_resume,
            })
            .map_err(|e| match e {
                JournalError::KeyConflict { .. } => SubmitError::Conflict(e.to_string()),
                e => SubmitError::Journal(e),
            })?;
        match accepted {
            Accepted::New => self.launch(sub, 1),
            Accepted::Existing(record) => {
                let (_tx, events) = mpsc::unbounded_channel();
                let running = self.inner.in_flight.lock().unwrap().get(&record.request.id).map(|f| f.done.clone());
                if let Some(done) = running {
                    // Attach to the running request: its end, not its token stream (that belongs to
                    // the first client); this ticket never cancels it.
                    return Ok(Ticket {
                        request_id: record.request.id,
                        device_queue: None,
                        admission: "attached to the running request with this Idempotency-Key".into(),
                        events,
                        done,
                        cancel: None,
                    });
                }
                let finished = match record.state {
                    RequestState::Completed => {
                        let mut c: Completion = record
                            .result
                            .clone()
                            .and_then(|r| serde_json::from_value(r).ok())
                            .ok_or_else(|| SubmitError::Failed { reason: "stored result unreadable".into(), resumable: true })?;
                        c.from_journal = true;
                        Ok(c)
                    }
                    RequestState::Cancelled => Err(Ended::Cancelled),
                    _ => Err(Ended::Failed {
                        reason: record.error.clone().unwrap_or_else(|| format!("request {} ended {:?}", record.request.id, record.state)),
                        resumable: true,
                    }),
                };
                let (_done_tx, done) = watch::channel(Some(finished));
                Ok(Ticket {
                    request_id: record.request.id,
                    device_queue: None,
                    admission: "the stored end of the request with this Idempotency-Key".into(),
                    events,
                    done,
                    cancel: None,
                })
            }
        }
    }

    /// Refuses up front a request that could not finish on every lane it may land on: a
    /// request that may run on the CPU worker (sent there, or failing over there when the GPU
    /// fails) must fit that worker's context limit, its own setting or its fallback model's.
    pub(super) fn check_lanes(&self, sub: &Submission) -> Result<(), SubmitError> {
        let s = &self.inner.supervisor;
        let request = &sub.run.request;
        let gpu = s.config().gpu.is_some();
        // A client that opted out of the CPU runs on the GPU only, without failover.
        if (gpu && !sub.allow.cpu) || self.has_defect(Defect::NoCpuLaneCheck) {
            return Ok(());
        }
        // A fallback model renders and tokenizes the client's prompt itself: count what it will.
        let own = match s.fallback_bundle().filter(|_| !self.has_defect(Defect::FallbackCountedAsServed)) {
            Some(fallback) => fallback.own_request(request).map_err(|e| SubmitError::Invalid(format!("the CPU worker's fallback model, where this request would continue if the GPU failed, cannot read its prompt ({e}); send \"headroom\": {{\"allow_cpu\": false}} to run it on the GPU only, without failover")))?,
            None => None,
        };
        let prompt = own.as_ref().map_or(request.prompt_tokens.len(), |own| own.prompt_tokens.len());
        let needed = prompt + request.max_tokens;
        let setup = s.cpu_setup();
        let worker = s.cpu_worker();
        let Some(context) = worker.as_ref().map(|w| w.ready.context_tokens as usize).or(setup.options.max_context_tokens.map(|c| c as usize)) else {
            return Ok(());
        };
        if needed <= context {
            return Ok(());
        }
        let limit = match (&setup.fallback_model_dir, &worker) {
            (Some(_), Some(w)) => format!("the CPU worker's context limit of {context} tokens (its fallback model {}, and the setting cpu_max_context_tokens)", w.ready.model_name),
            _ => format!("the CPU worker's context limit of {context} tokens (the setting cpu_max_context_tokens)"),
        };
        let max_tokens = request.max_tokens;
        let prompt = if own.is_some() { format!("{prompt} tokens as the fallback model counts it") } else { format!("{prompt} tokens") };
        Err(SubmitError::Invalid(if gpu {
            format!(
                "the prompt ({prompt}) plus max_tokens ({max_tokens}) needs {needed} tokens, more than {limit}, where this request would continue if the GPU failed; lower max_tokens or shorten the prompt, or send \"headroom\": {{\"allow_cpu\": false}} to run it on the GPU only, without failover"
            )
        } else {
            format!("the prompt ({prompt}) plus max_tokens ({max_tokens}) needs {needed} tokens, more than {limit}; lower max_tokens or shorten the prompt, or raise cpu_max_context_tokens in Settings")
        }))
    }

    /// Admission's decision for a request of `shape`, with its GPU memory granted in the same
    /// step (so concurrent admissions see each other), and the GPU queue's expected delay.
    fn admit(&self, id: &str, shape: RequestShape, allow: Allowances) -> (Admission, Option<Reservation>, Option<u64>) {
        let _deciding = self.inner.gpu_grant.lock().unwrap();
        let gpu_budget = self.gpu_budget();
        // An unloaded model serves after its load: the last load's time is added.
        let load_ms = self.inner.supervisor.gpu_load_estimate_ms().map(|ms| ms.round() as u64);
        let gpu_eta = match (self.inner.gpu.estimated_delay_ms(), load_ms) {
            (Some(queue), Some(load)) => Some(queue + load),
            (queue, None) => queue,
            (None, load) => load,
        };
        let paused = self.inner.supervisor.gpu_paused() && self.gpu_configured();
        let planner = self.planner();
        let decide = |host: &Budget| {
            if paused {
                planner.decide_without_gpu("the GPU is paused in settings", shape, allow, host)
            } else {
                planner.decide(shape, allow, gpu_budget.as_ref(), host, |_| gpu_eta)
            }
        };
        let (mut admission, mut drop_cache) = headroom_memory::decide_dropping(&self.host_budget(), self.cpu_prefix_cache_bytes(), decide);
        // On a GPU shared with other models, an idle one may make way before the CPU is chosen.
        if !paused && self.gpu_configured() && !matches!(admission, Admission::Gpu { .. } | Admission::Shrink { .. }) {
            let needs = planner.footprint(shape).request_bytes();
            if self.evict_for(needs) {
                let gpu_budget = self.gpu_budget();
                (admission, drop_cache) = headroom_memory::decide_dropping(&self.host_budget(), self.cpu_prefix_cache_bytes(), |host: &Budget| planner.decide(shape, allow, gpu_budget.as_ref(), host, |_| gpu_eta));
            }
        }
        if drop_cache {
            self.drop_cpu_prefix_cache(id);
        }
        let gpu_grant = match &admission {
            Admission::Gpu { .. } | Admission::Shrink { .. } => {
                let max_tokens = match &admission {
                    Admission::Shrink { max_tokens, .. } => *max_tokens,
                    _ => shape.max_tokens,
                };
                let bytes = self.planner().footprint(RequestShape { max_tokens, ..shape }).request_bytes();
                self.inner.gpu_ledger.try_reserve(id, bytes).ok()
            }
            // A queued request is granted its memory when it leaves the queue.
            _ => None,
        };
        (admission, gpu_grant, gpu_eta)
    }

    /// Decides where the request goes and starts it there (attempt `attempt`).
    pub(super) fn launch(&self, mut sub: Submission, attempt: u32) -> Result<Ticket, SubmitError> {
        let id = sub.run.request_id.clone();
        let shape = RequestShape::of(&sub.run.request);
        let (admission, gpu_grant, gpu_eta) = self.admit(&id, shape, sub.allow);
        let refuse = |reason: String, retry_after_s: Option<u64>, estimated_delay_ms: Option<u64>| -> SubmitError {
            self.count_end("none", "refused");
            if let Err(e) = self.journal_step(&id, &Transition::Refused { reason: reason.clone() }) {
                return SubmitError::Journal(e);
            }
            SubmitError::Capacity { reason, retry_after_s, estimated_delay_ms }
        };
        let on_gpu = match &admission {
            Admission::Gpu { .. } | Admission::Queue { .. } => true,
            Admission::Shrink { max_tokens, .. } => {
                sub.run.request.max_tokens = *max_tokens as usize;
                true
            }
            Admission::Cpu { .. } => false,
            Admission::Refuse { reason, retry_after_s } => return Err(refuse(reason.clone(), *retry_after_s, gpu_eta)),
        };
        let lane = if on_gpu { &self.inner.gpu } else { &*self.inner.cpu };
        if let Some(too_slow) = outlasts_client(lane, shape, sub.allow.max_wait_ms) {
            return Err(refuse(too_slow.reason, Some(too_slow.retry_after_s), too_slow.estimated_delay_ms));
        }
        let shape = RequestShape { max_tokens: sub.run.request.max_tokens as u64, ..shape };
        let host_reservation = match self.enter_lane(lane, &id, shape) {
            Ok(r) => r,
            Err(LaneRefusal { reason, retry_after_s, estimated_delay_ms }) => return Err(refuse(reason, Some(retry_after_s), estimated_delay_ms)),
        };
        if let Err(e) = self.journal_step(&id, &Transition::Queued { device: lane.lane }) {
            lane.forget(&id);
            lane.leave(shape.prompt_tokens, shape.max_tokens);
            self.queue_changed(lane);
            return Err(SubmitError::Journal(e));
        }

        let (event_tx, events) = mpsc::unbounded_channel();
        let (done_tx, done) = watch::channel(None);
        let cancel = CancelSignal::new();
        self.inner.in_flight.lock().unwrap().insert(id.clone(), InFlight { done: done.clone(), cancel: cancel.clone() });
        let this = self.clone();
        let task_cancel = cancel.clone();
        let ticket_id = id.clone();
        let reason = admission.reason().to_string();
        let ticket_admission = reason.clone();
        let start = Start { attempt, on_gpu, gpu_grant, host_reservation, admission: reason };
        self.inner.supervisor.touch_gpu();
        tokio::spawn(async move {
            let result = this.execute(sub, start, task_cancel, event_tx).await;
            // The model's keep_alive counts from the end of its last request.
            this.inner.supervisor.touch_gpu();
            this.inner.in_flight.lock().unwrap().remove(&id);
            done_tx.send_replace(Some(result));
        });
        Ok(Ticket { request_id: ticket_id, device_queue: Some(lane.lane), admission: ticket_admission, events, done, cancel: Some(cancel) })
    }

    /// Puts a request in `lane`'s bounded queue: a full queue is a refusal now, never unbounded
    /// growth, and the CPU path also reserves host RAM for the request's footprint for as long
    /// as it runs (returned; dropping it gives the RAM back).
    pub(super) fn enter_lane(&self, lane: &LaneQueue, id: &str, shape: RequestShape) -> Result<Option<Reservation>, LaneRefusal> {
        // Take a place only if one is free: an add-then-undo would show a full queue one over
        // its capacity to every reader (status, metrics) in between.
        let took = lane.waiting.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| (w < lane.capacity).then_some(w + 1));
        if took.is_err() {
            let delay = lane.estimated_delay_ms();
            return Err(LaneRefusal {
                reason: format!(
                    "the {} queue is full ({} waiting){}; retry later",
                    lane.lane,
                    lane.capacity,
                    delay.map(|d| format!(", estimated delay {d} ms")).unwrap_or_default()
                ),
                retry_after_s: delay.map(|d| d.div_ceil(1000)).unwrap_or(1).max(1),
                estimated_delay_ms: delay,
            });
        }
        // The CPU path holds the request in host RAM; so does a split GPU worker, for the
        // layers its CPU part runs.
        let host_bytes = match lane.lane {
            Lane::Cpu => Some((self.planner().host_footprint(shape).request_bytes(), "the CPU path")),
            Lane::Gpu => self.planner().split_host_footprint(shape).map(|f| (f.request_bytes(), "the split model's CPU layers")),
        };
        let host_reservation = match host_bytes {
            Some((bytes, what)) => match self.inner.host_ledger().try_reserve(id, bytes) {
                Ok(r) => Some(r),
                Err(e) => {
                    lane.waiting.fetch_sub(1, Ordering::SeqCst);
                    return Err(LaneRefusal { reason: format!("not enough host RAM for {what}: {e}"), retry_after_s: 5, estimated_delay_ms: None });
                }
            },
            None => None,
        };
        lane.join(id, shape.prompt_tokens, shape.max_tokens);
        self.queue_changed(lane);
        Ok(host_reservation)
    }

    /// A request that leaves the GPU (its device failed, or its memory never came) joins the CPU
    /// queue behind the requests already there, in the place kept for it (`failover_room`), so
    /// it is never refused for a full queue and never meets a busy CPU worker. It is told why
    /// it waits and for about how long, and it holds host RAM for its footprint from here on
    /// (waiting for it if the host is short, cancellable).
    pub(super) async fn join_cpu_after_gpu(&self, id: &str, shape: RequestShape, cancel: &CancelSignal, events: &mpsc::UnboundedSender<StreamEvent>, why: &str) -> Result<Reservation, Ended> {
        let lane = &*self.inner.cpu;
        if lane.waiting.load(Ordering::SeqCst) + 1 > lane.capacity + lane.failover_room.load(Ordering::SeqCst) {
            tracing::error!(request_id = id, "the CPU queue holds more than its capacity and failover room; the GPU lane outgrew its bound");
        }
        self.join_queue(lane, id, shape, events, why)?;
        let bytes = self.planner().host_footprint(shape).request_bytes();
        loop {
            match self.inner.host_ledger().try_reserve(id, bytes) {
                Ok(r) => return Ok(r),
                Err(e) => tracing::warn!(request_id = id, error = %e, "failover waits for host RAM"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = cancel.cancelled() => {
                    lane.forget(id);
                    return Err(self.end_in_queue(lane, id, shape.prompt_tokens, shape.max_tokens, Ended::Cancelled));
                }
            }
        }
    }

    /// A request that ran moves into `lane`'s queue (told to the client and journaled) for its
    /// next attempt.
    pub(super) fn join_queue(&self, lane: &LaneQueue, id: &str, shape: RequestShape, events: &mpsc::UnboundedSender<StreamEvent>, why: &str) -> Result<(), Ended> {
        let ahead = lane.waiting.fetch_add(1, Ordering::SeqCst) + lane.running.load(Ordering::SeqCst);
        lane.join(id, shape.prompt_tokens, shape.max_tokens);
        self.queue_changed(lane);
        let _ = events.send(StreamEvent::Waiting(WaitNotice { queue: lane.lane, reason: why.to_string(), ahead, estimated_delay_ms: lane.estimated_delay_ms() }));
        if let Err(e) = self.journal_step(id, &Transition::Queued { device: lane.lane }) {
            lane.forget(id);
            return Err(self.end_in_queue(lane, id, shape.prompt_tokens, shape.max_tokens, journal_failure(&e)));
        }
        Ok(())
    }

    /// Ends a request that never left `lane`'s queue: frees its place, journals why (a queued
    /// request fails only for capacity), counts it.
    pub(super) fn end_in_queue(&self, lane: &LaneQueue, id: &str, prompt_tokens: u64, max_tokens: u64, ended: Ended) -> Ended {
        lane.leave(prompt_tokens, max_tokens);
        let (transition, outcome) = match &ended {
            Ended::Cancelled => (Transition::Cancelled { reason: "cancelled while queued".into() }, "cancelled"),
            Ended::Failed { reason, resumable } => (Transition::Failed { kind: EndCause::Capacity, detail: reason.clone(), resumable: *resumable }, "failed"),
        };
        let _ = self.journal_step(id, &transition);
        self.count_end(lane.lane.as_str(), outcome);
        self.queue_changed(lane);
        ended
    }

    /// Journals and counts a finished request.
    pub(super) fn completed(&self, sub: &Submission, mut outcome: RunOutcome, on_gpu: bool, admission: String, queued_ms: f64, started: Instant) -> Result<Completion, Ended> {
        let inner = &self.inner;
        let id = &sub.run.request_id;
        // Admission (or a wait for GPU memory) may have sent it to the CPU: slower than the
        // client would expect, so say so.
        let degraded = degradation(&inner.supervisor.status(), !on_gpu, outcome.failovers.last(), Some(&admission), self.cpu_slower_by());
        outcome.degraded = degraded.is_some();
        outcome.degraded_reason = degraded.as_ref().map(|d| d.reason.clone());
        outcome.degraded_summary = degraded.map(|d| d.summary);
        let finishing_lane = if outcome.device == Device::Cpu { &*inner.cpu } else { &inner.gpu };
        if outcome.failovers.is_empty() {
            let total_ms = started.elapsed().as_secs_f64() * 1000.0;
            // The prompt tokens it computed: those a prefix cache held took no prefill time.
            let computed = outcome.prompt_tokens.saturating_sub(outcome.cached_prompt_tokens);
            finishing_lane.observe(computed, outcome.prefill_ms, outcome.completion_tokens, (total_ms - outcome.prefill_ms).max(0.0));
        }
        let metrics = &inner.metrics;
        metrics.requests.get_or_create(&OutcomeLabels { device: outcome.device.label(), outcome: "completed".into() }).inc();
        metrics.generated_tokens.get_or_create(&crate::metrics::device(&outcome.device.label())).inc_by(outcome.completion_tokens as u64);
        if sub.stream {
            let written = inner.journal.record_delivered(id, outcome.tokens.len() as u32);
            if let Err(e) = self.journal_written(id, written) {
                return Err(journal_failure(&e));
            }
        }
        let completion = Completion { outcome, admission, queued_ms, from_journal: false, cpu_failover: sub.allow.cpu, load_ms: 0.0 };
        let stored = serde_json::to_value(&completion).unwrap_or_default();
        self.journal_step(id, &Transition::Completed { device: completion.outcome.device, result: stored }).map_err(|e| journal_failure(&e))?;
        Ok(completion)
    }
}

/// How a request starts executing (from admission, or after a restart).
pub(super) struct Start {
    pub(super) attempt: u32,
    pub(super) on_gpu: bool,
    pub(super) gpu_grant: Option<Reservation>,
    pub(super) host_reservation: Option<Reservation>,
    pub(super) admission: String,
}

/// A client that said how long it waits gets a capacity error now rather than a reply after it
/// gave up: the expected wait in `lane` plus the generation time, from measured rates.
fn outlasts_client(lane: &LaneQueue, shape: RequestShape, max_wait_ms: Option<u64>) -> Option<LaneRefusal> {
    let run_ms = lane.expected_run_ms(shape.prompt_tokens, shape.max_tokens)?;
    let (limit, delay) = (max_wait_ms?, lane.estimated_delay_ms()?);
    let expected = delay + run_ms.round() as u64;
    (expected > limit).then(|| LaneRefusal {
        reason: format!(
            "expected to take about {expected} ms on the {} ({delay} ms waiting, then {run_ms:.0} ms for {} prompt and up to {} new tokens at measured rates), more than the client's {limit} ms timeout",
            lane.lane, shape.prompt_tokens, shape.max_tokens
        ),
        retry_after_s: delay.div_ceil(1000).max(1),
        estimated_delay_ms: Some(delay),
    })
}
