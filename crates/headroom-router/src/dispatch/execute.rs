//! Running an admitted request from its queue to its end: a slot in its lane (and on the GPU its
//! memory), an attempt, and on a GPU failure the failover journaled at once and the request moved
//! into the CPU queue for its next attempt; a request preempted on the GPU that may not use the
//! CPU waits in the GPU queue instead.

use tokio::sync::SemaphorePermit;

use super::*;

/// A request's state across its attempts.
struct Execution {
    id: String,
    shape: RequestShape,
    attempt: u32,
    on_gpu: bool,
    gpu_grant: Option<Reservation>,
    /// The host RAM of the CPU path, held until the request ends.
    host: Option<Reservation>,
    /// Why it runs where it runs (admission's reason, or why it left the GPU).
    admission: String,
    progress: Progress,
    queued_ms: f64,
    /// Time spent waiting for the model to load on the GPU (after a keep_alive unload).
    load_ms: f64,
    /// Defect::FailoverBypassesCpuQueue: the next attempt takes no slot.
    skip_slot: bool,
    /// Preempted on the GPU, back in its queue: it waits for memory as long as it takes (the
    /// requests before it give their blocks back as they end), not the queue's limit.
    preempted: bool,
}

impl Dispatcher {
    /// Runs a request from its queue to its end: waits for a slot in its lane (and, on the GPU,
    /// for its memory), runs an attempt, and when the GPU fails it, journals the failover at
    /// once and moves it into the CPU queue for its next attempt (replay, or resume after the
    /// tokens already delivered).
    pub(super) async fn execute(&self, sub: Submission, start: Start, cancel: CancelSignal, events: mpsc::UnboundedSender<StreamEvent>) -> Result<Completion, Ended> {
        let Start { attempt, on_gpu, gpu_grant, host_reservation, admission } = start;
        let shape = RequestShape::of(&sub.run.request);
        let mut x = Execution {
            id: sub.run.request_id.clone(),
            shape,
            attempt,
            on_gpu,
            gpu_grant,
            host: host_reservation,
            admission,
            progress: Progress::default(),
            queued_ms: 0.0,
            load_ms: 0.0,
            skip_slot: false,
            preempted: false,
        };
        loop {
            let lane = if x.on_gpu { &self.inner.gpu } else { &*self.inner.cpu };
            let queued_at = Instant::now();
            let permit = self.take_slot(lane, &mut x, &cancel).await?;
            // A model unloaded after its keep_alive loads again for the request that needs it,
            // which waits here holding its GPU slot: an unload is not a reason to go to the CPU.
            if x.on_gpu && !self.has_defect(Defect::UnloadedModelRedirects) {
                // On a shared GPU the memory comes back when the models that made way are gone.
                if self.inner.supervisor.gpu_unloaded() {
                    self.wait_for_departures(&cancel).await;
                }
                if let Some(waited) = self.inner.supervisor.load_gpu(&cancel).await {
                    x.load_ms += waited.as_secs_f64() * 1000.0;
                }
            }
            // A request queued for the GPU starts only when its memory is there: a free slot is
            // not free memory. If it does not come within the queue wait, or the GPU goes away,
            // the request moves to the CPU queue.
            if x.on_gpu && x.gpu_grant.is_none() {
                match self.wait_for_gpu_memory(&sub, queued_at, x.preempted, &cancel).await {
                    GpuWait::Run(grant) => x.gpu_grant = grant,
                    GpuWait::Cancelled => return Err(self.end_in_queue(lane, &x.id, shape.prompt_tokens, shape.max_tokens, Ended::Cancelled)),
                    GpuWait::Leave { why, cpu_allowed: false } => {
                        let reason = format!("{why}, and CPU fallback is not allowed");
                        return Err(self.end_in_queue(lane, &x.id, shape.prompt_tokens, shape.max_tokens, Ended::Failed { reason, resumable: true }));
                    }
                    GpuWait::Leave { why, cpu_allowed: true } => {
                        drop(permit);
                        lane.leave(shape.prompt_tokens, shape.max_tokens);
                        self.queue_changed(lane);
                        x.queued_ms += queued_at.elapsed().as_secs_f64() * 1000.0;
                        // A split's host share is released before the CPU path's is awaited.
                        x.host = None;
                        x.host = Some(self.join_cpu_after_gpu(&x.id, shape, &cancel, &events, &why).await?);
                        x.admission = why;
                        x.on_gpu = false;
                        continue;
                    }
                }
            }
            x.queued_ms += queued_at.elapsed().as_secs_f64() * 1000.0;
            let (result, started) = self.run_attempt(&sub, lane, &mut x, &cancel, &events).await;
            drop(permit);
            match result? {
                Ok(outcome) => {
                    let load_ms = x.load_ms;
                    return self.completed(&sub, outcome, x.on_gpu, x.admission, x.queued_ms, started).map(|c| Completion { load_ms, ..c });
                }
                Err(AttemptError::GpuFailed { from, kind, reason, resumed_after_tokens }) => {
                    self.fail_over(&sub, lane, &mut x, (from, kind, reason, resumed_after_tokens), &cancel, &events).await?
                }
                Err(AttemptError::End(e)) => return Err(self.attempt_ended(&x.id, lane, e)),
            }
        }
    }

    /// Waits for a slot in `lane` (fair: first come, first served), or for the cancel.
    async fn take_slot<'a>(&self, lane: &'a LaneQueue, x: &mut Execution, cancel: &CancelSignal) -> Result<Option<SemaphorePermit<'a>>, Ended> {
        if std::mem::take(&mut x.skip_slot) {
            lane.forget(&x.id);
            return Ok(None);
        }
        let permit = tokio::select! {
            p = lane.slots.acquire() => p.ok(),
            _ = cancel.cancelled() => None,
        };
        lane.forget(&x.id);
        match permit {
            Some(permit) => Ok(Some(permit)),
            None => Err(self.end_in_queue(lane, &x.id, x.shape.prompt_tokens, x.shape.max_tokens, Ended::Cancelled)),
        }
    }

    /// One attempt in `lane`, journaled as running; the lane's counts follow it. Returns the
    /// attempt's result (or the journal failure that ends the request) and when it started.
    async fn run_attempt(
        &self,
        sub: &Submission,
        lane: &LaneQueue,
        x: &mut Execution,
        cancel: &CancelSignal,
        events: &mpsc::UnboundedSender<StreamEvent>,
    ) -> (Result<Result<RunOutcome, AttemptError>, Ended>, Instant) {
        let inner = &self.inner;
        let id = &x.id;
        lane.running.fetch_add(1, Ordering::SeqCst);
        self.queue_changed(lane);
        let leave_lane = || {
            lane.running.fetch_sub(1, Ordering::SeqCst);
            lane.leave(x.shape.prompt_tokens, x.shape.max_tokens);
            self.queue_changed(lane);
        };
        let device = if x.on_gpu { inner.supervisor.config().gpu.as_ref().map_or(Device::Cpu, |g| g.device) } else { Device::Cpu };
        if let Err(e) = self.journal_step(id, &Transition::Running { device, attempt: x.attempt }) {
            leave_lane();
            self.count_end(lane.lane.as_str(), "failed");
            return (Err(journal_failure(&e)), Instant::now());
        }
        let started = Instant::now();
        let mut first = sub.stream;
        let mut journal_broke: Option<JournalError> = None;
        let target = if x.on_gpu { Target::Gpu } else { Target::Cpu };
        let result = inner
            .supervisor
            .attempt(&sub.run, target, &mut x.progress, cancel, &mut |t: &StreamedToken| {
                if first {
                    first = false;
                    // From here on a replay from the start would show the client text twice.
                    let written = inner.journal.record_delivered(id, 1);
                    if let Err(e) = self.journal_written(id, written) {
                        journal_broke = Some(e);
                        cancel.cancel();
                    }
                }
                let _ = events.send(StreamEvent::Token(t.clone()));
            })
            .await;
        drop(x.gpu_grant.take());
        leave_lane();
        if let Some(e) = journal_broke {
            self.count_end(lane.lane.as_str(), "failed");
            return (Err(journal_failure(&e)), started);
        }
        (Ok(result), started)
    }

    /// The GPU failed the request: journal the failover at once, then move the request into the
    /// CPU queue (its failover room) for the next attempt — unless it does not allow the CPU: then
    /// a preempted request goes back to the GPU queue, and any other failure ends it.
    async fn fail_over(
        &self,
        sub: &Submission,
        lane: &LaneQueue,
        x: &mut Execution,
        (from, kind, reason, resumed_after_tokens): (Device, FailureKind, String, u32),
        cancel: &CancelSignal,
        events: &mpsc::UnboundedSender<StreamEvent>,
    ) -> Result<(), Ended> {
        let metrics = &self.inner.metrics;
        // A preemption is the GPU making room, not failing: a request that may not use the CPU
        // waits in the GPU queue for the blocks the requests before it give back as they end,
        // and resumes there from its checkpoint.
        let back_to_gpu = kind == FailureKind::Preempted && !sub.allow.cpu && !self.has_defect(Defect::PreemptedGpuOnlyEnds);
        let to = if back_to_gpu { from } else { Device::Cpu };
        if !back_to_gpu {
            metrics.failovers.get_or_create(&FailoverLabels { from: from.label(), to: to.label() }).inc();
        }
        if resumed_after_tokens > 0 { metrics.resumes.inc() } else { metrics.replays.inc() };
        if kind == FailureKind::Preempted {
            metrics.preemptions.inc();
        }
        x.attempt += 1;
        let next = if resumed_after_tokens > 0 {
            Transition::Resumed { to, attempt: x.attempt, after_tokens: resumed_after_tokens }
        } else {
            Transition::Replayed { to, attempt: x.attempt }
        };
        let journaled = self.journal_step(&x.id, &Transition::AttemptFailed { device: from, kind, detail: reason.clone() }).and_then(|()| self.journal_step(&x.id, &next));
        if let Err(e) = journaled {
            self.count_end(lane.lane.as_str(), "failed");
            return Err(journal_failure(&e));
        }
        if back_to_gpu {
            x.preempted = true;
            return self.join_queue(lane, &x.id, x.shape, events, &reason);
        }
        if !sub.allow.cpu {
            let detail = format!("{reason}; the request does not allow the CPU (allow_cpu: false), so it ends here; retry it");
            let _ = self.journal_step(&x.id, &Transition::Failed { kind: EndCause::Worker, detail: detail.clone(), resumable: true });
            self.count_end(lane.lane.as_str(), "failed");
            return Err(Ended::Failed { reason: detail, resumable: true });
        }
        x.on_gpu = false;
        // Test-only, also from the environment for end-to-end controls.
        if self.has_defect(Defect::FailoverBypassesCpuQueue) || headroom_model::test_defect("failover-bypasses-cpu-queue") {
            self.inner.cpu.waiting.fetch_add(1, Ordering::SeqCst);
            self.inner.cpu.join(&x.id, x.shape.prompt_tokens, x.shape.max_tokens);
            x.skip_slot = true;
            return Ok(());
        }
        x.host = None;
        x.host = Some(self.join_cpu_after_gpu(&x.id, x.shape, cancel, events, &reason).await?);
        Ok(())
    }

    /// The attempt ended the request (cancelled, invalid, interrupted, a CPU failure): journal
    /// why and count it.
    fn attempt_ended(&self, id: &str, lane: &LaneQueue, e: Error) -> Ended {
        if let Error::Cancelled = e {
            let _ = self.journal_step(id, &Transition::Cancelled { reason: "cancelled while running".into() });
            self.count_end(lane.lane.as_str(), "cancelled");
            return Ended::Cancelled;
        }
        let resumable = matches!(e, Error::Interrupted { .. } | Error::Worker(_) | Error::Unavailable(_));
        let kind = match &e {
            Error::Interrupted { .. } => EndCause::Interrupted,
            Error::Invalid(_) => EndCause::Invalid,
            _ => EndCause::Worker,
        };
        let detail = e.to_string();
        let _ = self.journal_step(id, &Transition::Failed { kind, detail: detail.clone(), resumable });
        self.count_end(lane.lane.as_str(), "failed");
        Ended::Failed { reason: detail, resumable }
    }
}
