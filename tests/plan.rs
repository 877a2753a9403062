//! "One signal per notice", on the plan's in-process seam (`spotguard_testkit::plan`): the real
//! responder, notices pushed straight in, real trainers found by the real host discovery, a
//! recording node. Each case waits for the store's decision about the notice that must not start
//! a second plan (a `Duplicate`, a `DeadlineMoved`) and then checks what the trainers and the
//! node saw: no quiet window proves anything here.

use std::time::Duration;

use spotguard::responder::{Decision, PlanEvent};
use spotguard_testkit::plan::{interruption, rebalance, NodeCall, Responder, Seam};

/// Upper bound of every wait (a loaded machine); the cases take well under a second each.
const LIMIT: Duration = Duration::from_secs(30);

/// Wait for the `Done` of the plan of `id`.
async fn done(r: &mut Responder, id: &str) {
    r.event(LIMIT, |e| match e {
        PlanEvent::Done { id: d, .. } if d == id => Some(()),
        _ => None,
    })
    .await
}

/// The ids of the plans started or scheduled among `events`.
fn plans_seen(events: &[PlanEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            PlanEvent::NoticeSeen { notice, .. } => Some(notice.id.clone()),
            _ => None,
        })
        .collect()
}

fn started(d: &Decision) -> bool {
    matches!(d, Decision::StartInterruption(_))
}

fn protects(seam: &Seam) -> usize {
    seam.node.count(|c| matches!(c, NodeCall::Protect(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_notice_during_the_plan_is_a_duplicate_and_signals_once() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.held_trainer();
    let mut r = seam.start().await;
    let n = interruption("i-1", Duration::from_secs(120));
    assert!(started(&r.decide(n.clone()).await));
    t.wait_signals(1, LIMIT).await;
    // The same notice again while the trainer is still checkpointing.
    assert_eq!(r.decide(n.clone()).await, Decision::Duplicate);
    assert_eq!(plans_seen(&r.all_events()), ["i-1"], "one plan");
    t.release();
    done(&mut r, "i-1").await;
    assert_eq!(t.signals_seen(), 1);
    assert_eq!(protects(&seam), 1, "{:?}", seam.node.calls());
    assert_eq!(seam.node.drains().len(), 1, "{:?}", seam.node.calls());
    assert_eq!(r.decisions_counted("interruption", "duplicate"), 1);
    assert_eq!(r.decisions_counted("interruption", "start_interruption"), 1);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_after_the_plan_ended_is_a_duplicate() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.trainer();
    let mut r = seam.start().await;
    let n = interruption("i-1", Duration::from_secs(120));
    assert!(started(&r.decide(n.clone()).await));
    done(&mut r, "i-1").await;
    // The metadata service keeps serving the notice after the plan ended.
    assert_eq!(r.decide(n).await, Decision::Duplicate);
    assert_eq!(plans_seen(&r.all_events()), ["i-1"], "one plan");
    assert_eq!(t.signals_seen(), 1);
    assert_eq!(seam.node.drains().len(), 1);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_moved_earlier_moves_the_plan_and_a_later_one_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.held_trainer();
    let mut r = seam.start().await;
    assert!(started(
        &r.decide(interruption("i-1", Duration::from_secs(120)))
            .await
    ));
    t.wait_signals(1, LIMIT).await;
    // Another answer (another id: a re-stamped `time`) with an earlier deadline moves it.
    let earlier = interruption("i-2", Duration::from_secs(60));
    let moved_to = earlier.deadline.unwrap();
    assert_eq!(r.decide(earlier).await, Decision::DeadlineMoved(moved_to));
    // A later one moves nothing.
    let later = interruption("i-3", Duration::from_secs(110));
    assert_eq!(r.decide(later).await, Decision::Duplicate);
    assert_eq!(plans_seen(&r.all_events()), ["i-1"], "one plan");
    t.release();
    done(&mut r, "i-1").await;
    assert_eq!(t.signals_seen(), 1);
    assert_eq!(
        seam.node.drains(),
        vec![moved_to],
        "the drain keeps the moved deadline"
    );
    assert_eq!(r.decisions_counted("interruption", "deadline_moved"), 1);
    assert_eq!(r.decisions_counted("interruption", "duplicate"), 1);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_interruption_notices_under_two_ids_are_one_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.trainer();
    let mut r = seam.start().await;
    assert!(started(
        &r.decide(interruption("i-1", Duration::from_secs(120)))
            .await
    ));
    // A second source (or a re-stamped answer) reports it under another id, a hair later.
    let other = interruption("i-2", Duration::from_secs(120));
    assert_eq!(r.decide(other).await, Decision::Duplicate);
    assert_eq!(plans_seen(&r.all_events()), ["i-1"], "one plan");
    done(&mut r, "i-1").await;
    assert_eq!(t.signals_seen(), 1);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_then_an_interruption_are_two_plans_and_two_signals() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.trainer();
    let mut r = seam.start().await;
    assert!(matches!(r.decide(rebalance("r-1")).await, Decision::New(_)));
    r.event(LIMIT, |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    assert_eq!(t.signals_seen(), 1);
    // The recommendation served again: the one recommendation of this life.
    assert_eq!(r.decide(rebalance("r-2")).await, Decision::Duplicate);
    assert_eq!(plans_seen(&r.all_events()), ["r-1"], "one plan");
    assert!(started(
        &r.decide(interruption("i-1", Duration::from_secs(120)))
            .await
    ));
    done(&mut r, "i-1").await;
    assert_eq!(plans_seen(&r.all_events()), ["r-1", "i-1"]);
    assert_eq!(t.signals_seen(), 2, "a fresh save for the interruption");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_after_a_restart_with_the_record_is_a_duplicate() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.trainer();
    let mut r = seam.start().await;
    let n = interruption("i-1", Duration::from_secs(120));
    assert!(started(&r.decide(n.clone()).await));
    done(&mut r, "i-1").await;
    r.stop().await;

    // The metadata service still serves the notice to the restarted agent.
    let mut again = seam.start().await;
    assert_eq!(again.decide(n).await, Decision::Duplicate);
    assert_eq!(plans_seen(&again.all_events()), Vec::<String>::new());
    assert_eq!(t.signals_seen(), 1);
    assert_eq!(seam.node.drains().len(), 1);
    again.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_plan_resumes_without_signalling_again() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let t = seam.held_trainer();
    let mut r = seam.start().await;
    let n = interruption("i-1", Duration::from_secs(120));
    assert!(started(&r.decide(n.clone()).await));
    r.event(LIMIT, |e| {
        matches!(e, PlanEvent::Signalled { .. }).then_some(())
    })
    .await;
    t.wait_signals(1, LIMIT).await;
    // Stopped with no grace: the plan is cut while the trainer checkpoints.
    r.stop().await;

    let mut resumed = seam.start().await;
    assert_eq!(resumed.decide(n).await, Decision::Duplicate);
    assert_eq!(
        plans_seen(&resumed.all_events()),
        Vec::<String>::new(),
        "resumed, not started again"
    );
    t.release();
    done(&mut resumed, "i-1").await;
    assert_eq!(t.signals_seen(), 1, "a resumed plan never signals again");
    assert_eq!(seam.node.drains().len(), 1, "{:?}", seam.node.calls());
    resumed.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_appears_mid_plan_is_not_signalled_for_the_notice() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let first = seam.held_trainer();
    let mut r = seam.start().await;
    let n = interruption("i-1", Duration::from_secs(120));
    assert!(started(&r.decide(n.clone()).await));
    first.wait_signals(1, LIMIT).await;
    let late = seam.trainer();
    // The notice served again while the plan waits for the first trainer.
    assert_eq!(r.decide(n).await, Decision::Duplicate);
    assert_eq!(plans_seen(&r.all_events()), ["i-1"], "one plan");
    first.release();
    done(&mut r, "i-1").await;
    assert_eq!(first.signals_seen(), 1);
    assert_eq!(
        late.signals_seen(),
        0,
        "the plan signals what it found at the notice"
    );
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_started_after_the_signal_is_not_signalled_by_the_resumed_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let seam = Seam::new(tmp.path());
    let first = seam.held_trainer();
    let mut r = seam.start().await;
    assert!(started(
        &r.decide(interruption("i-1", Duration::from_secs(120)))
            .await
    ));
    let signalled_at = r
        .event(LIMIT, |e| match e {
            PlanEvent::Signalled { at, .. } => Some(*at),
            _ => None,
        })
        .await;
    first.wait_signals(1, LIMIT).await;
    r.stop().await;
    // A process counts as started after the signal once it starts more than the delivery's
    // slack (2 s: start times are clock ticks) after it: a precondition, not a proof.
    let after = spotguard::duration::add(signalled_at, Duration::from_millis(2100));
    tokio::time::sleep(spotguard::duration::until(after, jiff::Timestamp::now())).await;
    let late = seam.trainer();

    let mut resumed = seam.start().await;
    first.release();
    done(&mut resumed, "i-1").await;
    assert_eq!(first.signals_seen(), 1, "listed in the record: not again");
    assert_eq!(late.signals_seen(), 0, "started after the notice's signal");
    resumed.stop().await;
}
