//! One plan: signal first (local record, then the signal), protect / Event / hooks beside it, the
//! ack wait, the drain, and the acknowledgement after a complete drain only.

use super::*;
use crate::checkpoint::run::{self as ckpt, CheckpointRequest, Prior, Signalled};
use crate::checkpoint::Outcome;

/// A retryable drain failure (API server unreachable, 5xx) is retried after this step, jittered
/// by `crate::backoff`, while the deadline allows.
const DRAIN_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Upper bound of one step beside the signal (protect, Event, annotation): a quarter of the time
/// left, between 1 s and 10 s.
pub(super) const SIDE_BUDGET_MAX: Duration = Duration::from_secs(10);
pub(super) const SIDE_BUDGET_MIN: Duration = Duration::from_secs(1);

pub(super) fn side_budget(deadline: Timestamp, now: Timestamp) -> Duration {
    (duration::until(deadline, now) / 4).clamp(SIDE_BUDGET_MIN, SIDE_BUDGET_MAX)
}

/// One plan in progress.
pub(super) struct Plan {
    pub(super) seq: u64,
    pub(super) finished_tx: mpsc::UnboundedSender<u64>,
    pub(super) cfg: ResponderConfig,
    pub(super) deps: Arc<Deps>,
    pub(super) records: Records,
    pub(super) events: broadcast::Sender<PlanEvent>,
    pub(super) notice: Notice,
    pub(super) deadline: watch::Receiver<Timestamp>,
    pub(super) cancel: CancellationToken,
    pub(super) expired_tx: mpsc::Sender<String>,
    /// The notice is a fixed id seen again after its cancel: nobody was signalled for this
    /// occurrence yet, whatever `notice.json` says (it names the earlier one).
    pub(super) reoccurred: bool,
}

/// What the steps beside the signal produced.
pub(super) struct SideResult {
    pub(super) applied: Option<Applied>,
}

impl Plan {
    pub(super) async fn run(self, resume: Option<(PlanState, Vec<RecordedTarget>)>) {
        let (seq, finished) = (self.seq, self.finished_tx.clone());
        self.run_steps(resume).await;
        let _ = finished.send(seq);
    }

    pub(super) async fn run_steps(mut self, resume: Option<(PlanState, Vec<RecordedTarget>)>) {
        let Some(steps) = steps_for(&self.notice, &self.cfg) else {
            info!("policy says ignore: logged only");
            return;
        };
        let active = OutcomeLabels {
            outcome: self.notice.kind.label().into(),
        };
        self.deps
            .metrics
            .notice_active
            .get_or_create(&active)
            .set(1);
        if self.notice.kind == NoticeKind::Interruption {
            self.deps
                .metrics
                .deadline
                .set(self.deadline().as_second() as f64);
        }
        let (resume, targets) = match resume {
            Some((state, targets)) => (Some(state), Some(targets)),
            None => (None, None),
        };
        let mut state = resume.unwrap_or_else(|| PlanState {
            id: self.notice.id.clone(),
            kind: self.notice.kind.clone(),
            source: self.notice.source,
            deadline: Some(*self.deadline.borrow()),
            phase: Phase::Detected,
            signalled_at: None,
            applied: Applied::default(),
            boot_id: self.deps.life.id(),
            restart: self.notice.restart,
            detail: self.notice.detail.clone(),
            failure: None,
            updated_at: Timestamp::now(),
        });
        // No separate record of `detected`: the notice is still in the metadata service after a
        // crash, and every write before the signal costs time.
        let result = self.steps(steps, &mut state, targets).await;
        self.deps
            .metrics
            .notice_active
            .get_or_create(&active)
            .set(0);
        match result {
            Ok(()) => {
                let _ = self.events.send(PlanEvent::Done {
                    id: self.notice.id.clone(),
                    at: Timestamp::now(),
                });
            }
            Err(why) => warn!("plan stopped: {why}"),
        }
    }

    pub(super) fn deadline(&self) -> Timestamp {
        *self.deadline.borrow()
    }

    pub(super) fn budget(&self) -> Duration {
        side_budget(self.deadline(), Timestamp::now())
    }

    pub(super) fn stamp(&self, state: &mut PlanState, phase: Phase) {
        state.phase = phase;
        state.deadline = Some(self.deadline());
        state.boot_id = self.deps.life.id();
        state.updated_at = Timestamp::now();
    }

    /// Both copies: the local record, then the Node annotation within the budget.
    pub(super) async fn persist(&self, state: &mut PlanState, phase: Phase) {
        self.stamp(state, phase);
        self.records.save(state, self.budget()).await;
    }

    /// Taint + cordon, the notice's Event, and (on a fresh plan) the start hooks, each bounded
    /// by the side budget. Never on the signal's path.
    pub(super) async fn protect_side(
        deps: Arc<Deps>,
        notice: Notice,
        deadline: Timestamp,
        steps: Steps,
        hooks: bool,
        budget: Duration,
    ) -> SideResult {
        let node = deps.node.clone();
        let protect = async {
            let effect = steps.taint?;
            let protection = Protection {
                taint_value: notice.kind.label().to_string(),
                effect,
                cordon: steps.cordon,
            };
            // One call: node ops retry conflicts and 5xx themselves, boundedly.
            let failure = match tokio::time::timeout(budget, node.protect(&protection)).await {
                Ok(Ok(mut applied)) => {
                    deps.metrics.action("protect", true);
                    if !hooks {
                        // A resumed plan: an earlier run may have protected the node and died
                        // before recording it. The node's own marks say what spotguard did.
                        if let Ok(Ok(marks)) =
                            tokio::time::timeout(budget, node.applied_marks()).await
                        {
                            merge_applied(&mut applied, Some(marks.for_protection(&protection)));
                        }
                    }
                    return Some(applied);
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {} ms", budget.as_millis()),
            };
            deps.metrics.action("protect", false);
            error!(error = %failure, "taint/cordon failed");
            let _ = tokio::time::timeout(
                budget,
                node.event(
                    EventType::Warning,
                    reason::CORDON_FAILED,
                    &format!("taint/cordon failed: {failure}"),
                ),
            )
            .await;
            None
        };
        let event = async {
            let msg = format!(
                "{} notice {} from {}: deadline {}; {}",
                notice.kind.label(),
                notice.id,
                notice.source,
                deadline,
                notice.detail
            );
            match tokio::time::timeout(
                budget,
                node.event(EventType::Warning, event_reason(&notice.kind), &msg),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    deps.metrics.error("responder", e.metric_label());
                    warn!(error = %e, "emitting node event failed");
                }
                Err(_) => {
                    deps.metrics.error("responder", "event_timeout");
                    warn!(
                        budget_ms = budget.as_millis() as u64,
                        "emitting node event ran out of its budget"
                    );
                }
            }
        };
        if hooks {
            for hook in &deps.on_start {
                hook(&notice);
            }
        }
        let (applied, ()) = tokio::join!(protect, event);
        SideResult { applied }
    }

    /// `targets`: a resumed plan's record, with the processes it lists as signalled.
    pub(super) async fn steps(
        &mut self,
        steps: Steps,
        state: &mut PlanState,
        targets: Option<Vec<RecordedTarget>>,
    ) -> Result<(), String> {
        let resumed = targets.is_some();
        // 1–2. Signal first; protect, Event and hooks beside it.
        if steps.checkpoint && state.phase < Phase::Checkpointed {
            self.checkpoint(state, steps, targets).await;
            self.persist(state, Phase::Checkpointed).await;
        } else if state.phase < Phase::Protected {
            let side = Self::protect_side(
                self.deps.clone(),
                self.notice.clone(),
                self.deadline(),
                steps,
                !resumed,
                self.budget(),
            )
            .await;
            merge_applied(&mut state.applied, side.applied);
            self.persist(state, Phase::Protected).await;
            let _ = self.events.send(PlanEvent::Protected {
                id: self.notice.id.clone(),
                at: Timestamp::now(),
            });
        }
        if self.cancel.is_cancelled() {
            return Err("cancelled".into());
        }

        if self.notice.kind == NoticeKind::Rebalance && !steps.drain {
            let _ = self.expired_tx.send(self.notice.id.clone()).await;
            return Ok(());
        }

        // 4. Drain.
        if steps.drain && state.phase < Phase::Drained && state.failure.is_none() {
            match self.drain().await? {
                Ok(report) => {
                    self.persist(state, Phase::Drained).await;
                    let _ = self.events.send(PlanEvent::Drained {
                        id: self.notice.id.clone(),
                        at: Timestamp::now(),
                        report,
                    });
                }
                Err(failure) => {
                    if let Some(report) = failure.report {
                        let _ = self.events.send(PlanEvent::Drained {
                            id: self.notice.id.clone(),
                            at: Timestamp::now(),
                            report,
                        });
                    }
                    let _ = self.events.send(PlanEvent::DrainFailed {
                        id: self.notice.id.clone(),
                        at: Timestamp::now(),
                        reason: failure.reason.clone(),
                    });
                    state.failure = Some(failure.reason);
                }
            }
        }

        // 5. Acknowledge (Azure) only after a complete drain, and finish.
        if state.phase < Phase::Done {
            if steps.drain && state.phase == Phase::Drained {
                self.acknowledge().await;
            } else if steps.drain {
                info!("drain did not complete: the cloud's event is not acknowledged");
            }
            self.persist(state, Phase::Done).await;
        }
        Ok(())
    }

    /// What is known about earlier deliveries of this notice (docs/checkpoint-protocol.md, "One
    /// signal per notice"): a resumed plan's record lists who was signalled; without a list (an
    /// older record) or with an unreadable record nothing lists them and `notice.json` decides,
    /// holding the targets whose `notice.json` cannot be read; a fresh plan with a readable
    /// record asks `notice.json` only.
    fn prior(&self, state: &PlanState, targets: Option<Vec<RecordedTarget>>) -> Prior {
        let signalled = match (state.signalled_at, targets) {
            (Some(_), Some(t)) if !t.is_empty() => {
                Signalled::Listed(t.iter().map(|t| (t.pid, t.start)).collect())
            }
            (Some(_), _) => Signalled::Unlisted,
            (None, _) if self.reoccurred => Signalled::Nobody,
            (None, _) if self.deps.local.was_unreadable() => Signalled::Unlisted,
            (None, _) => Signalled::Unrecorded,
        };
        Prior {
            life: self.deps.life.id(),
            signalled_at: state.signalled_at,
            signalled,
        }
    }

    pub(super) async fn checkpoint(
        &mut self,
        state: &mut PlanState,
        steps: Steps,
        targets: Option<Vec<RecordedTarget>>,
    ) {
        let resumed = targets.is_some();
        let groups = match self.deps.discovery.discover().await {
            Ok(g) => g,
            Err(e) => {
                error!(error = %e, "checkpoint target discovery failed");
                self.deps.metrics.error("checkpoint", e.metric_label());
                Vec::new()
            }
        };
        let now = Timestamp::now();
        // A rebalance recommendation has no deadline (its plan's "deadline" is the expiry): the
        // early checkpoint gets the full --checkpoint-timeout, with nothing reserved for a drain.
        let (bound, reserve) = if self.notice.kind == NoticeKind::Rebalance && !steps.drain {
            (
                duration::add(now, self.cfg.checkpoint_timeout),
                Duration::ZERO,
            )
        } else {
            (self.deadline(), self.cfg.reserve(self.notice.source))
        };
        let ck_deadline =
            duration::checkpoint_deadline(bound, now, reserve, self.cfg.checkpoint_timeout);
        let req = CheckpointRequest {
            notice_id: self.notice.id.clone(),
            source: self.notice.source.as_str().to_string(),
            kind: self.notice.kind.label().to_string(),
            deadline: Some(self.deadline()),
            checkpoint_deadline: ck_deadline,
            dry_run: self.cfg.dry_run,
        };
        if groups.is_empty() {
            info!("no checkpoint targets found");
        }
        let prior = self.prior(state, targets.clone());
        if let Some(at) = state.signalled_at {
            info!(signalled_at = %at, "signals were sent before a restart: the processes the record lists (or whose notice.json names the notice) are only waited for");
        }
        // The local record first (a file, no API call), listing every process about to be
        // signalled, so that a restart never signals one twice, even when notice.json cannot be
        // written.
        let mut listed: Vec<RecordedTarget> = targets.unwrap_or_default();
        for g in &groups {
            for c in &g.containers {
                for p in &c.processes {
                    let t = RecordedTarget {
                        pid: p.pid,
                        start: p.start_time,
                    };
                    if !listed.contains(&t) {
                        listed.push(t);
                    }
                }
            }
        }
        if state.signalled_at.is_none() {
            state.signalled_at = Some(Timestamp::now());
        }
        self.stamp(state, Phase::Signalled);
        if !self.cfg.dry_run {
            self.records.save_local_with_targets(state, listed).await;
        }
        // Protect, the Event and the start hooks run beside the signal.
        let side = tokio::spawn(Self::protect_side(
            self.deps.clone(),
            self.notice.clone(),
            self.deadline(),
            steps,
            !resumed,
            self.budget(),
        ));
        // On threads of the checkpoint module's own, never tokio's blocking pool; every group
        // and container under its own deadline.
        let deliveries =
            ckpt::deliver_with_async(groups.clone(), req.clone(), prior, &self.deps.metrics).await;
        let sent_at = Timestamp::now();
        let processes: usize = deliveries.iter().map(|d| d.sent()).sum();
        if processes > 0 || !resumed {
            let latency = sent_at
                .duration_since(self.notice.observed_at)
                .as_secs_f64();
            if processes > 0 && latency >= 0.0 && !resumed {
                self.deps
                    .metrics
                    .notice_to_signal
                    .get_or_create(&SourceLabels {
                        source: self.notice.source.as_str().into(),
                    })
                    .observe(latency);
            }
            info!(processes, checkpoint_deadline = %ck_deadline, "checkpoint signals sent");
            let _ = self.events.send(PlanEvent::Signalled {
                id: self.notice.id.clone(),
                at: sent_at,
                processes,
                checkpoint_deadline: ck_deadline,
            });
            let budget = self.budget();
            let told: Vec<bool> = deliveries.iter().map(|d| d.sent() > 0).collect();
            for (g, _) in groups.iter().zip(told).filter(|(_, sent)| *sent) {
                if let Some(pod) = &g.pod {
                    let _ = tokio::time::timeout(
                        budget,
                        self.deps.node.pod_event(
                            pod,
                            EventType::Normal,
                            reason::CHECKPOINT_SIGNALLED,
                            &format!(
                                "{} sent for {} notice {}; checkpoint by {}",
                                g.signal, req.kind, req.notice_id, ck_deadline
                            ),
                        ),
                    )
                    .await;
                }
            }
        }
        // What protect applied joins the record (both copies) before the wait.
        let applied = match side.await {
            Ok(s) => s.applied,
            Err(e) => {
                error!(error = %e, "protect task failed");
                None
            }
        };
        merge_applied(&mut state.applied, applied);
        self.persist(state, Phase::Signalled).await;
        let _ = self.events.send(PlanEvent::Protected {
            id: self.notice.id.clone(),
            at: Timestamp::now(),
        });

        // Wait; a deadline moved earlier moves the checkpoint deadline with it: the groups still
        // waiting then end `timeout`, as if their budget had been that short.
        let (ck_tx, ck_rx) = watch::channel(req.checkpoint_deadline);
        let results = {
            let wait = ckpt::wait_until(deliveries, &req, &self.deps.metrics, &self.cancel, ck_rx);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    r = &mut wait => break r,
                    changed = self.deadline.changed() => {
                        if changed.is_err() { continue; }
                        let new_ck = duration::checkpoint_deadline(self.deadline(), Timestamp::now(), reserve, self.cfg.checkpoint_timeout);
                        if new_ck < *ck_tx.borrow() {
                            info!(checkpoint_deadline = %new_ck, "deadline moved earlier: checkpoint wait cut short");
                            let _ = ck_tx.send(new_ck);
                        }
                    }
                }
            }
        };
        let budget = self.budget();
        for r in &results {
            match r.ack_latency {
                Some(d) => {
                    info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, ack_ms = d.as_millis() as u64, detail = %r.detail, "checkpoint result")
                }
                None => {
                    info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, detail = %r.detail, "checkpoint result")
                }
            }
            if let Some(pod) = &r.pod {
                let (kind, reason) = match r.outcome {
                    Outcome::Acked | Outcome::Exited => {
                        (EventType::Normal, reason::CHECKPOINT_ACKED)
                    }
                    Outcome::Timeout => (EventType::Warning, reason::CHECKPOINT_TIMEOUT),
                    Outcome::NoHandler => (EventType::Warning, reason::CHECKPOINT_NO_HANDLER),
                    Outcome::Skipped | Outcome::Failed | Outcome::Error => {
                        (EventType::Warning, reason::CHECKPOINT_FAILED)
                    }
                };
                let _ = tokio::time::timeout(
                    budget,
                    self.deps.node.pod_event(
                        pod,
                        kind,
                        reason,
                        &format!("checkpoint {}: {}", r.outcome.as_str(), r.detail),
                    ),
                )
                .await;
            }
        }
        let _ = self.events.send(PlanEvent::Checkpointed {
            id: self.notice.id.clone(),
            at: Timestamp::now(),
            results,
        });
    }

    /// Drain until the deadline. `Ok(Ok(report))` only for a complete drain; a blocked or failed
    /// one is reported (Event, metric) and returned as a [`DrainFailure`]. `Err` = cancelled.
    pub(super) async fn drain(&mut self) -> Result<Result<DrainReport, DrainFailure>, String> {
        let node = self.deps.node.clone();
        let _ = tokio::time::timeout(
            self.budget(),
            node.event(
                EventType::Normal,
                reason::DRAIN_STARTED,
                &format!("draining before {}", self.deadline()),
            ),
        )
        .await;
        let started = std::time::Instant::now();
        let outcome = loop {
            let req = DrainRequest {
                deadline: self.deadline(),
                force_delete_at_deadline: self.cfg.force_delete_at_deadline,
                concurrency: self.cfg.drain_concurrency,
            };
            let drain = node.drain(&req);
            tokio::pin!(drain);
            let outcome = tokio::select! {
                r = &mut drain => Some(r),
                // A deadline moved: restart the (idempotent) drain with it.
                Ok(()) = self.deadline.changed() => None,
                _ = self.cancel.cancelled() => return Err("cancelled during drain".into()),
            };
            match outcome {
                Some(Ok(report)) => break Ok(report),
                Some(Err(e)) => {
                    if e.is_retryable() && Timestamp::now() < self.deadline() {
                        self.deps.metrics.error("drain", e.metric_label());
                        warn!(error = %e, "drain failed; retrying");
                        tokio::time::sleep(crate::backoff::jittered(DRAIN_RETRY_PAUSE)).await;
                        continue;
                    }
                    break Err(e);
                }
                None => continue,
            }
        };
        self.deps
            .metrics
            .drain_duration
            .observe(started.elapsed().as_secs_f64());
        let budget = self.budget().max(SIDE_BUDGET_MIN);
        // A failure: what it was, its error label, its Event reason, the report if any.
        let (reason, label, event_reason, report) = match outcome {
            Ok(report) if report.complete() => {
                self.deps.metrics.action("drain", true);
                let _ = tokio::time::timeout(
                    budget,
                    node.event(
                        EventType::Normal,
                        reason::DRAIN_COMPLETE,
                        &format!("{} pods evicted", report.evicted.len()),
                    ),
                )
                .await;
                return Ok(Ok(report));
            }
            Ok(report) => {
                let reason = crate::node::drain::blocked_summary(&report);
                error!(blocked = %reason, "drain did not complete before the deadline");
                (reason, "blocked", reason::DRAIN_BLOCKED, Some(report))
            }
            Err(e) => {
                error!(error = %e, "drain failed; the node is not reported drained");
                (
                    format!("drain failed: {e}"),
                    e.metric_label(),
                    reason::DRAIN_FAILED,
                    None,
                )
            }
        };
        self.deps.metrics.error("drain", label);
        let _ = tokio::time::timeout(
            budget,
            node.event(EventType::Warning, event_reason, &reason),
        )
        .await;
        self.deps.metrics.action("drain", false);
        Ok(Err(DrainFailure { reason, report }))
    }

    pub(super) async fn acknowledge(&self) {
        let Some(source) = self
            .deps
            .sources
            .iter()
            .find(|s| s.name() == self.notice.source.as_str())
        else {
            return;
        };
        if self.cfg.dry_run {
            info!("dry-run: would acknowledge the event to {}", source.name());
            return;
        }
        match source.acknowledge(&self.notice).await {
            Ok(()) => self.deps.metrics.action("acknowledge", true),
            Err(e) => {
                self.deps.metrics.action("acknowledge", false);
                self.deps.metrics.error("notice", e.metric_label());
                warn!(error = %e, "acknowledging the event failed");
            }
        }
    }
}

/// Why a drain did not complete.
pub(super) struct DrainFailure {
    pub(super) reason: String,
    /// The report, when the drain ran to the deadline with pods still on the node.
    pub(super) report: Option<DrainReport>,
}

/// Add what one protect call applied to what the plan applied so far.
pub(super) fn merge_applied(into: &mut Applied, new: Option<Applied>) {
    if let Some(a) = new {
        into.cordoned |= a.cordoned;
        if into.taint_effect.is_none() {
            into.taint_effect = a.taint_effect;
        }
    }
}
