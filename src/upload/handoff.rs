//! The sender's side of the relay (docs/relay.md): when a staged checkpoint's upload cannot
//! finish inside the notice, the same staged tree (the descriptors the upload took, read with
//! `pread` beside it) is streamed to a peer, and the upload and the relay race.
//!
//! When: at once with `--relay always`; with `--relay auto`, as soon as the upload's own
//! throughput (after its first second) says the bytes left will not be sent before the upload's
//! deadline. Peers are tried in the order given until one takes the whole tree; with
//! `--relay-copies N`, N peers at once, each copy going on to the next untried peer when its
//! own fails, the first publication winning. The race: the
//! upload published (or found it published) → the relay is given up (`DELETE`: the peer removes
//! its files); the peer published → the upload stops and the report says the relay published
//! it; the upload ended unpublished (its deadline) → the relay goes on, and its end is the
//! report. Exactly one manifest is written either way (it is created only if absent).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::engine::{Job, Report};
use super::staged::StagedTree;
use crate::relay::auth::Bearer;
use crate::relay::lease::Peers;
use crate::relay::metrics::RelayMetrics;
use crate::relay::send::{self, Peer, Source};
use crate::relay::wire::{self, Checkpoint, FileEntry, Reserve, State};
use crate::store::progress::Progress;

/// `--relay`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Relay only when the upload cannot finish before its deadline.
    Auto,
    /// Relay every staged checkpoint.
    Always,
}

/// The sender's relay settings.
#[derive(Clone, Debug)]
pub struct Relay {
    pub mode: Mode,
    /// `--relay-peers`, or (Kubernetes) the peers the Leases advertise.
    pub peers: Peers,
    /// Peers streamed to at once (`--relay-copies`; at most the peers there are): the first
    /// to publish wins, the others are stopped.
    pub copies: usize,
    /// The node key (`--relay-key-file`), or (Kubernetes) the relay token's file.
    pub key: Bearer,
    /// `spotguard_relay_sent_total`, counted as each peer's relay ends.
    pub metrics: Arc<RelayMetrics>,
}

/// A throughput is judged after this much of the upload.
const MEASURE_AFTER: Duration = Duration::from_secs(1);
/// How often the estimate is made.
const EVERY: Duration = Duration::from_millis(250);

/// What a relay of `job` sends: its reservation (`location` is the job's location, where the
/// owner marker is) and its files.
pub fn outgoing(
    job: &Job,
    location: &str,
    namespace: Option<&str>,
    sender: &str,
) -> (Reserve, Vec<Source>) {
    let m = &job.meta;
    let (files, sources) = files_of(&job.tree);
    let reserve = Reserve {
        version: wire::VERSION,
        sender: sender.to_string(),
        location: location.to_string(),
        namespace: namespace.map(str::to_string),
        checkpoint: Checkpoint {
            name: m.name.clone(),
            step: m.step,
            part: m.part,
            notice: m.notice.clone(),
            origin: m.origin.clone(),
            acked_at: m.acked_at.map(|t| t.to_string()),
            writer: m.writer.as_ref().map(|w| w.to_string()).unwrap_or_default(),
        },
        files,
    };
    (reserve, sources)
}

/// A staged tree's files as a reservation lists them (path and size, in the tree's order) and
/// as the sender reads them (the descriptors taken).
pub fn files_of(tree: &StagedTree) -> (Vec<FileEntry>, Vec<Source>) {
    tree.files
        .iter()
        .map(|f| {
            let entry = FileEntry {
                path: f.path.clone(),
                size: f.id.size,
            };
            let source = Source {
                file: f.file.clone(),
                size: f.id.size,
            };
            (entry, source)
        })
        .unzip()
}

/// Resolves when the relay should start: at once (`always`), or when the upload, at the
/// throughput it is getting, would not send its `total` bytes before `deadline` (`auto`; never
/// without a deadline). A PUT or a part counts only once the store answers it, so a slow
/// upload's first seconds show nothing done; the throughput is read as if every byte of the
/// requests under way were sent already: the relay starts once even that reading cannot finish
/// in time, never on an upload that is merely early in its first requests.
pub async fn relay_needed(mode: Mode, progress: &Progress, total: u64, deadline: Option<Instant>) {
    if mode == Mode::Always {
        return;
    }
    let Some(deadline) = deadline else {
        return std::future::pending().await;
    };
    let start = Instant::now();
    loop {
        tokio::time::sleep(EVERY).await;
        let elapsed = start.elapsed();
        if elapsed < MEASURE_AFTER {
            continue;
        }
        let done = progress.bytes_done.load(Ordering::Relaxed);
        let resumed = progress.bytes_resumed.load(Ordering::Relaxed);
        let sent = done.saturating_sub(resumed);
        let left = total.saturating_sub(done);
        if left == 0 {
            return std::future::pending().await;
        }
        let in_flight = progress.bytes_in_flight.load(Ordering::Relaxed);
        let time_left = deadline.saturating_duration_since(Instant::now());
        if let Some(rate) = cannot_finish(sent, in_flight, left, elapsed, time_left) {
            info!(
                bytes_left = left,
                bytes_in_flight = in_flight,
                rate_bps = rate,
                "the upload cannot finish before its deadline at its throughput: relaying to a peer"
            );
            return;
        }
    }
}

/// `Some(rate)` (bytes/s) when `left` bytes would not be sent within `time_left` at the rate
/// the upload showed over `elapsed`: `sent` bytes answered, plus the `in_flight` bytes of its
/// requests under way read as sent already.
fn cannot_finish(
    sent: u64,
    in_flight: u64,
    left: u64,
    elapsed: Duration,
    time_left: Duration,
) -> Option<u64> {
    let rate = sent.saturating_add(in_flight) as f64 / elapsed.as_secs_f64().max(1e-3);
    let needed = if rate > 0.0 {
        Duration::from_secs_f64((left as f64 / rate).min(1e9))
    } else {
        Duration::MAX
    };
    (needed > time_left).then_some(rate as u64)
}

/// Relay to `relay.copies` peers at once, each copy going on to the next peer not yet tried
/// when its peer fails; `Some(peer)` when a peer published it (or found it published): the
/// other copies are stopped then (a peer that had their commit publishes it regardless and
/// finds it published).
async fn relay_to_peers(
    relay: &Relay,
    reserve: Reserve,
    sources: Vec<Source>,
    deadline: Option<Instant>,
    cancel: CancellationToken,
) -> Option<String> {
    let key = match relay.key.read() {
        Ok(k) => k,
        Err(e) => {
            warn!(error = %e, "cannot relay: no bearer to present");
            relay.metrics.sent("failed");
            return None;
        }
    };
    // The peers as they stand now (the Leases' list moves on beside the relay).
    let peers: Arc<[Peer]> = relay.peers.current().into();
    if peers.is_empty() {
        warn!("cannot relay: no peer (none configured, or no live peer's Lease not under notice)");
    }
    let key: Arc<str> = key.into();
    let next = Arc::new(AtomicUsize::new(0));
    let stop = cancel.child_token();
    let mut copies = tokio::task::JoinSet::new();
    for _ in 0..relay.copies.clamp(1, peers.len().max(1)) {
        let (metrics, reserve, sources) = (relay.metrics.clone(), reserve.clone(), sources.clone());
        let (peers, key, next, stop) = (peers.clone(), key.clone(), next.clone(), stop.clone());
        copies.spawn(async move {
            one_copy(
                &metrics, &peers, &key, &next, reserve, sources, deadline, stop,
            )
            .await
        });
    }
    let mut won = None;
    while let Some(ended) = copies.join_next().await {
        if let (None, Ok(Some(peer))) = (&won, ended) {
            won = Some(peer);
            stop.cancel();
        }
    }
    won
}

/// One copy of the relay: to the next peer not yet tried (`next`), and on to the one after
/// while they fail; `Some(peer)` when a peer published it (or found it published).
#[allow(clippy::too_many_arguments)]
async fn one_copy(
    metrics: &RelayMetrics,
    peers: &[Peer],
    key: &str,
    next: &AtomicUsize,
    reserve: Reserve,
    sources: Vec<Source>,
    deadline: Option<Instant>,
    cancel: CancellationToken,
) -> Option<String> {
    while let Some(peer) = peers.get(next.fetch_add(1, Ordering::SeqCst)) {
        let ended = send::relay(
            peer,
            key,
            reserve.clone(),
            sources.clone(),
            deadline,
            cancel.clone(),
        )
        .await;
        metrics.sent(sent_outcome(&ended));
        match ended {
            Ok(s) if s.state.is_published() => {
                info!(peer = %peer, outcome = ?s.state, "the relay's peer published the checkpoint");
                return Some(peer.to_string());
            }
            Ok(s) => {
                warn!(peer = %peer, outcome = ?s.state, detail = ?s.detail, "the relay's peer did not publish the checkpoint");
                if s.state == State::Failed {
                    continue;
                }
                return None;
            }
            Err(crate::relay::Error::Cancelled { .. }) => return None,
            Err(e @ crate::relay::Error::Deadline { .. }) => {
                warn!(peer = %peer, error = %e, "the relay did not finish by the deadline");
                return None;
            }
            Err(e) => warn!(peer = %peer, error = %e, "relaying to a peer failed; trying the next"),
        }
    }
    None
}

/// The `outcome` of `spotguard_relay_sent_total` for one peer's relay.
fn sent_outcome(ended: &Result<wire::Status, crate::relay::Error>) -> &'static str {
    use crate::relay::Error;
    match ended {
        Ok(s) => match s.state {
            State::Published => "published",
            State::AlreadyPublished => "already_published",
            State::Failed | State::Aborted | State::Receiving | State::Publishing => "failed",
        },
        // Unavailable (the peer's agent stopping, its API server not answering a review): the
        // peer failed, as one that died would have; every other answer is its refusal.
        Err(Error::Refused { status: 503, .. }) => "failed",
        Err(Error::Refused { .. }) => "refused",
        Err(Error::Deadline { .. }) => "deadline",
        Err(Error::Cancelled { .. }) => "cancelled",
        Err(Error::Io { .. } | Error::Tls { .. } | Error::Peer { .. }) => "failed",
    }
}

/// The upload `upload` (of `total` bytes, `progress`, stopped by `upload_cancel`) raced by a
/// relay of `reserve` / `sources`. The report is the upload's, or, when the peer published the
/// checkpoint, the upload's with outcome `published` and `relayed_to` naming the peer. Before it
/// stops the upload for a peer's publication it sets `relayed` (the job's
/// [`Job::relayed`](super::engine::Job::relayed)): the upload then ends `relayed`, not
/// `cancelled`.
#[allow(clippy::too_many_arguments)]
pub async fn race(
    upload: JoinHandle<Report>,
    relay: Relay,
    reserve: Reserve,
    sources: Vec<Source>,
    progress: Arc<Progress>,
    total: u64,
    deadline: Option<Instant>,
    upload_cancel: CancellationToken,
    relayed: Arc<AtomicBool>,
) -> Report {
    let joined = |r: Result<Report, tokio::task::JoinError>, dest: &str| {
        r.unwrap_or_else(|e| Report::failed(dest, format!("the upload's task failed: {e}")))
    };
    let dest = format!("{}/{}", reserve.location, reserve.checkpoint.name);
    let mut upload = upload;
    tokio::select! {
        r = &mut upload => return joined(r, &dest),
        () = relay_needed(relay.mode, &progress, total, deadline) => {}
    }
    let relay_cancel = CancellationToken::new();
    let relaying = tokio::spawn({
        let (relay, cancel) = (relay.clone(), relay_cancel.clone());
        async move { relay_to_peers(&relay, reserve, sources, deadline, cancel).await }
    });
    let mut relaying = relaying;
    tokio::select! {
        r = &mut upload => {
            let report = joined(r, &dest);
            if report.outcome.is_published() {
                relay_cancel.cancel();
                let _ = relaying.await;
                return report;
            }
            // The upload gave up (its deadline): the relay is the checkpoint's chance.
            match relaying.await.ok().flatten() {
                Some(peer) => report.relayed(peer),
                None => report,
            }
        }
        r = &mut relaying => {
            match r.ok().flatten() {
                Some(peer) => {
                    // The peer published it: the upload stops, and ends `relayed`.
                    relayed.store(true, Ordering::SeqCst);
                    upload_cancel.cancel();
                    joined(upload.await, &dest).relayed(peer)
                }
                None => joined(upload.await, &dest),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn an_upload_early_in_its_first_requests_is_not_relayed() {
        // 100 MiB to send, 22 s left, nothing answered after 1 s but 64 MiB under way: at the
        // rate those requests allow, it may finish.
        assert_eq!(cannot_finish(0, 64 * MIB, 100 * MIB, S(1), S(21)), None);
        // Still nothing answered after 9 s: even those requests could not make 100 MiB in 13 s.
        assert!(cannot_finish(0, 64 * MIB, 100 * MIB, S(9), S(13)).is_some());
    }

    #[test]
    fn an_upload_too_slow_for_its_deadline_is_relayed() {
        // 5 MB/s answered for 4 s, 8 MiB under way, 800 MiB left, 18 s left.
        let rate = cannot_finish(20 * MIB, 8 * MIB, 800 * MIB, S(4), S(18)).unwrap();
        assert_eq!(rate, 7 * MIB);
        // Nothing at all under way or answered: it cannot finish.
        assert!(cannot_finish(0, 0, 1, S(1), S(100)).is_some());
        // Fast enough: 100 MiB/s for 100 MiB with 2 s left.
        assert_eq!(cannot_finish(100 * MIB, 0, 100 * MIB, S(1), S(2)), None);
    }
}
