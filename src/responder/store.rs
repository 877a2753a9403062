//! The notice store: the one place that decides what a notice means for the plan.
//!
//! - An interruption is terminal: the first one starts the one plan; every later interruption
//!   notice, from any source and whatever its id (some servers return a fresh `time` on every
//!   poll), only moves the deadline earlier. Once an interruption is accepted nothing else is
//!   new: rebalance, maintenance and cancellations are duplicates.
//! - The interruption that was handled disappearing from its source after its action time, and
//!   staying away, means the machine went through the action and came back (an EC2 spot
//!   hibernation): a new life ([`NoticeStore::resume_due`] names it once the absence has held for
//!   the hold the responder gives, see [`resume_hold`]). One missing answer is no proof: any
//!   interruption served again before then ends the absence. Before its action time a
//!   disappearance is nothing (an interruption is terminal).
//! - After the handled interruption's action time, only the *same* notice is swallowed: an
//!   interruption with other content (another id: another action or another time) means the
//!   machine went through the handled one and this is a new interruption
//!   ([`Decision::NewInterruption`]), whatever hold is running or record was restored. It is
//!   taken at its first answer when the handled notice was seen unchanged for at least
//!   [`RESTAMP_GRAIN`] (its source gives each notice a fixed content); otherwise (an agent restarted
//!   with only the record, or a notice seen for less than that) once the new content is served
//!   again unchanged at least [`RESTAMP_GRAIN`] later. A source that re-stamps the `time` on every
//!   answer (AWS's ec2-metadata-mock) never serves one content that long, so its answers stay the
//!   one interruption handled.
//! - One rebalance recommendation per life: the first starts its plan, every later rebalance
//!   notice of the same life is a duplicate, whatever its `noticeTime` (AWS's own metadata mock
//!   stamps it with the request time on every poll).
//! - Maintenance notices dedupe by id; a maintenance notice whose window moved is an update.
//! - `Cancelled(id)` cancels a known rebalance/maintenance notice once. The same id seen again
//!   *after* the cancel (first observed later: GCE's maintenance notice has a fixed id) is a new
//!   occurrence; a stale report observed before the cancel is not.
//! - A rebalance recommendation stays known after its expiry: the metadata service keeps serving
//!   the same `noticeTime` until the instance dies, and one recommendation is one plan.
//!
//! What a persisted plan record means at start-up is the record's ([`super::record`]); what it
//! restores here goes through [`NoticeStore::restore`] and [`NoticeStore::restore_interruption`].

use std::collections::HashMap;

/// The least change that moves an interruption's deadline earlier.
const DEADLINE_MOVE: std::time::Duration = std::time::Duration::from_secs(1);

use jiff::Timestamp;

use crate::notice::{Notice, NoticeKind};

/// What the responder should do with a notice.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// The first interruption: start the one interruption plan.
    StartInterruption(Notice),
    /// A later interruption notice with an earlier deadline.
    DeadlineMoved(Timestamp),
    /// An interruption with other content than the one handled, served after the handled one's
    /// action time: the machine went through that one (a new life), and this one starts its plan.
    NewInterruption(Notice),
    /// A new rebalance or maintenance notice.
    New(Notice),
    /// A known maintenance notice whose window changed.
    Updated(Notice),
    /// A known notice was cancelled.
    Cancel(String),
    /// The interruption that was handled left its source after its action time: a resume if it
    /// stays away ([`NoticeStore::resume_due`]); nothing is done yet.
    GoneAfterAction(String),
    /// Nothing new.
    Duplicate,
}

impl Decision {
    /// The `decision` label of `spotguard_notice_decisions_total` (one of
    /// [`crate::metrics::known::NOTICE_DECISIONS`]).
    pub fn label(&self) -> &'static str {
        match self {
            Decision::StartInterruption(_) => "start_interruption",
            Decision::DeadlineMoved(_) => "deadline_moved",
            Decision::NewInterruption(_) => "new_interruption",
            Decision::New(_) => "new",
            Decision::Updated(_) => "updated",
            Decision::Cancel(_) => "cancel",
            Decision::GoneAfterAction(_) => "gone_after_action",
            Decision::Duplicate => "duplicate",
        }
    }
}

#[derive(Clone, Debug)]
struct Seen {
    kind: NoticeKind,
    deadline: Option<Timestamp>,
    not_before: Option<Timestamp>,
    /// When the cancel was accepted.
    cancelled: Option<Timestamp>,
    /// Occurrences before this one (a fixed id seen again after its cancel).
    earlier: u32,
}

/// Dedupe and deadline state. Owned by the responder task; not shared.
#[derive(Debug, Default)]
pub struct NoticeStore {
    interruption: Option<(String, Timestamp)>,
    /// The id under which the source last served an interruption (it may change on every poll).
    interruption_last_id: Option<String>,
    /// The id under which the source last served the handled interruption's content.
    handled_last_id: Option<String>,
    /// The rebalance recommendation of this life, once one was accepted.
    rebalance: Option<String>,
    seen: HashMap<String, Seen>,
    /// The handled interruption left its source after its action time: its id and since when
    /// (by the responder's clock). Cleared by any interruption served again.
    gone: Option<(String, Timestamp)>,
    /// What the source's answers showed of the handled interruption's content.
    content: Content,
    /// An interruption with other content after the handled one's action time, waiting to be
    /// served again unchanged: its id and when it was first answered.
    candidate: Option<(String, Timestamp)>,
}

/// Whether the handled interruption's id names its content ([`NoticeStore::accept`]).
#[derive(Debug, Default)]
enum Content {
    /// Not known (no answer yet in this run, or answers less than [`RESTAMP_GRAIN`] apart).
    #[default]
    Unknown,
    /// One id since `since`; fixed once seen unchanged for [`RESTAMP_GRAIN`].
    Served { id: String, since: Timestamp },
    /// The same id in answers at least [`RESTAMP_GRAIN`] apart, never another: fixed content.
    Fixed,
    /// Served under another id without leaving: the source re-stamps its answers.
    Restamped,
}

/// How long one content must be served unchanged to show that its source does not re-stamp it:
/// ec2-metadata-mock stamps the `time` with the request's second, so any two of its answers a
/// second apart differ; two seconds leave a second for an answer's way to the store.
pub const RESTAMP_GRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// The least time the handled interruption must stay away after its action time before its
/// absence counts as a resume from hibernation, whatever the poll interval.
pub const RESUME_MIN_ABSENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Polls in a row that must find the handled interruption gone before its absence counts as a
/// resume (with the source polled every `poll_interval`).
pub const RESUME_ABSENT_POLLS: u32 = 3;

/// How long the handled interruption must stay away after its action time before it is taken as
/// a resume: [`RESUME_ABSENT_POLLS`] poll intervals, at least [`RESUME_MIN_ABSENCE`]. A flapping
/// answer (one 404, one timeout) is followed by the notice again within a poll or two.
pub fn resume_hold(poll_interval: std::time::Duration) -> std::time::Duration {
    poll_interval
        .saturating_mul(RESUME_ABSENT_POLLS)
        .max(RESUME_MIN_ABSENCE)
}

impl NoticeStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The active interruption's id and effective deadline, if one started.
    pub fn interruption(&self) -> Option<(&str, Timestamp)> {
        self.interruption.as_ref().map(|(id, d)| (id.as_str(), *d))
    }

    /// Restore an interruption plan persisted by an earlier run of the agent. What its source
    /// serves is not known yet: other content is taken only once served unchanged for
    /// [`RESTAMP_GRAIN`].
    pub fn restore_interruption(&mut self, id: &str, deadline: Timestamp) {
        self.interruption = Some((id.to_string(), deadline));
        self.handled_last_id = Some(id.to_string());
        self.content = Content::Unknown;
        self.candidate = None;
    }

    /// Restore a rebalance/maintenance notice persisted by an earlier run (so re-polls dedupe).
    pub fn restore(&mut self, id: &str, kind: NoticeKind, deadline: Option<Timestamp>) {
        if kind == NoticeKind::Rebalance {
            self.rebalance.get_or_insert_with(|| id.to_string());
        }
        self.seen.insert(
            id.to_string(),
            Seen {
                kind,
                deadline,
                not_before: deadline,
                cancelled: None,
                earlier: 0,
            },
        );
    }

    /// Whether `id` is a notice seen again after its cancel (a new occurrence of a fixed id): a
    /// `notice.json` naming it is from an earlier occurrence.
    pub fn reoccurred(&self, id: &str) -> bool {
        self.seen.get(id).is_some_and(|s| s.earlier > 0)
    }

    /// Decide what `notice` means. `now` resolves absent or past deadlines ("now").
    pub fn accept(&mut self, notice: &Notice, now: Timestamp) -> Decision {
        if notice.kind == NoticeKind::Interruption {
            return self.accept_interruption(notice, now);
        }
        if let Some((active, deadline)) = &self.interruption {
            // Only the interruption's own updates count now; its disappearance after its action
            // time starts an absence that may prove a resume.
            return match &notice.kind {
                NoticeKind::Cancelled(id)
                    if (id == active || Some(id) == self.interruption_last_id.as_ref())
                        && now >= *deadline =>
                {
                    if self.gone.is_none() {
                        self.gone = Some((id.clone(), now));
                    }
                    Decision::GoneAfterAction(id.clone())
                }
                _ => Decision::Duplicate,
            };
        }
        match &notice.kind {
            NoticeKind::Interruption => Decision::Duplicate,
            NoticeKind::Rebalance | NoticeKind::Maintenance => self.accept_other(notice),
            NoticeKind::Cancelled(id) => match self.seen.get_mut(id) {
                Some(seen) if seen.cancelled.is_none() && seen.kind != NoticeKind::Interruption => {
                    seen.cancelled = Some(now);
                    Decision::Cancel(id.clone())
                }
                Some(_) => Decision::Duplicate,
                None => {
                    // Remember it so that a later "active" report of a stale id is not acted on.
                    self.seen.insert(
                        id.clone(),
                        Seen {
                            kind: NoticeKind::Maintenance,
                            deadline: None,
                            not_before: None,
                            cancelled: Some(now),
                            earlier: 0,
                        },
                    );
                    Decision::Duplicate
                }
            },
        }
    }

    /// The handled interruption's id when it has stayed away from its source for `hold` (see
    /// [`resume_hold`]) since it left after its action time: the machine resumed. Once.
    pub fn resume_due(&mut self, now: Timestamp, hold: std::time::Duration) -> Option<String> {
        let (_, since) = self.gone.as_ref()?;
        let held = now.duration_since(*since);
        if held.is_negative() || held.unsigned_abs() < hold {
            return None;
        }
        self.gone.take().map(|(id, _)| id)
    }

    fn accept_interruption(&mut self, notice: &Notice, now: Timestamp) -> Decision {
        // Served again: whatever went missing in between was not a resume.
        self.gone = None;
        let deadline = crate::duration::effective_deadline(checked_deadline(notice), now);
        let Some((handled, current)) = &mut self.interruption else {
            self.interruption = Some((notice.id.clone(), deadline));
            self.interruption_last_id = Some(notice.id.clone());
            self.handled_last_id = Some(notice.id.clone());
            self.content = Content::Served {
                id: notice.id.clone(),
                since: now,
            };
            let mut n = notice.clone();
            n.deadline = Some(deadline);
            return Decision::StartInterruption(n);
        };
        self.interruption_last_id = Some(notice.id.clone());
        let same = notice.id == *handled || self.handled_last_id.as_ref() == Some(&notice.id);
        if !same && now >= *current {
            // After the handled one's action time: other content is another interruption, once
            // its source is known to give a notice one content.
            return self.other_content(notice, now);
        }
        self.candidate = None;
        self.content = match std::mem::take(&mut self.content) {
            Content::Unknown => Content::Served {
                id: notice.id.clone(),
                since: now,
            },
            Content::Served { id, .. } if id != notice.id => Content::Restamped,
            Content::Served { id, since } => {
                if crate::duration::until(now, since) >= RESTAMP_GRAIN {
                    Content::Fixed
                } else {
                    Content::Served { id, since }
                }
            }
            Content::Fixed if self.handled_last_id.as_ref() != Some(&notice.id) => {
                Content::Restamped
            }
            other => other,
        };
        self.handled_last_id = Some(notice.id.clone());
        // Restated a hair earlier (a deadline the source computes again on each answer, to
        // the millisecond) is the same deadline: only a real move counts.
        if crate::duration::until(*current, deadline) >= DEADLINE_MOVE {
            *current = deadline;
            return Decision::DeadlineMoved(deadline);
        }
        Decision::Duplicate
    }

    /// `notice` has other content than the handled interruption, whose action time has passed.
    fn other_content(&mut self, notice: &Notice, now: Timestamp) -> Decision {
        let new = match (&self.content, &self.candidate) {
            (Content::Restamped, _) => false,
            (Content::Fixed, _) => true,
            (_, Some((id, since))) if *id == notice.id => {
                crate::duration::until(now, *since) >= RESTAMP_GRAIN
            }
            _ => {
                self.candidate = Some((notice.id.clone(), now));
                false
            }
        };
        if !new {
            return Decision::Duplicate;
        }
        let mut n = notice.clone();
        n.deadline = Some(crate::duration::effective_deadline(
            checked_deadline(notice),
            now,
        ));
        Decision::NewInterruption(n)
    }

    fn accept_other(&mut self, notice: &Notice) -> Decision {
        let fresh = |earlier| Seen {
            kind: notice.kind.clone(),
            deadline: notice.deadline,
            not_before: notice.not_before,
            cancelled: None,
            earlier,
        };
        if notice.kind == NoticeKind::Rebalance {
            // One recommendation per life, whatever its id: a moving `noticeTime` is the same one.
            if self.rebalance.as_ref().is_some_and(|r| *r != notice.id) {
                return Decision::Duplicate;
            }
            self.rebalance = Some(notice.id.clone());
        }
        match self.seen.get_mut(&notice.id) {
            None => {
                self.seen.insert(notice.id.clone(), fresh(0));
                Decision::New(notice.clone())
            }
            // Seen again after the cancel, first observed after it: a new occurrence.
            Some(seen) if seen.cancelled.is_some_and(|at| notice.observed_at > at) => {
                *seen = fresh(seen.earlier + 1);
                Decision::New(notice.clone())
            }
            Some(seen) if seen.cancelled.is_some() => Decision::Duplicate,
            Some(seen)
                if notice.kind == NoticeKind::Maintenance
                    && (seen.deadline != notice.deadline
                        || seen.not_before != notice.not_before) =>
            {
                seen.deadline = notice.deadline;
                seen.not_before = notice.not_before;
                Decision::Updated(notice.clone())
            }
            Some(_) => Decision::Duplicate,
        }
    }
}

/// The deadline of `notice` as far as it can be trusted: an interruption's deadline outside
/// [first seen, first seen + the most notice its cloud gives] (a skewed or bogus clock: an EC2
/// instance-action `time`) is clamped into it ([`crate::notice::CloudFacts::max_interruption_notice`]).
pub fn checked_deadline(notice: &Notice) -> Option<Timestamp> {
    let max = notice.source.facts().max_interruption_notice;
    let Some(max) = max.filter(|_| notice.kind == NoticeKind::Interruption) else {
        return notice.deadline;
    };
    let first_seen = notice.observed_at;
    let latest = crate::duration::add(first_seen, max);
    Some(match notice.deadline {
        Some(d) if d > latest => latest,
        Some(d) if d < first_seen => first_seen,
        Some(d) => d,
        None => first_seen,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::notice::Cloud;
    use crate::responder::record::{remember, resume, Resume};

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn notice(id: &str, kind: NoticeKind, deadline: Option<i64>) -> Notice {
        Notice {
            id: id.into(),
            kind,
            source: Cloud::Aws,
            deadline: deadline.map(ts),
            not_before: deadline.map(ts),
            detail: String::new(),
            restart: false,
            published_at: None,
            maintenance: crate::notice::MaintenanceKind::Other,
            observed_at: ts(0),
            cloud_event_id: None,
        }
    }

    #[test]
    fn first_interruption_starts_the_plan_later_ones_only_move_the_deadline_earlier() {
        let mut s = NoticeStore::new();
        let now = ts(0);
        let d = s.accept(&notice("a", NoticeKind::Interruption, Some(120)), now);
        assert!(matches!(d, Decision::StartInterruption(ref n) if n.deadline == Some(ts(120))));
        // Same content again: duplicate.
        assert_eq!(
            s.accept(&notice("a", NoticeKind::Interruption, Some(120)), now),
            Decision::Duplicate
        );
        // Different id (fresh `time` on every poll), later deadline: never a second plan.
        assert_eq!(
            s.accept(&notice("b", NoticeKind::Interruption, Some(125)), now),
            Decision::Duplicate
        );
        // Another source, earlier deadline: moves it.
        let mut g = notice("c", NoticeKind::Interruption, Some(90));
        g.source = Cloud::Gce;
        assert_eq!(s.accept(&g, now), Decision::DeadlineMoved(ts(90)));
        assert_eq!(s.interruption(), Some(("a", ts(90))));
    }

    #[test]
    fn every_decision_label_is_a_known_series() {
        let n = notice("a", NoticeKind::Interruption, Some(1));
        let all = [
            Decision::StartInterruption(n.clone()),
            Decision::DeadlineMoved(ts(1)),
            Decision::NewInterruption(n.clone()),
            Decision::New(n.clone()),
            Decision::Updated(n),
            Decision::Cancel("a".into()),
            Decision::GoneAfterAction("a".into()),
            Decision::Duplicate,
        ];
        let labels: Vec<&str> = all.iter().map(Decision::label).collect();
        assert_eq!(labels, crate::metrics::known::NOTICE_DECISIONS);
    }

    #[test]
    fn missing_or_past_deadline_means_now() {
        let mut s = NoticeStore::new();
        let now = ts(50);
        match s.accept(&notice("x", NoticeKind::Interruption, Some(10)), now) {
            Decision::StartInterruption(n) => assert_eq!(n.deadline, Some(now)),
            d => panic!("{d:?}"),
        }
        let mut s = NoticeStore::new();
        match s.accept(&notice("y", NoticeKind::Interruption, None), now) {
            Decision::StartInterruption(n) => assert_eq!(n.deadline, Some(now)),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn maintenance_dedupes_by_id_updates_on_window_change_and_cancels_once() {
        let mut s = NoticeStore::new();
        let now = ts(0);
        let m = notice("ev-1", NoticeKind::Maintenance, Some(3600));
        assert!(matches!(s.accept(&m, now), Decision::New(_)));
        assert_eq!(s.accept(&m, now), Decision::Duplicate);
        let moved = notice("ev-1", NoticeKind::Maintenance, Some(7200));
        assert!(matches!(s.accept(&moved, now), Decision::Updated(_)));
        let c = notice("ev-1", NoticeKind::Cancelled("ev-1".into()), None);
        assert_eq!(s.accept(&c, now), Decision::Cancel("ev-1".into()));
        assert_eq!(s.accept(&c, now), Decision::Duplicate);
        // A stale "active" report after the cancel is not acted on.
        assert_eq!(s.accept(&moved, now), Decision::Duplicate);
        // Cancel of an unknown id: nothing to undo.
        let c2 = notice("zz", NoticeKind::Cancelled("zz".into()), None);
        assert_eq!(s.accept(&c2, now), Decision::Duplicate);
    }

    #[test]
    fn one_rebalance_recommendation_is_one_plan_for_ever() {
        let mut s = NoticeStore::new();
        let r = notice("r1", NoticeKind::Rebalance, None);
        assert!(matches!(s.accept(&r, ts(0)), Decision::New(_)));
        assert_eq!(s.accept(&r, ts(1)), Decision::Duplicate);
        // Long after any expiry, the same noticeTime is still the same recommendation.
        assert_eq!(s.accept(&r, ts(100_000)), Decision::Duplicate);
        // Another noticeTime in the same life (a server that re-stamps it on every poll) is
        // still the one recommendation of this life.
        let r2 = notice("r2", NoticeKind::Rebalance, None);
        assert_eq!(s.accept(&r2, ts(100_001)), Decision::Duplicate);
        // Also after a restart that restored the recommendation from the record.
        let mut restarted = NoticeStore::new();
        restarted.restore("r1", NoticeKind::Rebalance, None);
        assert_eq!(restarted.accept(&r2, ts(100_002)), Decision::Duplicate);
    }

    #[test]
    fn after_an_interruption_nothing_else_is_new() {
        let mut s = NoticeStore::new();
        let m = notice("ev-1", NoticeKind::Maintenance, Some(3600));
        assert!(matches!(s.accept(&m, ts(0)), Decision::New(_)));
        assert!(matches!(
            s.accept(&notice("i", NoticeKind::Interruption, Some(120)), ts(1)),
            Decision::StartInterruption(_)
        ));
        for n in [
            notice("r", NoticeKind::Rebalance, None),
            notice("ev-2", NoticeKind::Maintenance, Some(7200)),
            notice("ev-1", NoticeKind::Maintenance, Some(9000)),
            notice("c", NoticeKind::Cancelled("ev-1".into()), None),
        ] {
            assert_eq!(s.accept(&n, ts(2)), Decision::Duplicate, "{n:?}");
        }
    }

    #[test]
    fn a_handled_interruption_gone_after_its_time_and_staying_away_is_a_resume() {
        let hold = Duration::from_secs(10);
        let mut s = NoticeStore::new();
        let mut first = notice("i-1", NoticeKind::Interruption, Some(30));
        first.observed_at = ts(0);
        assert!(matches!(
            s.accept(&first, ts(0)),
            Decision::StartInterruption(_)
        ));
        // Served again under another id (a re-stamped `time`): the source cancels that id.
        let mut again = notice("i-2", NoticeKind::Interruption, Some(31));
        again.observed_at = ts(1);
        assert_eq!(s.accept(&again, ts(1)), Decision::Duplicate);
        let gone = notice("x", NoticeKind::Cancelled("i-2".into()), None);
        // Before its action time an interruption is terminal.
        assert_eq!(s.accept(&gone, ts(10)), Decision::Duplicate);
        assert_eq!(s.resume_due(ts(100), hold), None);
        assert_eq!(
            s.accept(&gone, ts(40)),
            Decision::GoneAfterAction("i-2".into())
        );
        assert_eq!(s.resume_due(ts(49), hold), None, "not held long enough");
        // An unrelated cancel is not a resume and does not restart the absence.
        let other = notice("y", NoticeKind::Cancelled("ev-9".into()), None);
        assert_eq!(s.accept(&other, ts(41)), Decision::Duplicate);
        assert_eq!(s.resume_due(ts(50), hold), Some("i-2".into()));
        assert_eq!(s.resume_due(ts(60), hold), None, "once");
    }

    #[test]
    fn one_missing_answer_after_the_action_time_is_no_resume() {
        let hold = resume_hold(Duration::from_millis(200));
        assert_eq!(hold, RESUME_MIN_ABSENCE);
        assert_eq!(resume_hold(Duration::from_secs(5)), Duration::from_secs(15));
        let mut s = NoticeStore::new();
        let n = notice("i-1", NoticeKind::Interruption, Some(30));
        assert!(matches!(
            s.accept(&n, ts(0)),
            Decision::StartInterruption(_)
        ));
        let gone = notice("x", NoticeKind::Cancelled("i-1".into()), None);
        assert_eq!(
            s.accept(&gone, ts(40)),
            Decision::GoneAfterAction("i-1".into())
        );
        // The next poll serves the notice again: the same notice, the absence is over.
        assert_eq!(s.accept(&n, ts(41)), Decision::Duplicate);
        assert_eq!(s.resume_due(ts(1000), hold), None);
        assert_eq!(s.interruption().map(|(id, _)| id), Some("i-1"));
    }

    /// The handled interruption, served unchanged for longer than [`RESTAMP_GRAIN`] from ts(0)
    /// (its action time ts(30)), then gone at ts(40): the resume hold runs.
    fn handled_and_gone() -> (NoticeStore, Notice) {
        let mut s = NoticeStore::new();
        let n = notice("i-hibernate", NoticeKind::Interruption, Some(30));
        assert!(matches!(
            s.accept(&n, ts(0)),
            Decision::StartInterruption(_)
        ));
        for at in 1..=5 {
            assert_eq!(s.accept(&n, ts(at)), Decision::Duplicate);
        }
        let gone = notice("x", NoticeKind::Cancelled("i-hibernate".into()), None);
        assert_eq!(
            s.accept(&gone, ts(40)),
            Decision::GoneAfterAction("i-hibernate".into())
        );
        (s, n)
    }

    #[test]
    fn another_interruption_during_the_resume_hold_is_new_at_once() {
        let (mut s, handled) = handled_and_gone();
        let mut other = notice("i-terminate", NoticeKind::Interruption, Some(100));
        other.observed_at = ts(43);
        match s.accept(&other, ts(43)) {
            Decision::NewInterruption(n) => {
                assert_eq!(n.id, "i-terminate");
                assert_eq!(n.deadline, Some(ts(100)));
            }
            d => panic!("{d:?}"),
        }
        // The same notice coming back instead is still swallowed, and no resume.
        let (mut s, _) = handled_and_gone();
        assert_eq!(s.accept(&handled, ts(41)), Decision::Duplicate);
        assert_eq!(s.resume_due(ts(1000), Duration::from_secs(10)), None);
    }

    #[test]
    fn after_a_restart_another_interruption_is_new_once_served_unchanged() {
        let mut s = NoticeStore::new();
        s.restore_interruption("i-hibernate", ts(30));
        let mut other = notice("i-terminate", NoticeKind::Interruption, Some(200));
        other.observed_at = ts(41);
        // The restored one again: the same notice.
        let handled = notice("i-hibernate", NoticeKind::Interruption, Some(30));
        assert_eq!(s.accept(&handled, ts(40)), Decision::Duplicate);
        assert_eq!(
            s.accept(&other, ts(41)),
            Decision::Duplicate,
            "first answer"
        );
        assert_eq!(
            s.accept(&other, ts(42)),
            Decision::Duplicate,
            "within the grain"
        );
        assert!(matches!(
            s.accept(&other, ts(43)),
            Decision::NewInterruption(ref n) if n.id == "i-terminate"
        ));
        // Before the handled one's action time, other content is the same interruption.
        let mut s = NoticeStore::new();
        s.restore_interruption("i-1", ts(100));
        for at in [1, 5, 10] {
            assert_eq!(
                s.accept(&notice("i-2", NoticeKind::Interruption, Some(120)), ts(at)),
                Decision::Duplicate
            );
        }
    }

    #[test]
    fn a_source_that_restamps_its_answers_never_looks_new() {
        // Every answer another id (a `time` of the request's second), the action time passed.
        let mut s = NoticeStore::new();
        let answer = |t: i64| {
            let mut n = notice(&format!("i-{t}"), NoticeKind::Interruption, Some(t));
            n.observed_at = ts(t);
            n
        };
        assert!(matches!(
            s.accept(&answer(0), ts(0)),
            Decision::StartInterruption(_)
        ));
        for t in 1..60 {
            assert_eq!(s.accept(&answer(t), ts(t)), Decision::Duplicate, "at {t}");
        }
        // A 404 between answers (the flap): still the one interruption.
        let gone = notice("x", NoticeKind::Cancelled("i-59".into()), None);
        assert_eq!(
            s.accept(&gone, ts(60)),
            Decision::GoneAfterAction("i-59".into())
        );
        for t in 61..70 {
            assert_eq!(s.accept(&answer(t), ts(t)), Decision::Duplicate, "at {t}");
        }
        // After a restart too: a re-stamped answer changes before it could be taken.
        let mut s = NoticeStore::new();
        s.restore_interruption("i-0", ts(0));
        for t in 100..110 {
            assert_eq!(s.accept(&answer(t), ts(t)), Decision::Duplicate, "at {t}");
        }
    }

    #[test]
    fn an_ec2_deadline_is_clamped_into_the_two_minutes_after_first_sight() {
        let clamp = |d: i64| {
            let n = notice("i", NoticeKind::Interruption, Some(d));
            checked_deadline(&n).unwrap()
        };
        // observed_at = ts(0)
        assert_eq!(clamp(90), ts(90));
        assert_eq!(clamp(3600), ts(120), "a clock an hour ahead: two minutes");
        assert_eq!(clamp(-600), ts(0), "before first sight: now");
        let mut s = NoticeStore::new();
        let d = s.accept(&notice("i", NoticeKind::Interruption, Some(3600)), ts(1));
        assert!(matches!(d, Decision::StartInterruption(ref n) if n.deadline == Some(ts(120))));
        // Other clouds' deadlines are their own (GCE: detection + notice).
        let mut g = notice("g", NoticeKind::Interruption, Some(3600));
        g.source = Cloud::Gce;
        assert_eq!(checked_deadline(&g), Some(ts(3600)));
    }

    #[test]
    fn a_fixed_id_seen_again_after_its_cancel_is_a_new_occurrence() {
        let mut s = NoticeStore::new();
        let m = notice("gce-m", NoticeKind::Maintenance, None);
        assert!(matches!(s.accept(&m, ts(0)), Decision::New(_)));
        let c = notice("x", NoticeKind::Cancelled("gce-m".into()), None);
        assert_eq!(s.accept(&c, ts(10)), Decision::Cancel("gce-m".into()));
        // A stale report first observed before the cancel: nothing.
        assert_eq!(s.accept(&m, ts(11)), Decision::Duplicate);
        // The event again, observed after the cancel: a new plan.
        let mut again = m.clone();
        again.observed_at = ts(20);
        assert!(matches!(s.accept(&again, ts(20)), Decision::New(_)));
        assert_eq!(s.accept(&again, ts(21)), Decision::Duplicate);
    }

    #[test]
    fn restored_interruption_is_not_started_again() {
        let mut s = NoticeStore::new();
        s.restore_interruption("a", ts(100));
        assert_eq!(
            s.accept(&notice("a", NoticeKind::Interruption, Some(100)), ts(0)),
            Decision::Duplicate
        );
    }

    mod lives {
        //! Property: over any sequence of notices, agent restarts (with a persisted record that
        //! may be mid-plan) and reboots (new boot id), the agent signals at most once per
        //! interruption per boot, and in every boot that sees an interruption it signals: never a
        //! permanently disarmed agent. Rebalance recommendations: at most one plan each per boot.
        use super::*;
        use crate::node::Applied;
        use crate::responder::record::Phase;
        use crate::responder::record::PlanState;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Interruption(u8),
            /// The metadata service serves its recommendation: the same one, or a newer one
            /// (a new `noticeTime` replaces the old, which is never served again).
            Rebalance(bool),
            /// The agent restarts; the plan in progress was cut at this phase.
            Restart(bool),
            /// Stop/start: a new boot id (the cloud's notices of the old life are gone).
            Reboot,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u8..3).prop_map(Op::Interruption),
                any::<bool>().prop_map(Op::Rebalance),
                any::<bool>().prop_map(Op::Restart),
                Just(Op::Reboot),
            ]
        }

        fn record(n: &Notice, phase: Phase, boot: &str, at: Timestamp) -> PlanState {
            PlanState {
                id: n.id.clone(),
                kind: n.kind.clone(),
                source: n.source,
                deadline: n.deadline,
                phase,
                signalled_at: Some(at),
                applied: Applied::default(),
                boot_id: Some(boot.to_string()),
                restart: false,
                detail: String::new(),
                failure: None,
                updated_at: at,
            }
        }

        proptest! {
            #[test]
            fn at_most_one_signal_per_interruption_per_boot_and_never_disarmed(
                ops in proptest::collection::vec(op(), 1..60)
            ) {
                let mut boot = 0u32;
                let mut clock = 0i64;
                let mut store = NoticeStore::new();
                let mut persisted: Option<PlanState> = None;
                // Per boot: interruption signals, whether an interruption was seen,
                // rebalance plans per id.
                let mut signals = vec![0u32];
                let mut seen_interruption = vec![false];
                let mut rebalance_plans: Vec<HashMap<String, u32>> = vec![HashMap::new()];
                let mut recommendation = 0u32;
                for op in ops {
                    clock += 7;
                    let now = ts(clock);
                    let boot_id = format!("boot-{boot}");
                    match op {
                        Op::Interruption(k) => {
                            let mut n = notice(&format!("i{k}"), NoticeKind::Interruption, Some(clock + 120));
                            n.observed_at = now;
                            seen_interruption[boot as usize] = true;
                            if let Decision::StartInterruption(n) = store.accept(&n, now) {
                                signals[boot as usize] += 1;
                                persisted = Some(record(&n, Phase::Done, &boot_id, now));
                            }
                        }
                        Op::Rebalance(newer) => {
                            if newer {
                                recommendation += 1;
                            }
                            let mut n = notice(&format!("r{recommendation}"), NoticeKind::Rebalance, None);
                            n.observed_at = now;
                            if let Decision::New(n) = store.accept(&n, now) {
                                if store.interruption().is_none() {
                                    *rebalance_plans[boot as usize].entry(n.id.clone()).or_default() += 1;
                                    persisted = Some(record(&n, Phase::Undone, &boot_id, now));
                                }
                            }
                        }
                        Op::Restart(mid_plan) => {
                            if mid_plan {
                                if let Some(p) = persisted.as_mut() {
                                    if p.kind == NoticeKind::Interruption {
                                        p.phase = Phase::Signalled;
                                    }
                                }
                            }
                            store = NoticeStore::new();
                            if let Some(p) = persisted.clone() {
                                match resume(&p, Some(&boot_id)) {
                                    Resume::PreviousLife => persisted = None,
                                    Resume::Remember | Resume::AwaitExpiry | Resume::Continue => {
                                        remember(&mut store, &p, now)
                                    }
                                }
                            }
                        }
                        Op::Reboot => {
                            boot += 1;
                            signals.push(0);
                            seen_interruption.push(false);
                            rebalance_plans.push(HashMap::new());
                            store = NoticeStore::new();
                            let boot_id = format!("boot-{boot}");
                            if let Some(p) = persisted.clone() {
                                match resume(&p, Some(&boot_id)) {
                                    Resume::PreviousLife => persisted = None,
                                    _ => prop_assert!(false, "a record of another boot resumed"),
                                }
                            }
                        }
                    }
                }
                for (b, n) in signals.iter().enumerate() {
                    prop_assert!(*n <= 1, "boot {b}: {n} interruption signals");
                    prop_assert_eq!(*n == 1, seen_interruption[b], "boot {}: disarmed", b);
                }
                for (b, plans) in rebalance_plans.iter().enumerate() {
                    for (id, n) in plans {
                        prop_assert!(*n <= 1, "boot {b}: rebalance {id} planned {n} times");
                    }
                }
            }
        }
    }
}
